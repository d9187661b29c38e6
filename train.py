"""Train a DFlash2 (or, with --dflash, a plain DFlash) draft. One readable loop, nanoGPT-shaped.

    python train.py --data out/features                          # offline: features from prepare.py
    python train.py --online --data convs.jsonl                  # online: the target runs here
    torchrun --standalone --nproc_per_node=2 train.py ...        # DDP (gloo on CPU, nccl on GPU)

Each optimizer step: for every micro-batch, sample anchors, run all anchored blocks of each sequence
through the draft in one pass (model.forward_training), and get the objective's numerator and
denominator (loss.py). Gradients of all numerators are summed over micro-batches and ranks and
divided once by the global denominator, so 2 ranks x 1 micro-batch == 1 rank x 2 micro-batches.
"""
import argparse
import dataclasses
import gc
import json
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import config
import loss as L
import model
import prepare


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--draft-config", default="configs/smollm2-135m-dflash2.json", help="draft config file or directory")
    a("--target", default=None, help="HF directory or hub name; default: the embedded SmolLM2-135M-Instruct")
    a("--data", required=True, help="feature directory (prepare.py --features) or, with --online, a JSONL of conversations")
    a("--eval-data", default=None, help="held-out data of the same kind as --data; default: split off --eval-fraction")
    a("--eval-fraction", type=float, default=0.05)
    a("--online", action="store_true", help="run the target in this process to get features every step")
    a("--max-length", type=int, default=512, help="online: truncate conversations to this many tokens")
    # architecture overrides, validated by the same rules as the config file
    a("--dflash", action="store_true", help="plain DFlash baseline: no convolution, no selector")
    a("--block-size", type=int)
    a("--num-layers", type=int)
    a("--conv-kernel-size", type=int)
    a("--conv-group-size", type=int)
    a("--selector-rank", type=int)
    a("--selector-top-k", type=int)
    # objective
    a("--loss", choices=["ce", "kl", "tv", "lk"], default="ce")
    a("--position-weighting", choices=["exp", "dpace"], default="exp")
    a("--gamma", type=float, default=None, help="exp decay; default 7/5/4 for block size 16/10/8")
    a("--dpace-alpha", type=float, default=0.5)
    a("--num-anchors", type=int, default=512)
    a("--selector-loss-alpha", type=float, default=1.0)
    a("--selector-warmup-ratio", type=float, default=0.0)
    a("--selector-ramp-ratio", type=float, default=0.0)
    a("--selector-stop-gradient", action="store_true")
    a("--selector-miss", choices=["strict", "replace"], default="strict")
    a("--chunk-blocks", type=int, default=64, help="objective chunk (anchors) to bound logits memory; 0 = off")
    # optimisation
    a("--lr", type=float, default=6e-4)
    a("--min-lr-ratio", type=float, default=0.1)
    a("--warmup-ratio", type=float, default=0.04)
    a("--lr-schedule", choices=["cosine", "constant"], default="cosine")
    a("--weight-decay", type=float, default=0.0)
    a("--grad-clip", type=float, default=1.0)
    a("--batch-size", type=int, default=1, help="sequences per micro-batch per rank")
    a("--grad-accum", type=int, default=1)
    a("--epochs", type=int, default=1)
    a("--max-steps", type=int, default=None, help="optimizer steps; overrides --epochs")
    a("--steps-this-run", type=int, default=None,
      help="stop (with a checkpoint) after this many steps of this invocation; --resume continues")
    # running
    a("--out-dir", default="out/draft")
    a("--resume", action="store_true", help="continue from OUT_DIR/ckpt.pt")
    a("--save-interval", type=int, default=200)
    a("--eval-interval", type=int, default=200)
    a("--eval-samples", type=int, default=64, help="at most this many held-out sequences per evaluation")
    a("--log-interval", type=int, default=10)
    a("--compile", action="store_true", help="torch.compile the draft")
    a("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 autocast on GPU, fp32 on CPU")
    a("--seed", type=int, default=0)
    a("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- config and data
def build_config(args) -> config.DraftConfig:
    c = config.load_config(args.draft_config)
    o = {k: getattr(args, k) for k in ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank",
                                        "selector_top_k") if getattr(args, k) is not None}
    if args.num_layers is not None:
        o["num_hidden_layers"] = args.num_layers
        o["layer_types"] = [c.layer_types[min(i, len(c.layer_types) - 1)] for i in range(args.num_layers)]
    c = dataclasses.replace(c, **o)             # __post_init__ validates the overridden config
    return config.plain_dflash(c) if args.dflash else c


