"""Train a DFlash2 (or, with --dflash, a plain DFlash) draft. One readable loop, nanoGPT-shaped.

    python train.py --data out/features                          # offline: features from prepare.py
    python train.py --online --data convs.jsonl                  # online: the target runs here
    torchrun --standalone --nproc_per_node=2 train.py ...        # DDP (gloo on CPU, nccl on GPU)
    torchrun --standalone --nproc_per_node=8 train.py --fsdp ... # the draft (and online the target)
    sharded: support/fsdp.py
    python tools/served.py OUT_DIR                               # then: served tau

Each optimizer step: for every micro-batch of rows (a conversation each, or with --pack several:
data.py), sample anchors, run all anchored blocks of each row through the draft in one pass
(model.forward_training), and get the objective's numerator and denominator (loss.py). Gradients of
all numerators are summed over micro-batches and ranks and divided once by the global denominator,
so 2 ranks x 1 micro-batch == 1 rank x 2 micro-batches. Every flag: docs/training.md.
"""

import argparse
import collections
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import data
import loss
import model
from compat.config_json import config_to_dict, load_config
from speed import machine
from support import flops, fsdp, kernels, tracking
from support.common import (
    DTYPES,
    add_chat_template_kwargs,
    atomic_write,
    bounded,
    end_distributed,
    run,
)
from support.metrics import add_into, all_sum, reduce_metrics, save_acceptance
from support.target import check_draft_fits, load_target

# The main job's prepared data (bash run.sh): what train.py reads when --data is not given
MAIN_JOB_DATA = "data/smollm2-math"


