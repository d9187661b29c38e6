"""Train a DFlash2 draft (with --dflash, a plain DFlash one): the training loop.

    python train.py --data out/features                          # offline: features from prepare.py
    python train.py --online --data convs.jsonl                  # online: the target runs here
    torchrun --standalone --nproc_per_node=2 train.py ...        # DDP (gloo on CPU, nccl on GPU)
    torchrun --standalone --nproc_per_node=8 train.py --fsdp ... # sharded: support/fsdp.py
    python -m tools.served OUT_DIR                               # then: served tau

Each optimizer step: per micro-batch of rows (a conversation each, or with --pack several: data.py),
sample anchors, run all anchored blocks of a row through the draft in one pass (model.py), get the
objective's numerator and denominator (loss.py); then one update (train_step). Every flag:
docs/training.md.
"""

import argparse
import contextlib
import datetime
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import data
import loss
import model
from compat.config_json import config_to_dict, load_config, replace_config
from export import read_training_checkpoint
from speed import machine
from support import common, compiling, distributed, flops, fsdp, kernels, loader, tracking
from support.common import UsageError, bounded, count, nonneg, positive, ratio, whole
from support.metrics import add_into, all_sum, measure, reduce_metrics
from support.target import frozen_target

# bash run.sh's prepared data (its first phases make it): train/, and eval/ held out (GSM8K test)
RUN_SH_DATA, RUN_SH_EVAL = "data/smollm2-math/train", "data/smollm2-math/eval"