def load_samples(path, args, tokenizer):
    """A list of dicts with input_ids [S], loss_mask [S] (+ features [S, n_t*H], target_hidden [S, H] offline)."""
    if args.online:
        convs, _ = prepare.read_conversations(path)
        samples = []
        for m in convs:
            ids, mask = prepare.tokenize_conversation(tokenizer, m, args.max_length)
            samples.append({"input_ids": ids, "loss_mask": mask})
    else:
        samples = prepare.load_features(path)
    # a sequence without two consecutive supervised tokens has no anchor
    return [s for s in samples if (s["loss_mask"][:-1] * s["loss_mask"][1:]).sum() > 0]


def sample_anchors(loss_mask, num_anchors: int, generator):
    """Positions p with loss_mask[p] = loss_mask[p+1] = 1, up to num_anchors drawn uniformly without
    replacement, sorted (SPEC section 4)."""
    cand = ((loss_mask[:-1] > 0) & (loss_mask[1:] > 0)).nonzero().squeeze(-1)
    pick = torch.randperm(len(cand), generator=generator)[:num_anchors]
    return cand[pick].sort().values


def collate(samples, keys, num_anchors, seed):
    """Right-pad a list of samples into a batch; anchors are seeded per (seed, key) so that every
    rank / accumulation layout draws the same anchors for the same sequence."""
    N, S = len(samples), max(len(s["input_ids"]) for s in samples)
    batch = {"input_ids": torch.zeros(N, S, dtype=torch.long), "loss_mask": torch.zeros(N, S, dtype=torch.long),
             "attention_mask": torch.zeros(N, S, dtype=torch.long)}
    for name in ("features", "target_hidden"):
        if name in samples[0]:
            batch[name] = torch.zeros(N, S, samples[0][name].shape[-1])
    anchors = []
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        batch["input_ids"][i, :n], batch["loss_mask"][i, :n], batch["attention_mask"][i, :n] = \
            s["input_ids"], s["loss_mask"], 1
        for name in ("features", "target_hidden"):
            if name in batch:
                batch[name][i, :n] = s[name].float()
        anchors.append(sample_anchors(s["loss_mask"], num_anchors, torch.Generator().manual_seed(seed * 1_000_003 + keys[i])))
    A = max(len(a) for a in anchors)
    batch["anchors"] = torch.zeros(N, A, dtype=torch.long)
    batch["anchor_valid"] = torch.zeros(N, A, dtype=torch.bool)
    for i, a in enumerate(anchors):
        batch["anchors"][i, :len(a)], batch["anchor_valid"][i, :len(a)] = a, True
    return batch


# ----------------------------------------------------------------------------- the training module
class DraftObjective(torch.nn.Module):
    """draft + objective in one forward, so DDP sees every parameter use inside forward().
    The target's embedding and head are plain tensors, not parameters: frozen and never saved."""

    def __init__(self, draft, embed_weight, head_weight, args):
        super().__init__()
        self.draft, self.args = draft, args
        self.embed_weight, self.head_weight = embed_weight, head_weight

    def forward(self, batch, alpha_t):
        a = self.args
        embed = lambda ids: F.embedding(ids, self.embed_weight)
        h = model.forward_training(self.draft, embed, batch["input_ids"], batch["features"], batch["anchors"])
        return L.objective(self.draft, self.head_weight, h, batch["input_ids"], batch["loss_mask"], batch["anchors"],
                           batch["anchor_valid"], loss=a.loss, weighting=a.position_weighting, gamma=a.gamma,
                           dpace_alpha=a.dpace_alpha, target_hidden=batch.get("target_hidden"), alpha_t=alpha_t,
                           selector_miss=a.selector_miss, stop_gradient=a.selector_stop_gradient,
                           chunk_blocks=a.chunk_blocks or None)


