"""Train a DFlash2 (or, with --dflash, a plain DFlash) draft. One readable loop, nanoGPT-shaped.

    python train.py --data out/features                          # offline: features from prepare.py
    python train.py --online --data convs.jsonl                  # online: the target runs here
    torchrun --standalone --nproc_per_node=2 train.py ...        # DDP (gloo on CPU, nccl on GPU)
    torchrun --standalone --nproc_per_node=8 train.py --fsdp ... # the draft (and online the target)
    sharded: fsdp.py

Each optimizer step: for every micro-batch of rows (a conversation each, or with --pack several:
data.py), sample anchors, run all anchored blocks of each row through the draft in one pass
(model.forward_training), and get the objective's numerator and denominator (loss.py). Gradients of
all numerators are summed over micro-batches and ranks and divided once by the global denominator,
so 2 ranks x 1 micro-batch == 1 rank x 2 micro-batches.
"""

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import config
import data
import flops
import fsdp
import loss
import model
import served
from common import DTYPES, add_chat_template_kwargs, atomic_write, bounded, end_distributed, run
from metrics import add_into, all_sum, record_served, reduce_metrics, save_acceptance
from speed import machine
from target import capture_features, check_draft_fits, load_target


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    a = p.add_argument
    a(
        "--draft-config",
        default="configs/smollm2-135m-dflash2.json",
        help="draft config file or directory",
    )
    a(
        "--target",
        default=None,
        help="HF directory or hub name; default: the embedded SmolLM2-135M-Instruct",
    )
    a(
        "--data",
        required=True,
        help="feature directory (prepare.py --features) or, with --online, a JSONL of "
        "conversations",
    )
    a(
        "--eval-data",
        default=None,
        help="held-out data of the same kind as --data; default: split off --eval-fraction",
    )
    a("--eval-fraction", type=bounded(float, low=0.0, high=1.0), default=0.05)
    a(
        "--num-samples",
        type=bounded(int, low=1),
        default=None,
        help="train on the first N sequences of --data only",
    )
    a(
        "--online",
        action="store_true",
        help="run the target in this process to get features every step",
    )
    a(
        "--target-dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="the target's weights (online: its "
        "forward); auto: bf16 on GPU and on CPUs with native bf16, else fp32 (speed/machine.py). "
        "Its embedding and lm_head are used in fp32 either way",
    )
    a(
        "--max-length",
        type=bounded(int, low=2),
        default=512,
        help="online: truncate conversations to this many tokens; --pack: tokens per row",
    )
    a("--pack", action="store_true", help="pack several conversations into each row (data.py)")
    # online: renders the conversations; offline: must be what prepare.py rendered the features with
    add_chat_template_kwargs(a)
    # architecture overrides, validated by the same rules as the config file
    a("--dflash", action="store_true", help="plain DFlash baseline: no convolution, no selector")
    a("--block-size", type=bounded(int, low=2))
    a("--num-layers", type=bounded(int, low=1))
    for name in ("--conv-kernel-size", "--conv-group-size", "--selector-rank", "--selector-top-k"):
        a(name, type=int)
    # objective
    a("--loss", choices=["ce", "kl", "tv", "lk"], default="ce")
    a("--position-weighting", choices=["exp", "dpace"], default="exp")
    a(
        "--gamma",
        type=bounded(float, above=0.0),
        default=None,
        help="exp decay; default 7/5/4 for block size 16/10/8",
    )
    a("--dpace-alpha", type=bounded(float, low=0.0, high=1.0), default=0.5)
    a("--num-anchors", type=bounded(int, low=1), default=512)
    a(
        "--anchors-per",
        choices=["row", "document"],
        default="row",
        help="with --pack: --num-anchors for the whole row, or for each of its documents (a long "
        "document cannot take a row's anchors; the public trainers' contract, at documents-per-row "
        "times the step's cost). row won at equal wall time on the maths demo: docs/acceptance.md",
    )
    a("--selector-loss-alpha", type=bounded(float, low=0.0), default=1.0)
    a("--selector-warmup-ratio", type=bounded(float, low=0.0, high=1.0), default=0.0)
    a("--selector-ramp-ratio", type=bounded(float, low=0.0, high=1.0), default=0.0)
    a("--selector-stop-gradient", action="store_true")
    a("--selector-miss", choices=["strict", "replace"], default="strict")
    a(
        "--chunk-blocks",
        type=bounded(int, low=0),
        default=64,
        help="objective chunk (anchors) to bound logits memory; 0 = off",
    )
    # optimisation
    a("--lr", type=bounded(float, above=0.0), default=6e-4)
    a("--min-lr-ratio", type=bounded(float, low=0.0, high=1.0), default=0.1)
    a("--warmup-ratio", type=bounded(float, low=0.0, high=1.0), default=0.04)
    a("--lr-schedule", choices=["cosine", "constant"], default="cosine")
    a("--weight-decay", type=bounded(float, low=0.0), default=0.0)
    a("--grad-clip", type=bounded(float, low=0.0), default=1.0)
    a(
        "--batch-size",
        type=bounded(int, low=1),
        default=1,
        help="sequences per micro-batch per rank",
    )
    a("--grad-accum", type=bounded(int, low=1), default=1)
    a("--epochs", type=bounded(int, low=1), default=1)
    a(
        "--max-steps",
        type=bounded(int, low=1),
        default=None,
        help="optimizer steps; overrides --epochs",
    )
    a(
        "--steps-this-run",
        type=bounded(int, low=1),
        default=None,
        help="stop (with a checkpoint) after this many steps of this invocation; --resume "
        "continues",
    )
    # running
    a("--out-dir", default="out/draft")
    a("--resume", action="store_true", help="continue from OUT_DIR/ckpt.pt")
    a("--save-interval", type=bounded(int, low=1), default=200)
    a("--eval-interval", type=bounded(int, low=1), default=200)
    a(
        "--eval-samples",
        type=bounded(int, low=0),
        default=64,
        help="at most this many held-out sequences per evaluation",
    )
    a(
        "--served-samples",
        type=bounded(int, low=0),
        default=16,
        help="the final evaluation also decodes this many held-out prompts with the real decoding "
        "loop (served.py): served tau beside the teacher-forced one; 0: off",
    )
    a("--log-interval", type=bounded(int, low=1), default=10)
    a("--compile", action="store_true", help="torch.compile the draft")
    a(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each draft layer's activations in backward instead of keeping them: "
        "memory for long sequences and many anchors, for about a third more compute",
    )
    a(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard the draft, its gradients and optimizer state and, "
        "online, the target over the ranks (FSDP2, fsdp.py) instead of replicating them (DDP)",
    )
    a(
        "--attention",
        choices=["auto", "sdpa", "flex"],
        default="auto",
        help="sdpa: dense mask; flex: block-sparse FlexAttention, GPU only; auto: flex on GPU, "
        "sdpa on CPU",
    )
    a(
        "--dtype",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="auto: bf16 autocast on GPU and on CPUs with native bf16, else fp32 "
        "(speed/machine.py)",
    )
    a(
        "--peak-tflops",
        type=bounded(float, above=0.0),
        default=None,
        help="GPU only: the peak (dense bf16) TFLOP/s that MFU divides by; default: "
        "flops.PEAK_TFLOPS by device name",
    )
    a("--seed", type=int, default=0)
    a("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- config and data
def build_config(args) -> config.DraftConfig:
    c = config.load_config(args.draft_config)
    o = {
        k: getattr(args, k)
        for k in (
            "block_size",
            "conv_kernel_size",
            "conv_group_size",
            "selector_rank",
            "selector_top_k",
        )
        if getattr(args, k) is not None
    }
    if args.num_layers is not None:
        o["num_hidden_layers"] = args.num_layers
        o["layer_types"] = [
            c.layer_types[min(i, len(c.layer_types) - 1)] for i in range(args.num_layers)
        ]
    c = dataclasses.replace(c, **o)  # __post_init__ validates the overridden config
    return config.plain_dflash(c) if args.dflash else c


# ----------------------------------------------------------------------------- the training module
def loss_config(args) -> loss.LossConfig:
    """The objective's flags, read once."""
    return loss.LossConfig(
        loss=args.loss,
        weighting=args.position_weighting,
        gamma=args.gamma,
        dpace_alpha=args.dpace_alpha,
        selector_miss=args.selector_miss,
        stop_gradient=args.selector_stop_gradient,
        chunk_blocks=args.chunk_blocks or None,
    )


class DraftObjective(torch.nn.Module):
    """draft + objective in one forward, so DDP sees every parameter use inside forward().
    The target's embedding and head are plain tensors, not parameters: frozen and never saved."""

    def __init__(self, draft, embed_weight, head_weight, cfg: loss.LossConfig, attention: str):
        super().__init__()
        self.draft, self.cfg, self.attention = draft, cfg, attention
        self.embed_weight, self.head_weight = embed_weight, head_weight

    def forward(self, batch, alpha_t, acceptance=False):
        embed = lambda ids: F.embedding(ids, self.embed_weight)
        h = model.forward_training(
            self.draft,
            embed,
            batch["input_ids"],
            batch["features"],
            batch["anchors"],
            batch["positions"],
            batch["docs"],
            self.attention,
        )
        return loss.objective(
            self.draft,
            self.head_weight,
            h,
            batch["input_ids"],
            batch["loss_mask"],
            batch["anchors"],
            batch["anchor_valid"],
            self.cfg,
            target_hidden=batch.get("target_hidden"),
            alpha_t=alpha_t,
            docs=batch["docs"],
            acceptance=acceptance,
        )


def add_target_features(batch, target, cfg, need_final: bool, packed: bool):
    """Online mode: the live target provides features (and its final hidden state for kl); it reads
    the documents of packed rows one by one."""
    ids, mask, back = (
        data.per_document(batch) if packed else (batch["input_ids"], batch["attention_mask"], None)
    )
    out = capture_features(
        target,
        cfg.target_layer_ids,
        final_hidden=need_final,
        use_cache=False,
        logits_to_keep=1,
        input_ids=ids,
        attention_mask=mask,
    )
    for name, value in [("features", out[1])] + ([("target_hidden", out[2])] if need_final else []):
        batch[name] = back(value.float()) if packed else value.float()


# ------------------------------------------------------------------- steps, evaluation, checkpoints
def split_and_schedule(samples, eval_samples, args, world):
    """-> (train samples, eval samples, rows, rows per step, steps per epoch, total steps). Without
    --eval-data the last --eval-fraction of the sequences are held out; --num-samples keeps the
    first N of the rest. A row (sample indices) is one sequence, or with --pack the sequences
    data.plan_rows puts together."""
    if eval_samples is None:
        n_eval = max(1, int(len(samples) * args.eval_fraction)) if len(samples) > 1 else 0
        samples, eval_samples = samples[: len(samples) - n_eval], samples[len(samples) - n_eval :]
    samples = samples[: args.num_samples]
    rows = [[i] for i in range(len(samples))]
    if args.pack:
        rows = data.plan_rows(data.lengths(samples), args.max_length)
    per_step = world * args.grad_accum * args.batch_size
    steps_per_epoch = len(rows) // per_step
    if steps_per_epoch == 0:
        raise ValueError(
            f"{args.data}: {len(rows)} training rows cannot fill one step of {per_step}"
        )
    return (
        samples,
        eval_samples,
        rows,
        per_step,
        steps_per_epoch,
        args.max_steps or args.epochs * steps_per_epoch,
    )


def step_micro_batches(step, steps_per_epoch, num_rows, args, rank, world):
    """This rank's micro-batches of optimizer step `step`: (epoch, [row indices] per micro-batch).
    Each epoch is a seeded permutation; a step takes its next world * grad_accum * batch_size
    entries, micro-batch m of rank r at slot m * world + r, so every split into ranks x accumulation
    sees the same rows."""
    epoch, within = divmod(step, steps_per_epoch)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(args.seed + epoch))
    firsts = [
        (within * args.grad_accum * world + m * world + rank) * args.batch_size
        for m in range(args.grad_accum)
    ]
    return epoch, [order[f : f + args.batch_size].tolist() for f in firsts]