def parse_args(argv=None):
    """One line a flag, in groups; what each one means and why its default: docs/training.md."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpTable)
    a = p.add_argument_group("data").add_argument
    a("--data", default=RUN_SH_DATA, help="prepare.py's features (default: bash run.sh's)")
    a("--eval-data", help="held-out data; default: run.sh's with its --data, else a share of it")
    a("--eval-fraction", type=ratio, default=0.05, help="share of --data held out (no --eval-data)")
    a("--num-samples", type=count, help="train on the first N sequences only")
    a("--online", action="store_true", help="the target runs here and gives features every step")
    common.add_target_flags(a)
    a("--max-length", type=bounded(int, low=2), default=512, help="tokens a sequence or row holds")
    a("--pack", action="store_true", help="pack several conversations into each row")
    a("--data-workers", type=whole, default=0, help="processes that make batches ahead; 0: none")
    common.add_chat_template_kwargs(a)  # offline: what prepare.py rendered the features with
    a = p.add_argument_group("draft (overrides: validated as config.json is)").add_argument
    a("--draft-config", default="configs/smollm2-135m-dflash2.json", help="the draft's config.json")
    a("--dflash", action="store_true", help="plain DFlash baseline: no convolution, no selector")
    a("--freeze-conv", action="store_true", help="convolutions stay identity; the selector trains")
    a("--block-size", type=bounded(int, low=2), help="override the block size B")
    a("--num-layers", type=count, help="override the number of draft layers")
    a("--conv-kernel-size", type=int, help="override the convolution's taps (conv.py)")
    a("--conv-group-size", type=int, help="override the channels a kernel serves (conv.py)")
    a("--selector-rank", type=int, help="override the selector's rank r (selector.py)")
    a("--selector-top-k", type=int, help="override the selector's K candidates (selector.py)")
    a = p.add_argument_group("objective (loss.py)").add_argument
    a("--loss", choices=list(loss.BASE_LOSSES), default="ce", help="the unary logits' loss")
    a("--gamma", type=positive, help="decay of the position weights; default: by block size")
    a("--num-anchors", type=count, default=512, help="blocks sampled per row")
    a("--selector-loss-alpha", type=nonneg, default=1.0, help="selector loss weight; 0 freezes it")
    a = p.add_argument_group("optimisation").add_argument
    a("--lr", type=positive, default=6e-4, help="AdamW's peak learning rate")
    a("--min-lr-ratio", type=ratio, default=0.1, help="the cosine ends at lr x this")
    a("--warmup-ratio", type=ratio, default=0.04, help="share of steps with a linear warm-up")
    a("--lr-schedule", choices=["cosine", "constant"], default="cosine", help="lr after warm-up")
    a("--weight-decay", type=nonneg, default=0.0, help="AdamW's weight decay")
    a("--grad-clip", type=nonneg, default=1.0, help="clip the gradient norm to this; 0: off")
    a("--batch-size", type=count, default=1, help="rows per micro-batch per rank")
    a("--grad-accum", type=count, default=1, help="micro-batches per optimizer step")
    a("--epochs", type=count, help="passes over the rows; default 1, unbounded with --max-seconds")
    a("--max-steps", type=count, help="stop after N steps; overrides --epochs")
    a("--max-seconds", type=positive, help="end by this many seconds; the schedule fits the pace")
    a = p.add_argument_group("running").add_argument
    a("--out-dir", default="out/draft", help="where ckpt.pt, log.jsonl and acceptance.json go")
    a("--resume", action="store_true", help="continue from OUT_DIR/ckpt.pt")
    a("--save-interval", type=count, default=200, help="steps between checkpoints")
    a("--eval-interval", type=count, default=200, help="steps between held-out evaluations")
    a("--eval-samples", type=whole, default=64, help="held-out sequences per evaluation, at most")
    a("--log-interval", type=count, default=10, help="steps between log.jsonl records")
    a("--report-to", choices=["wandb", "tensorboard"], help="also send the records there")
    a("--seed", type=int, default=0, help="seeds the draft's init, the row order and the anchors")
    a("--quiet", action="store_true", help="no progress bar")
    a = p.add_argument_group("scale and precision (docs/training-at-scale.md)").add_argument
    a("--fsdp", action="store_true", help="under torchrun: shard the models over the ranks (FSDP2)")
    a("--dist-timeout", type=positive, default=30.0, help="minutes a rank waits for the others")
    a("--compile", nargs="?", const="on", choices=["on", "auto"], help="compile; auto: when bf16")
    a("--gradient-checkpointing", action="store_true", help="recompute layers in backward")
    a("--attention", choices=["auto", "sdpa", "flex"], default="auto", help="auto: flex on a GPU")
    a("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="auto: bf16 where native")
    a("--chunk-blocks", type=whole, default=64, help="anchors per loss chunk; 0: one chunk")
    a("--peak-tflops", type=positive, help="the GPU's peak TFLOP/s for MFU; default: by its name")
    a = p.add_argument_group("research knobs (docs/training.md, docs/acceptance.md)").add_argument
    a("--anchors-per", choices=["row", "document"], default="row", help="--num-anchors is for each")
    weights = list(loss.POSITION_WEIGHTS)
    a("--position-weighting", choices=weights, default="exp", help="exp decay, or dpace: D-PACE")
    a("--dpace-alpha", type=ratio, default=0.5, help="D-PACE's smoothing")
    a("--selector-warmup-ratio", type=ratio, default=0.0, help="share of steps, selector loss off")
    a("--selector-ramp-ratio", type=ratio, default=0.0, help="then it ramps up over this share")
    a("--selector-stop-gradient", action="store_true", help="selector loss: no backbone gradient")
    miss, by = "label outside the top K: strict skips it, replace puts it in", "uniform: 1 a slot"
    a("--selector-miss", choices=["strict", "replace"], default="strict", help=miss)
    a("--selector-weighting", choices=["exp", "uniform"], default="exp", help=by)
    args = p.parse_args(argv)
    if args.freeze_conv and (args.dflash or args.selector_loss_alpha == 0):
        p.error("--freeze-conv: with --dflash or --selector-loss-alpha 0 nothing of DFlash2 trains")
    if args.selector_weighting == "uniform" and args.position_weighting != "exp":
        p.error("--selector-weighting uniform takes --position-weighting exp (loss.py)")
    return args


def check_default_data(args):
    """--data left at its default (offline): run.sh's data must be there, else one line saying how
    to make it; run.sh's held-out set is then the default --eval-data, where it is made."""
    if args.online or args.data != RUN_SH_DATA:
        return
    if not os.path.isfile(os.path.join(RUN_SH_DATA, "manifest.json")):
        raise UsageError(
            f"--data: no prepared data at {RUN_SH_DATA} (the default): bash run.sh makes it (then "
            "trains), or name prepare.py's --out-dir with --data"
        )
    if args.eval_data is None and os.path.isfile(os.path.join(RUN_SH_EVAL, "manifest.json")):
        args.eval_data = RUN_SH_EVAL


# ------------------------------------------------------------------------ the draft, the objective
def build_config(args) -> model.DraftConfig:
    c = load_config(args.draft_config)
    names = ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    o = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.num_layers is not None:
        o["num_hidden_layers"] = args.num_layers
        o["layer_types"] = [
            c.layer_types[min(i, len(c.layer_types) - 1)] for i in range(args.num_layers)
        ]
    c = replace_config(c, **o)  # validates the overridden config
    exp = args.position_weighting == "exp"  # its weights decay with gamma (loss.py)
    if exp and args.gamma is None and c.block_size not in loss.DEFAULT_GAMMA:
        raise UsageError(f"no default gamma for block size {c.block_size}; set --gamma")
    return model.plain_dflash(c) if args.dflash else c