def add_target_features(batch, target, cfg, need_final: bool):
    """Online mode: the live target provides features (and its final hidden state for kl)."""
    out = model.capture_features(target, cfg.target_layer_ids, final_hidden=need_final, use_cache=False,
                                 input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    batch["features"] = out[1].float()
    if need_final:
        batch["target_hidden"] = out[2].float()


def to_device(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


# ----------------------------------------------------------------------------- distributed helpers
def all_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def flat_metrics(metrics):
    """{name: (num, den)} -> one flat tensor (for one all_reduce) and a function to read it back."""
    parts, layout = [], []
    for k, (n, d) in metrics.items():
        n, d = n.reshape(-1).float(), d.reshape(-1).float()
        layout.append((k, n.numel()))
        parts += [n, d]
    return torch.cat(parts), layout


def add_into(acc, metrics):
    for k, (n, d) in metrics.items():
        acc[k] = (acc[k][0] + n, acc[k][1] + d) if k in acc else (n.clone(), d.clone())


def reduce_metrics(acc):
    """Sum numerators and denominators over ranks, then divide: ratios of global sums."""
    flat, layout = flat_metrics(acc)
    flat, out, i = all_sum(flat), {}, 0
    for k, n in layout:
        num, den = flat[i:i + n], flat[i + n:i + 2 * n]
        i += 2 * n
        r = (num / den.clamp(min=1e-9)).tolist()
        out[k] = r[0] if n == 1 else [round(v, 4) for v in r]
    return out


# ----------------------------------------------------------------------------- evaluation, checkpoints
@torch.no_grad()
def evaluate(objective, samples, args, target, cfg, device, rank, world, autocast):
    n = min(len(samples), args.eval_samples)
    if n == 0:
        return {}
    objective.eval()
    acc = {}
    # every rank must take part in the all_reduce; a rank with no sample of its own adds a zero copy
    mine = [(i, 1.0) for i in range(rank, n, world)] or [(rank % n, 0.0)]
    for i, keep in mine:
        batch = to_device(collate([samples[i]], [10_000_000 + i], args.num_anchors, args.seed), device)
        if target is not None:
            add_target_features(batch, target, cfg, args.loss == "kl")
        with autocast():
            metrics = objective(batch, alpha_t=None)["metrics"]
        add_into(acc, {k: (num * keep, den * keep) for k, (num, den) in metrics.items()})
    objective.train()
    return reduce_metrics(acc)


def save_checkpoint(path, state):
    """Atomic: a crash mid-write never leaves a broken ckpt.pt behind."""
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def rng_state():
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s):
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def lr_factor(step, total, args):
    warm = max(1, math.floor(total * args.warmup_ratio))
    if step < warm:
        return (step + 1) / warm
    if args.lr_schedule == "constant":
        return 1.0
    t = (step - warm) / max(1, total - warm)
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


# ----------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    ddp = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if ddp:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    master = rank == 0
    log = (lambda *m: print(*m, flush=True)) if master else (lambda *m: None)

    cfg = build_config(args)
    target, tokenizer = prepare.load_target(args.target)
    prepare.check_layer_ids(cfg.target_layer_ids, target)
    if target.config.vocab_size != cfg.vocab_size:
        raise ValueError(f"draft vocab_size {cfg.vocab_size} != the target's {target.config.vocab_size}: "
                         "DFlash2 needs the full target vocabulary")
    embed_w = target.get_input_embeddings().weight.detach().to(device)
    head_w = target.get_output_embeddings().weight.detach().to(device)
    target = target.to(device) if args.online else None       # offline: only embedding and head are kept

    samples = load_samples(args.data, args, tokenizer)
    if args.eval_data:
        eval_samples = load_samples(args.eval_data, args, tokenizer)
    else:
        n_eval = max(1, int(len(samples) * args.eval_fraction)) if len(samples) > 1 else 0
        samples, eval_samples = samples[:len(samples) - n_eval], samples[len(samples) - n_eval:]
    per_step = world * args.grad_accum * args.batch_size
    steps_per_epoch = len(samples) // per_step
    if steps_per_epoch == 0:
        raise ValueError(f"{len(samples)} training sequences cannot fill one step of {per_step}")
    total = args.max_steps or args.epochs * steps_per_epoch

    draft = model.DraftModel(cfg).to(device)
    selector_on = cfg.dflash2 and args.selector_loss_alpha > 0
    if cfg.dflash2 and not selector_on:        # alpha == 0: the selector is frozen, out of the optimizer
        draft.candidate_selector.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, args))
    os.makedirs(args.out_dir, exist_ok=True)
    ckpt_path, log_path = os.path.join(args.out_dir, "ckpt.pt"), os.path.join(args.out_dir, "log.jsonl")
    step = 0
    if master and not args.resume and os.path.exists(log_path):
        os.remove(log_path)                  # a fresh run starts a fresh log
    if args.resume:
        if not os.path.exists(ckpt_path):
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}")
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        draft.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        step = ck["step"]
        set_rng_state(ck["rng"])
        log(f"resumed from {ckpt_path} at step {step}")

    objective = DraftObjective(torch.compile(draft) if args.compile else draft, embed_w, head_w, args)
    if ddp:
        objective = DDP(objective, device_ids=[device.index] if device.type == "cuda" else None)
    n_params = sum(p.numel() for p in draft.parameters())
    log(f"{'DFlash2' if cfg.dflash2 else 'DFlash'} draft: {n_params:,} parameters; {len(samples)} train / "
        f"{len(eval_samples)} eval sequences; {total} steps of {per_step} sequences on {world} rank(s), {device}")

    def save():
        if master:
            save_checkpoint(ckpt_path, {"model": draft.state_dict(), "config": config.config_to_dict(cfg),
                                        "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                                        "step": step, "rng": rng_state(), "args": vars(args)})

    def eval_and_log(kind="eval"):
        m = evaluate(objective, eval_samples, args, target, cfg, device, rank, world, autocast)
        if master and m:
            with open(log_path, "a") as f:
                f.write(json.dumps({"kind": kind, "step": step, **m}) + "\n")
        return m

    bar = tqdm(total=total, initial=step, disable=not master or args.quiet, desc="train", dynamic_ncols=True)
    t0 = time.time()
    stop = min(total, step + args.steps_this_run) if args.steps_this_run else total
    while step < stop:
        epoch, within = divmod(step, steps_per_epoch)
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(args.seed + epoch))
        alpha_t = L.selector_alpha(step, total, args.selector_loss_alpha, args.selector_warmup_ratio,
                                   args.selector_ramp_ratio) if selector_on else None
        acc, D = {}, torch.zeros((), device=device)
        for m in range(args.grad_accum):
            first = (within * args.grad_accum * world + m * world + rank) * args.batch_size
            idx = order[first:first + args.batch_size].tolist()
            batch = to_device(collate([samples[i] for i in idx], [epoch * len(samples) + i for i in idx],
                                      args.num_anchors, args.seed), device)
            if target is not None:
                add_target_features(batch, target, cfg, args.loss == "kl")
            last = m == args.grad_accum - 1
            with autocast(), (objective.no_sync() if ddp and not last else torch.enable_grad()):
                out = objective(batch, alpha_t)
                out["numerator"].backward()
            D += out["denominator"]
            add_into(acc, out["metrics"])
        # grad = sum of all numerators' gradients / global D. DDP already averaged over ranks (1/world).
        D = all_sum(D)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(world / D.clamp(min=1e-9))
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip) if args.grad_clip > 0 else None
        metrics = reduce_metrics(acc)
        if not math.isfinite(metrics["loss"]) or (grad_norm is not None and not torch.isfinite(grad_norm)):
            log(f"step {step}: loss {metrics['loss']} is not finite; stopping. The last good checkpoint is {ckpt_path}")
            cleanup(objective, ddp)
            sys.exit(1)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['unary_acc']:.3f}")
        if master and (step % args.log_interval == 0 or step == total):
            with open(log_path, "a") as f:
                f.write(json.dumps({"kind": "train", "step": step, "lr": sched.get_last_lr()[0], "alpha_t": alpha_t,
                                    "grad_norm": None if grad_norm is None else grad_norm.item(),
                                    "elapsed_s": round(time.time() - t0, 1), **metrics}) + "\n")
        if step % args.eval_interval == 0 and step < total:
            eval_and_log()
        if step % args.save_interval == 0 or step == stop:
            save()
    bar.close()
    if step < total:
        log(f"stopped at step {step} of {total}; continue with --resume")
        return cleanup(objective, ddp)
    final = eval_and_log("final")
    if master and final:
        print_summary(final, cfg)
    cleanup(objective, ddp)


def print_summary(m, cfg):
    print("\nheld-out metrics")
    rows = [("accepted length, unary greedy path", "accept_unary"), ("accepted length, selector path", "accept_selector"),
            (f"accepted length, oracle top-{cfg.selector_top_k or 16}", "accept_oracle"),
            (f"top-{cfg.selector_top_k or 16} recall", "topk_recall"), ("unary accuracy", "unary_acc"),
            ("selector teacher-forced accuracy", "sel_acc"), ("loss", "loss")]
    for name, k in rows:
        if k in m:
            print(f"  {name:40s} {m[k]:.4f}")
    if "path_acc" in m:
        print(f"  {'selector path accuracy per position':40s} {m['path_acc']}")


def cleanup(objective, ddp):
    # A gloo run that exits without this dies at exit now and then (SIGABRT in the teardown race).
    if ddp:
        del objective
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