def lr_factor(step, total, args):
    warm = max(1, math.floor(total * args.warmup_ratio))
    if step < warm:
        return (step + 1) / warm
    if args.lr_schedule == "constant":
        return 1.0
    t = (step - warm) / max(1, total - warm)
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(
    objective,
    samples,
    args,
    target,
    cfg,
    device,
    rank,
    world,
    autocast,
    acceptance=False,
    anchors=None,
):
    """Teacher-forced held-out metrics over the first --eval-samples sequences, at random anchors
    or, given anchors[i] for sequence i, at those (the ones serving visited)."""
    n = min(len(samples), args.eval_samples if anchors is None else len(anchors))
    if n == 0:
        return {}
    objective.eval()
    acc = {}
    # every rank runs as many forwards (FSDP gathers weights in each) and takes part in the
    # all_reduce:
    # a rank short of samples of its own adds zero copies
    mine = [(i % n, float(i < n)) for i in range(rank, -(-n // world) * world, world)]
    for i, keep in mine:
        given = None if anchors is None else [anchors[i]]
        batch = data.collate(
            [[samples[i]]], [10_000_000 + i], args.num_anchors, args.seed, device, anchors=given
        )
        if target is not None:
            add_target_features(batch, target, cfg, args.loss == "kl", packed=False)
        with autocast():
            metrics = objective(batch, alpha_t=None, acceptance=acceptance)["metrics"]
        add_into(acc, {k: (num * keep, den * keep) for k, (num, den) in metrics.items()})
    objective.train()
    return reduce_metrics(acc)


def append_log(path, record: dict):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def save_checkpoint(path, draft, cfg, opt, sched, step, args, master):
    """Every rank calls it (--fsdp gathers the slices); rank 0 writes the whole state, one file
    whatever the number of ranks. Atomic: a crash mid-write never leaves a broken ckpt.pt behind."""
    model_state, opt_state = fsdp.full_state(draft, opt)
    if master:
        state = {
            "model": model_state,
            "config": config.config_to_dict(cfg),
            "optimizer": opt_state,
            "scheduler": sched.state_dict(),
            "step": step,
            "args": vars(args),
        }
        with atomic_write(path) as tmp:
            torch.save(state, tmp)


def load_checkpoint(path, draft, opt, sched, sharded=False) -> int:
    """--resume: draft, optimizer and schedule as they were; returns the step to continue from.
    Nothing else needs restoring: after the draft's init every draw (order, anchors) has its own
    seeded generator."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    # mapped: ranks share the pages
    ck = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    # written before --fsdp: keyed by position
    if any(isinstance(k, int) for k in ck["optimizer"]["state"]):
        if sharded:
            raise ValueError(
                f"--resume: {path} keeps its optimizer state by position (written before --fsdp); "
                "resume it without --fsdp once, and its next checkpoint is keyed by parameter name"
            )
        draft.load_state_dict(ck["model"])
        # the same parameters in the same order: the same run's flags
        opt.load_state_dict(ck["optimizer"])
    else:
        fsdp.load_full_state(draft, opt, ck["model"], ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    return ck["step"]


def train_step(objective, opt, sched, params, batches, alpha_t, args, world, no_sync, autocast):
    """One optimizer step over this rank's args.grad_accum micro-batches (built as they are used)
    -> (metrics, grad norm or None, whether the step was taken: not where the loss or the norm is
    not finite).

    The objective over every micro-batch of every rank is sum(numerators) / sum(denominators)
    (loss.py). Each backward adds one numerator's gradient, and the sum is divided once by the
    global denominator D, so 2 ranks x 1 micro-batch == 1 rank x 2 micro-batches."""
    acc, D = {}, 0.0
    for m, batch in enumerate(batches):
        last = m == args.grad_accum - 1  # DDP all-reduces the gradients in the last backward only
        with autocast(), torch.enable_grad() if last else no_sync():
            out = objective(batch, alpha_t)
            out["numerator"].backward()
        D = D + out["denominator"]
        add_into(acc, out["metrics"])
    D = all_sum(D)  # the global denominator
    for p in params:  # DDP and FSDP averaged the gradients over the ranks (1 / world): undo that
        if p.grad is not None:
            p.grad.mul_(world / D.clamp(min=1e-9))
    norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip) if args.grad_clip > 0 else None
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor
    metrics = reduce_metrics(acc)
    if not math.isfinite(metrics["loss"]) or (norm is not None and not torch.isfinite(norm)):
        return metrics, norm, False
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return metrics, norm, True


# ----------------------------------------------------------------------------- main
def main(argv=None):
    # ----------------------------------------------------------------- setup: ranks, device, target
    args = parse_args(argv)
    # under torchrun, one process too: the same nccl / gloo path as many
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    sharded = distributed and args.fsdp and world > 1  # --fsdp on one process: nothing to shard
    device = torch.device(
        f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    use_bf16 = machine.resolve_dtype(args.dtype, device, "train") == torch.bfloat16
    peak = flops.peak_flops(device, args.peak_tflops)  # FLOP/s for MFU; None on a CPU: no MFU
    if args.attention == "auto":
        args.attention = "flex" if device.type == "cuda" else "sdpa"
    if args.attention == "flex" and device.type == "cpu":
        raise ValueError(
            "--attention flex: torch runs FlexAttention on CPU forward only (no backward in 2.13); "
            "train on CPU with --attention sdpa"
        )
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)
    torch.manual_seed(args.seed)  # the draft's initial weights
    master = rank == 0
    log = (lambda *m: print(*m, flush=True)) if master else (lambda *m: None)
    cfg = build_config(args)
    target_dtype = machine.resolve_dtype(args.target_dtype, device, "data")
    log(
        machine.choice_line(
            machine.describe(device),
            draft=f"{'bf16 autocast' if use_bf16 else 'fp32'}",
            **({"online target": machine.dtype_name(target_dtype)} if args.online else {}),
        )
    )
    for note in {
        machine.slow_bf16_note(dt, device)
        for dt in [torch.bfloat16] * use_bf16 + [target_dtype] * args.online
    } - {""}:
        log(note)
    target, tokenizer = load_target(args.target, target_dtype)
    check_draft_fits(cfg, target)
    embed_w = target.get_input_embeddings().weight.detach().to(device, torch.float32)
    head_w = target.get_output_embeddings().weight.detach().to(device, torch.float32)
    # offline only the embedding and head are kept; online the target runs, sharded under --fsdp
    target = (fsdp.shard_target(target) if sharded else target.to(device)) if args.online else None
    # 2x this per token: its forward
    target_weights = flops.linear_weights(target) if args.online else 0

    # ------------------------------------------------------------------ data
    kw = args.chat_template_kwargs
    samples = data.load_samples(args.data, args.online, tokenizer, args.max_length, kw)
    eval_samples = (
        data.load_samples(args.eval_data, args.online, tokenizer, args.max_length, kw)
        if args.eval_data
        else None
    )
    samples, eval_samples, rows, per_step, steps_per_epoch, total = split_and_schedule(
        samples, eval_samples, args, world
    )

    # ------------------------------------------------------------------ model, optimizer, resume
    draft = model.DraftModel(cfg).to(device)
    draft.gradient_checkpointing = args.gradient_checkpointing
    selector_on = cfg.dflash2 and args.selector_loss_alpha > 0
    # alpha == 0: the selector is frozen, out of the optimizer
    if cfg.dflash2 and not selector_on:
        draft.candidate_selector.requires_grad_(False)
    objective = DraftObjective(
        torch.compile(draft) if args.compile else draft,
        embed_w,
        head_w,
        loss_config(args),
        args.attention,
    )
    # before the optimizer: its parameters become this rank's slices
    if sharded:
        fsdp.shard_draft(objective, draft.layers, use_bf16)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=True
    )  # one kernel for all tensors: 7% faster CPU steps here
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, args))
    os.makedirs(args.out_dir, exist_ok=True)
    ckpt_path, log_path = (
        os.path.join(args.out_dir, "ckpt.pt"),
        os.path.join(args.out_dir, "log.jsonl"),
    )
    if master and not args.resume and os.path.exists(log_path):
        os.remove(log_path)  # a fresh run starts a fresh log
    step = load_checkpoint(ckpt_path, draft, opt, sched, sharded) if args.resume else 0
    if args.resume:
        log(f"resumed from {ckpt_path} at step {step}")
    ddp = distributed and not args.fsdp
    if ddp:
        objective = DDP(objective, device_ids=[device.index] if device.type == "cuda" else None)
    log(
        f"{'DFlash2' if cfg.dflash2 else 'DFlash'} draft: "
        f"{sum(p.numel() for p in draft.parameters()):,} parameters; "
        f"{len(samples)} train / {len(eval_samples)} eval sequences; "
        f"{total} steps of {per_step} rows on {world} rank(s)"
        f"{f' ({dist.get_backend()})' if distributed else ''}, "
        f"{device}, {args.attention} attention"
        + (", FSDP" if sharded else "")
        + (f"; packed into {len(rows)} rows" if args.pack else "")
    )
    if device.type == "cuda" and not peak:
        log(
            f"no MFU: {torch.cuda.get_device_name(device)} is not in flops.PEAK_TFLOPS; "
            "give its --peak-tflops"
        )

    # ------------------------------------------------------------------ loop
    bar = tqdm(
        total=total,
        initial=step,
        disable=not master or args.quiet,
        desc="train",
        dynamic_ncols=True,
    )
    t0 = time.time()
    seen = torch.zeros(3, dtype=torch.float64)  # this rank's target tokens, anchors, model FLOPs

    def make_batch(rows_of_batch, epoch):  # a micro-batch: rows of samples, anchors, features
        keys = [epoch * len(rows) + r for r in rows_of_batch]
        docs = [[samples[j] for j in rows[r]] for r in rows_of_batch]
        per_doc = args.anchors_per == "document"
        batch = data.collate(docs, keys, args.num_anchors, args.seed, device, per_doc)
        if target is not None:
            add_target_features(batch, target, cfg, args.loss == "kl", args.pack)
        flop = flops.step_flops(cfg, batch, target_weights) if peak else 0
        counts = [batch["attention_mask"].sum().item(), batch["anchor_valid"].sum().item(), flop]
        seen.add_(torch.tensor(counts, dtype=torch.float64))
        return batch

    no_sync = objective.no_sync if ddp else contextlib.nullcontext
    stop = min(total, step + args.steps_this_run) if args.steps_this_run else total
    while step < stop:
        epoch, micro = step_micro_batches(step, steps_per_epoch, len(rows), args, rank, world)
        batches = (make_batch(idx, epoch) for idx in micro)
        alpha = args.selector_loss_alpha, args.selector_warmup_ratio, args.selector_ramp_ratio
        alpha_t = loss.selector_alpha(step, total, *alpha) if selector_on else None
        metrics, grad_norm, taken = train_step(
            objective, opt, sched, params, batches, alpha_t, args, world, no_sync, autocast
        )
        if not taken:
            log(
                f"step {step}: loss {metrics['loss']} or grad norm {grad_norm} is not finite; "
                f"stopping. The last good checkpoint is {ckpt_path}"
            )
            end_distributed()
            sys.exit(1)
        step += 1
        bar.update(1)
        elapsed = time.time() - t0  # this invocation's seconds, evaluations included
        tok_s, anchor_s, flop_s = (seen / elapsed).tolist()  # per rank (per GPU), as usually quoted
        mfu = {"mfu": float(f"{flop_s / peak:.4g}")} if peak else {}  # a tiny model's is not 0
        bar.set_postfix(
            loss=f"{metrics['loss']:.3f}",
            acc=f"{metrics['unary_acc']:.3f}",
            tok_s=f"{tok_s:.0f}",
            **mfu,
        )
        if master and (step % args.log_interval == 0 or step == total):
            append_log(
                log_path,
                {
                    "kind": "train",
                    "step": step,
                    "lr": sched.get_last_lr()[0],
                    "alpha_t": alpha_t,
                    "grad_norm": None if grad_norm is None else grad_norm.item(),
                    "elapsed_s": round(elapsed, 1),
                    "target_tok_per_s": round(tok_s, 1),
                    "anchors_per_s": round(anchor_s, 1),
                    **mfu,
                    **metrics,
                },
            )
        if step % args.eval_interval == 0 and step < total:
            m = evaluate(objective, eval_samples, args, target, cfg, device, rank, world, autocast)
            if master and m:
                append_log(
                    log_path,
                    {"kind": "eval", "step": step, "elapsed_s": round(time.time() - t0, 1), **m},
                )
        if step % args.save_interval == 0 or step == stop:
            save_checkpoint(ckpt_path, draft, cfg, opt, sched, step, args, master)
    bar.close()

    # ------------------------------------------------------------------ end
    if step < total:
        log(f"stopped at step {step} of {total}; continue with --resume")
        end_distributed()
        return
    final = evaluate(
        objective, eval_samples, args, target, cfg, device, rank, world, autocast, acceptance=True
    )
    state = fsdp.full_state(draft, opt)[0] if sharded else None  # every rank: FSDP gathers
    end_distributed()  # what follows runs on rank 0 alone
    if not (master and final):
        return
    save_acceptance(args.out_dir, final, cfg, step)  # first: auto's shape reads it
    if args.served_samples:
        if state is not None:
            draft = model.DraftModel(cfg).to(device)
            draft.load_state_dict(state)
        served = served_evaluation(args, draft, embed_w, head_w, eval_samples, device, autocast)
        record_served(args.out_dir, served)
        final.update({f"served_{k}": v for k, v in served.items()})
    append_log(
        log_path, {"kind": "final", "step": step, "elapsed_s": round(time.time() - t0, 1), **final}
    )
    print_summary(final, cfg)


def served_evaluation(args, draft, embed_w, head_w, samples, device, autocast) -> dict:
    """The first --served-samples held-out prompts decoded by the real loop (served.py), greedily,
    with the path of B-1 drafts and with the shape `auto` chooses; and the path's anchors scored
    teacher-forced, where the data has a block's first label: served tau beside teacher-forced tau
    at the same anchors (equal when the answers are the target's own greedy ones)."""
    t0 = time.time()
    target, tokenizer = load_target(args.target, machine.resolve_dtype("auto", device, "decode"))
    target = target.to(device)
    chosen = [samples[i] for i in range(min(len(samples), args.served_samples))]
    result = served.served_tau(target, copy.deepcopy(draft).eval(), tokenizer, chosen, args.out_dir)
    anchors = [  # where the data has the block's first label: a training anchor position
        sorted(set(visited) & set(data.anchor_positions(s["loss_mask"]).tolist()))
        for s, visited in zip(chosen, result["path"]["anchors"])
    ]
    objective = DraftObjective(draft, embed_w, head_w, loss_config(args), args.attention)
    online = target if args.online else None
    tf = evaluate(
        objective, chosen, args, online, draft.config, device, 0, 1, autocast, anchors=anchors
    )
    mode = "selector" if draft.candidate_selector is not None else "unary"
    return {
        "prompts": len(chosen),
        "path_tau": round(result["path"]["tau"], 4),
        "path_cycles": result["path"]["cycles"],
        "path_tf_tau": round(tf[f"accept_{mode}"], 4),
        "path_tf_blocks": sum(map(len, anchors)),
        "auto_shape": result["auto"]["shape"],
        "auto_tau": round(result["auto"]["tau"], 4),
        "auto_cycles": result["auto"]["cycles"],
        "seconds": round(time.time() - t0, 1),
    }


def print_summary(m, cfg):
    K = cfg.selector_top_k or 16
    mode = "selector" if cfg.dflash2 else "unary"
    rows = {
        "accept_unary": "accepted length, unary greedy path",
        "accept_selector": "accepted length, selector path",
        "accept_oracle": f"accepted length, oracle top-{K}",
        "topk_recall": f"top-{K} recall",
        "unary_acc": "unary accuracy",
        "sel_acc": "selector teacher-forced accuracy",
        "loss": "loss",
    }
    print("\nheld-out metrics")
    print("\n".join(f"  {name:40s} {m[k]:.4f}" for k, name in rows.items() if k in m))
    if "path_acc" in m:
        print(f"  {'selector path accuracy per position':40s} {m['path_acc']}")
    if "served_path_tau" in m:
        path = f"path of {cfg.block_size - 1} drafts"
        print(
            f"\nserved: {m['served_prompts']} held-out prompts decoded greedily by the real loop\n"
            f"  {'tau teacher-forced, random anchors':40s} {m[f'accept_{mode}']:.4f}\n"
            f"  {'tau teacher-forced, served anchors':40s} {m['served_path_tf_tau']:.4f}"
            f"  ({m['served_path_tf_blocks']} blocks)\n"
            f"  {'tau served, ' + path:40s} {m['served_path_tau']:.4f}"
            f"  ({m['served_path_cycles']} cycles)\n"
            f"  {'tau served, auto: ' + m['served_auto_shape']:40s} {m['served_auto_tau']:.4f}"
            f"  ({m['served_auto_cycles']} cycles)"
        )


if __name__ == "__main__":
    run(main)