def loss_config(args) -> loss.LossConfig:
    """The objective's flags, read once."""
    return loss.LossConfig(
        loss=args.loss,
        weighting=args.position_weighting,
        gamma=args.gamma,
        dpace_alpha=args.dpace_alpha,
        selector_miss=args.selector_miss,
        selector_weighting=args.selector_weighting,
        stop_gradient=args.selector_stop_gradient,
        chunk_blocks=args.chunk_blocks or None,
    )


class DraftObjective(torch.nn.Module):
    """draft + objective in one forward, so DDP sees every parameter use inside forward().
    The target's embedding and head are plain tensors, not parameters: frozen and never saved."""

    def __init__(self, draft, embed_weight, head_weight, cfg: loss.LossConfig, attention: str):
        super().__init__()
        self.draft, self.cfg = draft, cfg
        # None (model.py's own mask and sdpa: the CPU's sdpa), or support/kernels.py's pair
        self.attention = kernels.attention_kernel(attention, embed_weight.device)
        self.embed_weight, self.head_weight = embed_weight, head_weight

    def forward(self, batch, alpha_t, acceptance=False, sel_scale=None):
        """-> {"numerator", "denominator": the objective's (loss.py), "metrics": what it measured
        (support/metrics.py)}. acceptance: the per-slot statistics of acceptance.json too."""
        b, embed = batch, lambda ids: F.embedding(ids, self.embed_weight)
        ids, anchors, valid, docs = b["input_ids"], b["anchors"], b["anchor_valid"], b["docs"]
        hidden = b.get("target_hidden")  # the target's final normed states: --loss kl reads them
        if self.cfg.loss == "kl" and hidden is None:
            raise UsageError(
                "--loss kl needs the target's hidden states: features made with prepare.py "
                "--save-target-hidden, or --online"
            )
        h = model.forward_training(
            self.draft, embed, ids, b["features"], anchors, b["positions"], docs, self.attention
        )
        kw = dict(alpha_t=alpha_t, target_hidden=hidden, docs=docs, sel_scale=sel_scale)
        out = loss.objective(
            self.draft, self.head_weight, h, ids, b["loss_mask"], anchors, valid, self.cfg, **kw
        )
        selector = self.draft.candidate_selector
        metrics = measure(selector, out, b["loss_mask"], anchors, valid, acceptance)
        return {"numerator": out.numerator, "denominator": out.denominator, "metrics": metrics}

    def uniform_denominators(self, batch):
        """--selector-weighting uniform: [sum w, D_sel] of a batch, before its forward (loss.py)."""
        B = self.draft.config.block_size
        keys = ("input_ids", "loss_mask", "anchors", "anchor_valid", "docs")
        return loss.uniform_denominators(self.cfg, B, *(batch[k] for k in keys))


def build_objective(args, cfg, embed_w, head_w, target, device, sharded, ddp, bf16) -> tuple:
    """-> (draft, objective module to call, its no_sync, trained parameters, their AdamW, selector
    trained?). no_sync(): the backwards of a step but its last add into .grad, not communicating."""
    draft = model.DraftModel(cfg).to(device)
    draft.gradient_checkpointing = args.gradient_checkpointing
    selector_on = cfg.dflash2 and args.selector_loss_alpha > 0
    if cfg.dflash2 and not selector_on:  # alpha 0: the selector is frozen, out of the optimizer
        draft.candidate_selector.requires_grad_(False)
    # --freeze-conv: every convolution keeps its exact identity init (conv.py), so the draft is
    # plain DFlash plus a trained selector: the selector-only arm (alpha 0: the convolution-only)
    for layer in draft.layers if args.freeze_conv else []:
        layer.attention_conv.requires_grad_(False)
        layer.mlp_conv.requires_grad_(False)
    step_draft = torch.compile(draft) if args.compile else draft
    objective = DraftObjective(step_draft, embed_w, head_w, loss_config(args), args.attention)
    no_sync = contextlib.nullcontext
    if sharded:  # --fsdp, before the optimizer: its parameters become this rank's slices
        fsdp.shard(objective, draft.layers, target, bf16)
        no_sync = lambda: fsdp.no_sync(objective)
    elif ddp:  # a whole copy a rank; the step's last backward all-reduces the gradients
        objective = DDP(objective, device_ids=[device.index] if device.type == "cuda" else None)
        no_sync = objective.no_sync
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(  # fused: one kernel for all tensors, 7% faster CPU steps here
        params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=True
    )
    return draft, objective, no_sync, params, opt, selector_on