class HelpTable(argparse.RawDescriptionHelpFormatter):
    """--help as a table: a line a flag, a short value name, the default after the help."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=40)

    def _get_default_metavar_for_optional(self, action):
        return action.dest.split("_")[-1].upper()  # --selector-warmup-ratio RATIO

    def _get_help_string(self, action):
        unset = any(action.default is v for v in (None, False, argparse.SUPPRESS))
        return action.help + ("" if unset else " [%(default)s]")


def parse_args(argv=None):
    """One line a flag, in groups; what each one means and why its default: docs/training.md."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpTable)
    ratio, nonneg = bounded(float, low=0.0, high=1.0), bounded(float, low=0.0)
    count = bounded(int, low=1)
    a = p.add_argument_group("data").add_argument
    a("--data", help=f"prepare.py's features (--online: a JSONL); default {MAIN_JOB_DATA}/train")
    a("--eval-data", help="held-out data; default: the main job's, or split off --eval-fraction")
    a("--eval-fraction", type=ratio, default=0.05, help="--data held out without --eval-data")
    a("--num-samples", type=count, help="train on the first N sequences only")
    a("--online", action="store_true", help="the target runs here and gives features every step")
    a("--target", help="HF directory or hub name; default: the embedded SmolLM2-135M-Instruct")
    a("--target-dtype", choices=["auto", *DTYPES], default="auto", help="auto: speed/machine.py")
    a("--max-length", type=bounded(int, low=2), default=512, help="tokens per sequence or row")
    a("--pack", action="store_true", help="several conversations per row (data.py)")
    a("--data-workers", type=bounded(int, low=0), default=0, help="processes making batches ahead")
    add_chat_template_kwargs(a)  # offline: must be what prepare.py rendered the features with
    # the draft: --draft-config, and overrides validated by the config file's rules
    a = p.add_argument_group("draft").add_argument
    a("--draft-config", default="configs/smollm2-135m-dflash2.json", help="the draft's config.json")
    a("--dflash", action="store_true", help="plain DFlash baseline: no convolution, no selector")
    a("--freeze-conv", action="store_true", help="selector-only arm: convs stay identity")
    a("--block-size", type=bounded(int, low=2), help="override B, the block's slots")
    a("--num-layers", type=count, help="override the number of draft layers")
    a("--conv-kernel-size", type=int, help="override the convolution's taps (conv.py)")
    a("--conv-group-size", type=int, help="override the channels a kernel serves (conv.py)")
    a("--selector-rank", type=int, help="override the selector's rank r (selector.py)")
    a("--selector-top-k", type=int, help="override the selector's K candidates (selector.py)")
    a = p.add_argument_group("objective (loss.py)").add_argument
    a("--loss", choices=["ce", "kl", "tv", "lk"], default="ce", help="the unary logits' loss")
    a("--gamma", type=bounded(float, above=0.0), help="exp weights' decay; 7/5/4 for B 16/10/8")
    a("--num-anchors", type=count, default=512, help="blocks sampled per row")
    a("--selector-loss-alpha", type=nonneg, default=1.0, help="selector CE's weight; 0: frozen")
    a = p.add_argument_group("optimisation").add_argument
    a("--lr", type=bounded(float, above=0.0), default=6e-4, help="AdamW's peak learning rate")
    a("--min-lr-ratio", type=ratio, default=0.1, help="the cosine ends at lr x this")
    a("--warmup-ratio", type=ratio, default=0.04, help="share of steps with a linear warm-up")
    a("--lr-schedule", choices=["cosine", "constant"], default="cosine", help="after warm-up")
    a("--weight-decay", type=nonneg, default=0.0, help="AdamW's weight decay")
    a("--grad-clip", type=nonneg, default=1.0, help="clip the gradient norm to this; 0: off")
    a("--batch-size", type=count, default=1, help="rows per micro-batch per rank")
    a("--grad-accum", type=count, default=1, help="micro-batches per optimizer step")
    a("--epochs", type=count, default=1, help="passes over the training rows")
    a("--max-steps", type=count, help="stop after N steps; overrides --epochs")
    a("--max-seconds", type=bounded(float, above=0.0), help="fit the steps to this run's time")
    a = p.add_argument_group("running").add_argument
    a("--out-dir", default="out/draft", help="ckpt.pt, log.jsonl, acceptance.json")
    a("--resume", action="store_true", help="continue from OUT_DIR/ckpt.pt")
    a("--save-interval", type=count, default=200, help="steps between checkpoints")
    a("--eval-interval", type=count, default=200, help="steps between held-out evaluations")
    a("--eval-samples", type=bounded(int, low=0), default=64, help="held-out sequences at most")
    a("--log-interval", type=count, default=10, help="steps between log.jsonl records")
    a("--report-to", choices=tracking.REPORT_TO, default="none", help="also wandb / tensorboard")
    a("--seed", type=int, default=0, help="the draft's init, the row order, the anchors")
    a("--quiet", action="store_true", help="no progress bar")
    a = p.add_argument_group("scale and precision (docs/training-at-scale.md)").add_argument
    a("--fsdp", action="store_true", help="under torchrun: shard, not replicate (support/fsdp.py)")
    a("--dist-timeout", type=bounded(float, above=0.0), default=30.0, help="minutes; torchrun")
    a("--compile", action="store_true", help="torch.compile the draft")
    a("--gradient-checkpointing", action="store_true", help="recompute layers in backward")
    a("--attention", choices=["auto", "sdpa", "flex"], default="auto", help="auto: flex on GPU")
    a("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="auto: speed/machine.py")
    a("--chunk-blocks", type=bounded(int, low=0), default=64, help="anchors a chunk; 0 = off")
    a("--peak-tflops", type=bounded(float, above=0.0), help="GPU: MFU's peak")
    a = p.add_argument_group("research knobs (docs/training.md, docs/acceptance.md)").add_argument
    a("--anchors-per", choices=["row", "document"], default="row", help="with --pack")
    a("--position-weighting", choices=["exp", "dpace"], default="exp", help="dpace: D-PACE")
    a("--dpace-alpha", type=ratio, default=0.5, help="D-PACE's smoothing")
    a("--selector-warmup-ratio", type=ratio, default=0.0, help="share of steps at alpha 0")
    a("--selector-ramp-ratio", type=ratio, default=0.0, help="then alpha rises over this share")
    a("--selector-stop-gradient", action="store_true", help="selector CE: selector only")
    a("--selector-miss", choices=["strict", "replace"], default="strict", help="label not in K")
    a("--selector-weighting", choices=["exp", "uniform"], default="exp", help="uniform: 1 a slot")
    a("--steps-this-run", type=count, metavar="N", help="then stop; continue with --resume")
    args = p.parse_args(argv)
    if args.freeze_conv and (args.dflash or args.selector_loss_alpha == 0):
        p.error("--freeze-conv: with --dflash or --selector-loss-alpha 0 nothing of DFlash2 trains")
    if args.selector_weighting == "uniform" and args.position_weighting == "dpace":
        p.error("--selector-weighting uniform takes --position-weighting exp (loss.py)")
    return args


def main_job_data(rank: int) -> tuple:
    """No --data: the main job's prepared data (bash run.sh), or one line naming what makes it."""
    train, held_out = (os.path.join(MAIN_JOB_DATA, part) for part in ("train", "eval"))
    if not os.path.isfile(os.path.join(train, "manifest.json")):
        if rank != 0:  # under torchrun rank 0 says it, once; torchrun stops every rank as soon
            time.sleep(30)  # as one exits, so the others wait for rank 0 to print and exit first
            sys.exit(2)
        raise ValueError(
            f"no --data, and no prepared data at {train}: `bash run.sh` makes it (the main job), "
            "or `python prepare.py --prompts math --regenerate --features --draft-config "
            f"configs/smollm2-135m-dflash2.json --out-dir {train}`"
        )
    return train, (held_out if os.path.isfile(os.path.join(held_out, "manifest.json")) else None)


# ----------------------------------------------------------------------------- config and data
def build_config(args) -> model.DraftConfig:
    c = load_config(args.draft_config)
    names = ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    o = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.num_layers is not None:
        o["num_hidden_layers"] = args.num_layers
        o["layer_types"] = [
            c.layer_types[min(i, len(c.layer_types) - 1)] for i in range(args.num_layers)
        ]
    c = dataclasses.replace(c, **o)  # __post_init__ validates the overridden config
    return model.plain_dflash(c) if args.dflash else c


# ----------------------------------------------------------------------------- the training module
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
        self.draft, self.cfg, self.attention = draft, cfg, attention
        self.embed_weight, self.head_weight = embed_weight, head_weight

    def forward(self, batch, alpha_t, acceptance=False, sel_scale=None):
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
            sel_scale=sel_scale,
            docs=batch["docs"],
            acceptance=acceptance,
        )

    def uniform_denominators(self, batch):
        """--selector-weighting uniform: [sum w, D_sel] of a batch, before its forward (loss.py)."""
        B = self.draft.config.block_size
        keys = ("input_ids", "loss_mask", "anchors", "anchor_valid", "docs")
        return loss.uniform_denominators(self.cfg, B, *(batch[k] for k in keys))


def add_target_features(batch, target, cfg, need_final: bool, packed: bool):
    """Online mode: the live target provides features (and its final hidden state for kl); it reads
    the documents of packed rows one by one."""
    ids, mask, back = (
        data.per_document(batch) if packed else (batch["input_ids"], batch["attention_mask"], None)
    )
    out = model.capture_features(
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
def load_split(args, tokenizer, training=True) -> tuple:
    """-> (training sequences, held-out sequences). The held-out ones are --eval-data's or, without
    it, the last --eval-fraction of --data's (one at least, where it has two); --num-samples keeps
    the first N of the rest. training=False (tools/served.py): the held-out ones only (None
    first)."""
    kw = args.chat_template_kwargs
    load = lambda path: data.load_samples(path, args.online, tokenizer, args.max_length, kw)
    if args.eval_data:
        return (load(args.data)[: args.num_samples] if training else None), load(args.eval_data)
    samples = load(args.data)
    n_eval = max(1, int(len(samples) * args.eval_fraction)) if len(samples) > 1 else 0
    return samples[: len(samples) - n_eval][: args.num_samples], samples[len(samples) - n_eval :]


def schedule(samples, args, world) -> tuple:
    """-> (rows, rows per step, steps per epoch, total steps). A row (sample indices) is one
    sequence, or with --pack the sequences data.plan_rows puts together."""
    rows = [[i] for i in range(len(samples))]
    if args.pack:
        rows = data.plan_rows(data.lengths(samples), args.max_length)
    per_step = world * args.grad_accum * args.batch_size
    steps_per_epoch = len(rows) // per_step
    if steps_per_epoch == 0:
        raise ValueError(
            f"{args.data}: {len(rows)} training rows cannot fill one step of {per_step}"
        )
    return rows, per_step, steps_per_epoch, args.max_steps or args.epochs * steps_per_epoch


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


def micro_batch_plan(start, stop, steps_per_epoch, num_rows, args, rank, world):
    """(epoch, row indices) of this rank's micro-batches of steps start..stop-1, in order: what
    data.loader makes ahead; stop None: open-ended, as --max-seconds wants."""
    for step in range(start, stop) if stop is not None else itertools.count(start):
        epoch, micro = step_micro_batches(step, steps_per_epoch, num_rows, args, rank, world)
        yield from ((epoch, rows) for rows in micro)


def lr_factor(step, total, args):
    warm = max(1, math.floor(total * args.warmup_ratio))
    if step < warm:
        return (step + 1) / warm
    if args.lr_schedule == "constant":
        return 1.0
    t = (step - warm) / max(1, total - warm)
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def build_schedule(opt, args, total, step=0):
    """The lr schedule of `total` steps, standing at `step`: a fitted length's schedule goes on from
    where the old one stood, the lr at once lr_factor(step, total)."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total, args), last_epoch=step - 1
    )


# ------------------------------------------------------------- --max-seconds: steps fitted to time
FIT_EVERY = 25  # steps between fits
FIT_WINDOW = 200  # the step time: the mean of the last 200 (a window of 100 read 0.34-0.50 s in
# one native job whose steps averaged 0.40: the rows' lengths differ)
# an evaluation before one is timed: a held-out sequence's no-grad forward about a third of a
# training step (tools/plan.py prices it so; 5-9 s measured for 48 sequences at 0.40-0.53 s a step)
EVAL_STEPS_PER_SEQUENCE = 1 / 3


def total_that_fits(step, seconds_left, t_step, t_eval, eval_interval) -> int:
    """The schedule's length whose steps still to run (t_step seconds each), with an evaluation
    every eval_interval steps and the final one (t_eval each), fit seconds_left:
        total = step + floor((seconds_left - t_eval) / (t_step + t_eval / eval_interval))
    and never under step: out of time, the run ends where it stands."""
    per_step = t_step + t_eval / eval_interval
    return step + max(0, math.floor((seconds_left - t_eval) / per_step))


class TimeFit:
    """--max-seconds S: the run ends S seconds after it started, loading and evaluations included.
    Every FIT_EVERY steps the schedule (warm-up, cosine, the selector's alpha) takes the length
    that fits the time left, priced at this run's own step time. Why not the step count a probe
    priced: one machine's steps ran 0.7 to 1.3 times their three-step probe, by kind (docs/cpu.md),
    and a shared VM's speed drifts within a run. An early fit moves a cosine that has barely left
    its peak; a late one moves it little, the step time by then known."""

    def __init__(self, seconds, started, eval_interval, n_eval):
        self.deadline = None if seconds is None else started + seconds
        self.eval_interval, self.n_eval = eval_interval, n_eval
        self.clock = collections.deque(maxlen=FIT_WINDOW + 1)  # (step, seconds less evaluations)
        self.eval_s = []  # each evaluation's seconds

    def due(self, step) -> bool:
        if self.deadline is None:  # no --max-seconds: nothing timed
            return False
        self.clock.append((step, time.time() - sum(self.eval_s)))
        return step % FIT_EVERY == 0

    @contextlib.contextmanager
    def evaluation(self):
        t = time.time()
        yield
        self.eval_s.append(time.time() - t)

    def total(self, step) -> int:
        (s0, c0), (s1, c1) = self.clock[0], self.clock[-1]
        t_step = (c1 - c0) / max(1, s1 - s0)
        t_eval = self.n_eval * t_step * EVAL_STEPS_PER_SEQUENCE
        t_eval = sum(self.eval_s) / len(self.eval_s) if self.eval_s else t_eval
        return total_that_fits(
            step, self.deadline - time.time(), t_step, t_eval, self.eval_interval
        )


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
    # torch 2.11's inductor cannot lower flex attention's mask inside a compiled no-grad forward on
    # CUDA (docs/training-at-scale.md, "The second run"): there a --compile draft evaluates eagerly
    stance = "force_eager" if args.compile and device.type == "cuda" else "default"
    # every rank runs as many forwards (FSDP gathers weights in each) and takes part in the
    # all_reduce: a rank short of samples of its own adds zero copies
    mine = [(i % n, float(i < n)) for i in range(rank, -(-n // world) * world, world)]
    for i, keep in mine:
        given = None if anchors is None else [anchors[i]]
        batch = data.collate(
            [[samples[i]]], [10_000_000 + i], args.num_anchors, args.seed, device, anchors=given
        )
        batch = data.static_shapes(batch, args.num_anchors) if anything_compiles(args) else batch
        if target is not None:
            add_target_features(batch, target, cfg, args.loss == "kl", packed=False)
        with autocast(), torch.compiler.set_stance(stance):
            metrics = objective(batch, alpha_t=None, acceptance=acceptance)["metrics"]
        add_into(acc, {k: (num * keep, den * keep) for k, (num, den) in metrics.items()})
    objective.train()
    return reduce_metrics(acc)


def append_log(path, record: dict, tracker=None):
    """One log.jsonl record; --report-to sends it to the tracker too (support/tracking.py)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if tracker is not None:
        tracker.log(record)


def save_checkpoint(path, draft, cfg, opt, sched, step, total, args, master):
    """Every rank calls it (--fsdp gathers the slices); rank 0 writes the whole state, one file
    whatever the number of ranks. Atomic: a crash mid-write never leaves a broken ckpt.pt behind."""
    model_state, opt_state = fsdp.full_state(draft, opt)
    if master:
        state = {
            "model": model_state,
            "config": config_to_dict(cfg),
            "optimizer": opt_state,
            "scheduler": sched.state_dict(),
            "step": step,
            "total": total,  # the schedule's length (--max-seconds fits it)
            "args": vars(args),
        }
        with atomic_write(path) as tmp:
            torch.save(state, tmp)


def load_checkpoint(path, draft, opt, sched, sharded=False) -> tuple:
    """--resume: draft, optimizer and schedule as they were; returns the step to continue from and,
    where --max-seconds fitted the schedule, its length (else None): a fitted run goes on at it.
    Nothing else needs restoring: after the draft's init every draw (order, anchors) has its own
    seeded generator."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    ck = torch.load(path, map_location="cpu", mmap=True, weights_only=False)  # mapped: ranks share
    fsdp.load_full_state(draft, opt, ck["model"], ck["optimizer"], path, sharded)
    sched.load_state_dict(ck["scheduler"])
    return ck["step"], ck["total"] if ck["args"].get("max_seconds") else None


def train_step(objective, opt, sched, params, batches, alpha_t, args, world, no_sync, autocast):
    """One optimizer step over this rank's args.grad_accum micro-batches (built as they are used)
    -> (metrics, grad norm or None, whether the step was taken: not where the loss or the norm is
    not finite).

    The objective is one ratio over the micro-batches m of all ranks r (loss.py):
        J = sum_rm N_rm / D,   D = sum_rm D_rm   (the global denominator)
        dJ/dw = (1 / D) sum_rm dN_rm/dw
    Each backward adds dN_rm/dw into .grad; DDP (FSDP alike) then averages over the ranks, which
    leaves (1 / world) sum_rm dN_rm/dw. Times world / D that is dJ/dw exactly: 2 ranks x 1
    micro-batch == 1 rank x 2 micro-batches. D is known only after the last micro-batch, hence one
    all_reduce of D and one rescale, after the backwards.

    --selector-weighting uniform adds a second denominator: J = sum N_base / D + alpha_t sum N_sel /
    D_sel. Both come from the data alone (loss.uniform_denominators), so they are summed over the
    step first, and every micro-batch's N_sel enters times D / D_sel; the rescale by world / D
    then leaves alpha_t / D_sel on it."""
    acc, D, sel_scale = {}, 0.0, None
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
# A compiled draft (--compile; flex attention's kernels) specialises on its shapes, and a new one
# compiles again: batches are padded to data.static_shapes, a handful of buckets, each compiled
# once (no dynamic shapes: dynamic flex recompiles anyway). Past the limit dynamo would silently run
# eager, and eager flex is dense ([N, H, Q, K] scores, tens of GB): that ends the run instead.
COMPILE = dict(automatic_dynamic_shapes=False, recompile_limit=64, fail_on_recompile_limit_hit=True)


def anything_compiles(args) -> bool:
    """Whether batches are padded to data.static_shapes: where anything compiles (see COMPILE)."""
    return args.compile or args.attention == "flex"


def main(argv=None):
    args = parse_args(argv)
    if args.data is None:
        data_dir, held_out = main_job_data(int(os.environ.get("RANK", 0)))
        args.data, args.eval_data = data_dir, args.eval_data or held_out
    # the dynamo settings only where something compiles: an eager run leaves torch as it is
    compiling = torch._dynamo.config.patch(**COMPILE) if anything_compiles(args) else None
    try:
        with compiling or contextlib.nullcontext():
            train(args)
    except FailOnRecompileLimitHit as e:
        raise ValueError(
            f"a compiled function met more than {COMPILE['recompile_limit']} shapes (batches are "
            "padded to data.static_shapes, so this is a bug to report); train without --compile "
            f"and with --attention sdpa meanwhile ({str(e).splitlines()[0]})"
        ) from None


# ----------------------------------------------------------------------------- setup
def start_ranks(args) -> tuple:
    """-> (device, rank, world, distributed). Under torchrun (one process too: the same nccl / gloo
    path as many) the process group starts here, on this rank's GPU."""
    distributed = "RANK" in os.environ
    device = torch.device(
        f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)  # first: nccl (and anything on "cuda") uses this rank's GPU
    if distributed:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            device_id=device if device.type == "cuda" else None,
            timeout=datetime.timedelta(minutes=args.dist_timeout),  # rank-skewed compiles, saves
        )
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    return device, rank, world, distributed


def choose_attention(args, device):
    """--attention auto: support/kernels.py's choice; flex only where torch can train with it."""
    args.attention = kernels.choose(args.attention, device)
    if args.attention == "flex" and device.type == "cpu":
        raise ValueError(
            "--attention flex: torch runs FlexAttention on CPU forward only (no backward in 2.13); "
            "train on CPU with --attention sdpa"
        )


def choose_precision(args, device, log) -> tuple:
    """-> (bf16 autocast for the draft?, the target's dtype), the choice said in one line
    (speed/machine.py: bf16 where this CPU or GPU runs it natively, else fp32)."""
    use_bf16 = machine.resolve_dtype(args.dtype, device, "train") == torch.bfloat16
    target_dtype = machine.resolve_dtype(args.target_dtype, device, "data")
    online = {"online target": machine.dtype_name(target_dtype)} if args.online else {}
    draft_dtype = "bf16 autocast" if use_bf16 else "fp32"
    log(machine.choice_line(machine.describe(device), draft=draft_dtype, **online))
    dtypes = [torch.bfloat16] * use_bf16 + [target_dtype] * args.online
    for note in {machine.slow_bf16_note(dt, device) for dt in dtypes} - {""}:
        log(note)
    return use_bf16, target_dtype


def load_frozen_target(args, cfg, target_dtype, device, sharded) -> tuple:
    """-> (target or None, tokenizer, embedding [V, H], head [V, H]). Offline only the embedding and
    head are read (no decoder layer is built); online the target runs (--fsdp: sharded later)."""
    target, tokenizer = load_target(args.target, target_dtype, layers=args.online)
    check_draft_fits(cfg, target)
    embed_w = target.get_input_embeddings().weight.detach().to(device, torch.float32)
    head_w = target.get_output_embeddings().weight.detach().to(device, torch.float32)
    target = (target if sharded else target.to(device)) if args.online else None
    return target, tokenizer, embed_w, head_w


def build_objective(args, cfg, embed_w, head_w, target, device, ranks, use_bf16) -> tuple:
    """-> (draft, the objective module DDP / FSDP see, trained parameters, selector trained?)."""
    sharded, ddp = ranks
    draft = model.DraftModel(cfg).to(device)
    draft.gradient_checkpointing = args.gradient_checkpointing
    selector_on = cfg.dflash2 and args.selector_loss_alpha > 0
    # alpha == 0: the selector is frozen, out of the optimizer
    if cfg.dflash2 and not selector_on:
        draft.candidate_selector.requires_grad_(False)
    # --freeze-conv: every convolution keeps its exact identity init (conv.py), so the draft is
    # plain DFlash plus a trained selector: the selector-only arm (alpha 0: the convolution-only)
    for layer in draft.layers if args.freeze_conv else []:
        layer.attention_conv.requires_grad_(False)
        layer.mlp_conv.requires_grad_(False)
    objective = DraftObjective(
        torch.compile(draft) if args.compile else draft,
        embed_w,
        head_w,
        loss_config(args),
        args.attention,
    )
    if sharded:  # before the optimizer: its parameters become this rank's slices
        fsdp.shard(objective, draft.layers, target, use_bf16)
    elif ddp:  # a whole copy on every rank; the step's last backward all-reduces the gradients
        objective = DDP(objective, device_ids=[device.index] if device.type == "cuda" else None)
    params = [p for p in draft.parameters() if p.requires_grad]
    return draft, objective, params, selector_on


def build_optimizer(params, args, total) -> tuple:
    """AdamW (fused: one kernel for all tensors, 7% faster CPU steps here) and its lr schedule."""
    opt = torch.optim.AdamW(
        params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=True
    )
    return opt, build_schedule(opt, args, total)


def agreed(n: int, device, distributed) -> int:
    """Rank 0's n on every rank: the ranks' clocks differ, their schedules must not."""
    if not distributed:
        return n
    t = torch.tensor([n], device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


# ----------------------------------------------------------------------------- training
def train(args):
    # ------------------------------------------------------------------ setup
    started = time.time()  # --max-seconds counts from here
    device, rank, world, distributed = start_ranks(args)
    sharded = args.fsdp and world > 1  # --fsdp on one process: nothing to shard
    ddp = distributed and not args.fsdp
    master = rank == 0
    log = (lambda *m: print(*m, flush=True)) if master else (lambda *m: None)
    meter = flops.Meter(device, args.peak_tflops)  # tokens, anchors, FLOPs a second; MFU on a GPU
    choose_attention(args, device)
    torch.manual_seed(args.seed)  # the draft's initial weights
    cfg = build_config(args)
    use_bf16, target_dtype = choose_precision(args, device, log)
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)
    target, tokenizer, embed_w, head_w = load_frozen_target(
        args, cfg, target_dtype, device, sharded
    )
    samples, eval_samples = load_split(args, tokenizer)
    rows, per_step, steps_per_epoch, total = schedule(samples, args, world)
    draft, objective, params, selector_on = build_objective(
        args, cfg, embed_w, head_w, target, device, (sharded, ddp), use_bf16
    )
    opt, sched = build_optimizer(params, args, total)
    os.makedirs(args.out_dir, exist_ok=True)
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    log_path = os.path.join(args.out_dir, "log.jsonl")
    if master and not args.resume and os.path.exists(log_path):
        os.remove(log_path)  # a fresh run starts a fresh log
    tracker = tracking.Tracker(args.report_to if master else "none", args.out_dir, vars(args))
    step, fitted = (
        load_checkpoint(ckpt_path, draft, opt, sched, sharded) if args.resume else (0, None)
    )
    if args.resume:
        log(f"resumed from {ckpt_path} at step {step}")
    if fitted:  # the schedule goes on at the length --max-seconds fitted
        total, sched = fitted, build_schedule(opt, args, fitted, step)
    n_eval = min(len(eval_samples), args.eval_samples)
    fit = TimeFit(args.max_seconds, started, args.eval_interval, n_eval)
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
    if meter.note:
        log(meter.note)  # a GPU without a known peak: no MFU

    # ------------------------------------------------------------------ loop
    last = step + args.steps_this_run if args.steps_this_run else None
    stop = min(total, last or total)
    # this rank's micro-batches (rows of samples, anchors, features), made ahead by --data-workers
    per_doc, pin = args.anchors_per == "document", device.type == "cuda"  # pinned: async copies
    made = data.MicroBatches(
        samples, rows, args.num_anchors, args.seed, per_doc, anything_compiles(args)
    )
    ends = None if args.max_seconds else stop  # fitted: open-ended, the loop stops it
    plan = micro_batch_plan(step, ends, steps_per_epoch, len(rows), args, rank, world)
    ahead = iter(data.loader(made, plan, args.data_workers, pin))

    def next_batch():
        batch = data.to_device(next(ahead), device)
        if target is not None:  # online: the target's features of this batch
            add_target_features(batch, target, cfg, args.loss == "kl", args.pack)
        meter.count(cfg, batch, target)
        return batch

    # a step's backwards but the last add into .grad without communicating (DDP, FSDP alike)
    no_sync = objective.no_sync if ddp else contextlib.nullcontext
    no_sync = (lambda: fsdp.no_sync(objective)) if sharded else no_sync
    alpha = args.selector_loss_alpha, args.selector_warmup_ratio, args.selector_ramp_ratio
    quiet = not master or args.quiet
    bar = tqdm(total=total, initial=step, disable=quiet, desc="train", dynamic_ncols=True)
    t0 = time.time()
    since = lambda: round(time.time() - t0, 1)
    while step < stop:
        batches = (next_batch() for _ in range(args.grad_accum))
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
        rates = meter.rates(elapsed)  # per rank (per GPU), as usually quoted
        acc = f"{metrics['unary_acc']:.3f}"
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=acc, **meter.brief(rates))
        if fit.due(step):  # --max-seconds: the length that fits the time left (rank 0's)
            total = agreed(fit.total(step), device, distributed)
            sched = build_schedule(opt, args, total, step)
            stop, bar.total = min(total, last or total), total
        if master and (step % args.log_interval == 0 or step == total):
            norm = None if grad_norm is None else grad_norm.item()
            record = dict(kind="train", step=step, lr=sched.get_last_lr()[0], alpha_t=alpha_t)
            record.update(grad_norm=norm, elapsed_s=round(elapsed, 1), **rates, **metrics)
            append_log(log_path, record, tracker)
        if step % args.eval_interval == 0 and step < total:
            with fit.evaluation():
                m = evaluate(
                    objective, eval_samples, args, target, cfg, device, rank, world, autocast
                )
            if master and m:
                record = {"kind": "eval", "step": step, "elapsed_s": since(), **m}
                append_log(log_path, record, tracker)
        if step % args.save_interval == 0 or step == stop:
            save_checkpoint(ckpt_path, draft, cfg, opt, sched, step, total, args, master)
    bar.close()
    if args.max_seconds:
        log(
            f"--max-seconds {args.max_seconds:g}: {total} steps fitted, the final evaluation "
            f"{time.time() - started:.0f} s in"
        )

    # ------------------------------------------------------------------ end: the held-out summary
    if step < total:
        log(f"stopped at step {step} of {total}; continue with --resume")
        tracker.close()
        end_distributed()
        return
    final = evaluate(
        objective, eval_samples, args, target, cfg, device, rank, world, autocast, acceptance=True
    )
    end_distributed()  # what follows runs on rank 0 alone
    if master and final:
        save_acceptance(args.out_dir, final, cfg, step)  # before the record: it pops what it keeps
        record = {"kind": "final", "step": step, "elapsed_s": since(), **final}
        append_log(log_path, record, tracker)
        print_summary(final, cfg)
        print(f"\nserved tau (the real decoding loop): python tools/served.py {args.out_dir}")
    tracker.close()


def print_summary(m, cfg):
    K = cfg.selector_top_k or 16
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


if __name__ == "__main__":
    run(main)