# ------------------------------------------------------------------- steps, evaluation, checkpoints
def get_lr(step, total, args) -> float:
    """The learning rate of step `step` of `total`: a linear warm-up over --warmup-ratio of the
    steps, then a cosine down to lr x --min-lr-ratio at the end (or constant)."""
    warm = max(1, math.floor(total * args.warmup_ratio))
    if step < warm:
        return args.lr * ((step + 1) / warm)
    if args.lr_schedule == "constant":
        return args.lr
    t, m = (step - warm) / max(1, total - warm), args.min_lr_ratio  # t: 0 -> 1 over the cosine
    return args.lr * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(objective, samples, args, target, device, rank, world, autocast, acceptance=False):
    """Teacher-forced held-out metrics over the first --eval-samples sequences, at random anchors.
    A --compile draft evaluates uncompiled: inductor could not compile its no-grad forward with
    flex attention inside, on a GPU (docs/training-at-scale.md, "The second run")."""
    n = min(len(samples), args.eval_samples)
    if n == 0:
        return {}
    acc, sums, inner = {}, 0.0, getattr(objective, "module", objective)  # DDP wraps it
    compiled, inner.draft = inner.draft, getattr(inner.draft, "_orig_mod", inner.draft)
    cfg = inner.draft.config
    objective.eval()
    # every rank runs as many forwards (FSDP gathers weights in each) and takes part in the
    # all_reduce: a rank short of samples of its own adds zero copies
    mine = [(i % n, float(i < n)) for i in range(rank, -(-n // world) * world, world)]
    for i, keep in mine:
        batch = data.collate([[samples[i]]], [10_000_000 + i], args.num_anchors, args.seed, device)
        if compiling.anything_compiles(args):
            batch = loader.static_shapes(batch, args.num_anchors)
        if target is not None:
            data.add_target_features(batch, target, cfg, args.loss == "kl", packed=False)
        with autocast():
            out = objective(batch, alpha_t=None, acceptance=acceptance)
        sums = sums + torch.stack([out["numerator"], out["denominator"]]) * keep
        add_into(acc, {k: (num * keep, den * keep) for k, (num, den) in out["metrics"].items()})
    objective.train()
    inner.draft = compiled
    N, D = all_sum(sums)  # the loss: one ratio of global sums
    return {"loss": (N / D.clamp(min=1e-9)).item(), **reduce_metrics(acc)}


def train_step(objective, opt, params, batches, alpha_t, args, world, no_sync, autocast):
    """One optimizer step over this rank's --grad-accum micro-batches (made as they are used) ->
    (metrics, grad norm or None, taken: False where the loss or the norm is not finite).

    The objective is one ratio over the micro-batches m of all ranks r (loss.py):
        J = sum_rm N_rm / D,   D = sum_rm D_rm   (the global denominator)
        dJ/dw = (1 / D) sum_rm dN_rm/dw
    Each backward adds dN_rm/dw into .grad; DDP (FSDP alike) averages over the ranks: (1 / world)
    sum_rm dN_rm/dw. Times world / D that is dJ/dw exactly, once D is known after the last one.
    --selector-weighting uniform adds alpha_t sum N_sel / D_sel, D_sel summed from the data first
    (loss.uniform_denominators): N_sel enters times D / D_sel; the rescale leaves 1 / D_sel."""
    acc, N, D, sel_scale = {}, 0.0, 0.0, None
    if args.selector_weighting == "uniform":
        batches = list(batches)
        core = getattr(objective, "module", objective)  # DDP wraps it
        D_base, D_sel = all_sum(sum(core.uniform_denominators(b) for b in batches))
        sel_scale = D_base / D_sel.clamp(min=1)
    for m, batch in enumerate(batches):
        last = m == args.grad_accum - 1  # DDP all-reduces the gradients in the last backward only
        with autocast(), contextlib.nullcontext() if last else no_sync():
            out = objective(batch, alpha_t, sel_scale=sel_scale)
            out["numerator"].backward()
        N, D = N + out["numerator"].detach(), D + out["denominator"]
        add_into(acc, out["metrics"])
    N, D = all_sum(torch.stack([N, D]))  # the global numerator and denominator
    loss = (N / D.clamp(min=1e-9)).item()
    for p in params:  # DDP and FSDP averaged the gradients over the ranks (1 / world): undo that
        if p.grad is not None:
            p.grad.mul_(world / D.clamp(min=1e-9))
    norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip) if args.grad_clip > 0 else None
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor
    metrics = {"loss": loss, **reduce_metrics(acc)}
    if not math.isfinite(loss) or (norm is not None and not torch.isfinite(norm)):
        return metrics, norm, False
    opt.step()
    opt.zero_grad(set_to_none=True)
    return metrics, norm, True


def save_checkpoint(path, draft, opt, cfg, step, total, args, master, sharded):
    """ckpt.pt: what --resume needs and export.py exports. Every rank calls it (--fsdp gathers the
    slices into whole tensors); rank 0 writes one file, atomically."""
    model_state, opt_state = (
        fsdp.full_state(draft, opt) if sharded else (draft.state_dict(), opt.state_dict())
    )
    if master:
        ckpt = {
            "model": model_state,  # the draft's tensors, whole
            "config": config_to_dict(cfg),  # as config.json holds it
            # AdamW's moments, keyed by position in the optimizer (--fsdp: by parameter name)
            "optimizer": opt_state,
            "step": step,
            "total": total,  # the schedule's length (--max-seconds: at the pace so far)
            "args": vars(args),
        }
        with common.atomic_write(path) as tmp:
            torch.save(ckpt, tmp)


def load_checkpoint(path, draft, opt, sharded, total) -> tuple:
    """--resume: the draft and AdamW as they were -> (step, the schedule's length: a time-boxed
    run's own, else total). The lr and every seeded draw are functions of the step: nothing else."""
    if not os.path.exists(path):
        raise UsageError(f"--resume: no checkpoint at {path}")
    ck = read_training_checkpoint(path, mmap=True)  # mapped: ranks share its pages
    if sharded:
        fsdp.load_full_state(draft, opt, ck["model"], ck["optimizer"])
    else:
        draft.load_state_dict(ck["model"])
        # by position, or by name (--fsdp's): both list the parameters in the optimizer's order
        opt.load_state_dict(ck["optimizer"])
    return ck["step"], ck["total"] if ck["args"].get("max_seconds") else total


# ----------------------------------------------------------------------------- training
def main(argv=None):
    args = parse_args(argv)
    check_default_data(args)
    args.attention = compiling.choose_attention(args.attention, distributed.rank_device())
    args.compile = machine.compile_training(args.compile, args.dtype, distributed.rank_device())
    with compiling.guard(compiling.anything_compiles(args)):  # dynamo's settings, where it runs
        train(args)


def train(args):
    # ------------------------------------------------------------------ setup
    started = time.time()  # --max-seconds counts from here
    timeout = datetime.timedelta(minutes=args.dist_timeout)  # rank-skewed compiles, saves
    device, rank, world, ranked = distributed.start_ranks(timeout)
    sharded, master = args.fsdp and world > 1, rank == 0  # --fsdp on one process: nothing to shard
    log = (lambda *m: print(*m, flush=True)) if master else (lambda *m: None)
    # --report-to's tracker first: a missing package ends the run before anything loads
    track = tracking.start_tracker(args) if master and args.report_to else None
    torch.manual_seed(args.seed)  # the draft's initial weights
    cfg = build_config(args)
    use_bf16, target_dtype, said = machine.train_precision(
        args.dtype, args.target_dtype, args.online, device, args.compile
    )
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)
    target, tok, embed_w, head_w = frozen_target(args, target_dtype, cfg, device, sharded)
    samples, eval_samples = data.load_split(args, tok)
    rows, per_step, per_epoch, total = data.schedule(samples, args, world)
    draft, objective, no_sync, params, opt, selector_on = build_objective(
        args, cfg, embed_w, head_w, target, device, sharded, ranked and not args.fsdp, use_bf16
    )
    ckpt, record = os.path.join(args.out_dir, "ckpt.pt"), tracking.RunLog(args, master, track)
    step, total = load_checkpoint(ckpt, draft, opt, sharded, total) if args.resume else (0, total)
    # the steps that end the run: --max-seconds alone has none (its schedule starts at an epoch's)
    steps = math.inf if args.max_seconds and not (args.max_steps or args.epochs) else total
    static = compiling.anything_compiles(args)  # batches padded to static shapes, steps compiled
    meter = flops.Meter(device, args.peak_tflops, static)  # tokens, anchors, FLOPs a second
    log("; ".join([*said, meter.note] if meter.note else said))  # the precision chosen, and why
    backend = f" ({torch.distributed.get_backend()}{', FSDP' if sharded else ''})" if ranked else ""
    n = sum(p.numel() for p in draft.parameters())
    log(
        f"{'DFlash2' if cfg.dflash2 else 'DFlash'} draft, {n:,} parameters; {len(samples)} train / "
        f"{len(eval_samples)} eval sequences; steps {step} to {total} of {per_step} rows on "
        f"{world} rank(s){backend}, {device}, {args.attention} attention"
    )

    # ------------------------------------------------------------------ loop
    # this rank's micro-batches on the host, pinned on a GPU (the copies run asynchronously);
    # with --max-seconds they have no last step: the clock ends the run
    ends = None if args.max_seconds else total
    pin = device.type == "cuda"
    plan = data.micro_batch_plan(step, ends, per_epoch, len(rows), args, rank, world)
    ahead = loader.batches(data.collate, plan, samples, rows, args, static, pin)

    def next_batch():
        host = next(ahead)
        meter.count(cfg, host, target)  # counted before the copy: no wait for the device
        batch = loader.to_device(host, device)
        if target is not None:  # online: the target's features of this batch
            data.add_target_features(batch, target, cfg, args.loss == "kl", args.pack)
        return batch

    alpha = args.selector_loss_alpha, args.selector_warmup_ratio, args.selector_ramp_ratio
    bar = tqdm(total=total, initial=step, disable=not master or args.quiet, desc="train")
    # --max-seconds: p0 is the share of the run done before this invocation (step / total at a
    # --resume, 0 on a fresh run); the rest of it is spread over the seconds the budget has left
    t0, p0, rates = time.time(), step / total, {}
    since = lambda: round(time.time() - t0, 3)  # this invocation's seconds, evaluations included
    meter.restart()
    while step < total:
        for group in opt.param_groups:
            group["lr"] = get_lr(step, total, args)
        alpha_t = loss.selector_alpha(step, total, *alpha) if selector_on else None
        batches = (next_batch() for _ in range(args.grad_accum))
        mark, graphs = meter.mark(), compiling.graphs()
        metrics, grad_norm, taken = train_step(
            objective, opt, params, batches, alpha_t, args, world, no_sync, autocast
        )
        if compiling.graphs() > graphs:  # it compiled: its seconds go to compile_s, not the rates
            meter.leave_out(mark, compiled=True)
        if not taken:  # the last good checkpoint stays
            log(f"step {step}: loss {metrics['loss']} or grad norm {grad_norm} is not finite")
            distributed.end_ranks()
            sys.exit(1)
        step += 1
        bar.update(1)
        if args.max_seconds:
            # p: the run's progress by the clock. At this pace the run takes step / p steps: the
            # new total (and so the lr schedule's and alpha ramp's length), re-estimated every
            # step, at least the steps taken and at most `steps`. All ranks take rank 0's.
            left = max(started + args.max_seconds - t0, 1e-9)  # the budget's seconds left at t0
            p = p0 + (1 - p0) * (time.time() - t0) / left
            total = distributed.agreed(min(steps, max(step, round(step / p))), device, ranked)
            bar.total = total
        if master and (step % args.log_interval == 0 or step == total):
            rates = meter.rates()  # this interval's, per rank (per GPU), as usually quoted
            norm = None if grad_norm is None else grad_norm.item()
            r = dict(kind="train", step=step, lr=get_lr(step, total, args), alpha_t=alpha_t)
            record(**r, grad_norm=norm, elapsed_s=since(), **rates, **metrics)
        acc = f"{metrics['unary_acc']:.3f}"
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=acc, **meter.brief(rates))
        # the checkpoint first: an evaluation that fails (out of memory) loses no step
        if step % args.save_interval == 0 or step == total:
            with meter.paused():
                save_checkpoint(ckpt, draft, opt, cfg, step, total, args, master, sharded)
        if step % args.eval_interval == 0 and step < total:
            with meter.paused():
                m = evaluate(objective, eval_samples, args, target, device, rank, world, autocast)
            if m:
                record(kind="eval", step=step, elapsed_s=since(), **m)
    bar.close()

    # ------------------------------------------------------------------ end: the held-out summary
    final = evaluate(objective, eval_samples, args, target, device, rank, world, autocast, True)
    distributed.end_ranks()  # what follows runs on rank 0 alone
    record.end(final, cfg, step, since())


if __name__ == "__main__":
    common.run(main)
