"""Train a DFlash2 (or, with --dflash, a plain DFlash) draft. One readable loop, nanoGPT-shaped.

    python train.py --data out/features                          # offline: features from prepare.py
    python train.py --online --data convs.jsonl                  # online: the target runs here
    torchrun --standalone --nproc_per_node=2 train.py ...        # DDP (gloo on CPU, nccl on GPU)
    torchrun --standalone --nproc_per_node=8 train.py --fsdp ... # the draft (and online the target)
    sharded: support/fsdp.py
    python -m tools.served OUT_DIR                               # then: served tau

Each optimizer step: for every micro-batch of rows (a conversation each, or with --pack several:
data.py), sample anchors, run all anchored blocks of each row through the draft in one pass
(model.forward_training), and get the objective's numerator and denominator (loss.py). Gradients of
all numerators are summed over micro-batches and ranks and divided once by the global denominator,
so 2 ranks x 1 micro-batch == 1 rank x 2 micro-batches. Every flag: docs/training.md.
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
from tqdm import tqdm

import data
import loss
import model
from compat.config_json import config_to_dict, load_config, replace_config
from speed import machine
from support import compiling, distributed, flops, kernels, tracking
from support.common import DTYPES, HelpTable, UsageError, add_chat_template_kwargs, bounded, run
from support.fsdp import load_checkpoint, save_checkpoint
from support.metrics import add_into, all_sum, objective_with_metrics, reduce_metrics
from support.target import check_draft_fits, load_target
from support.timefit import TimeFit


def parse_args(argv=None):
    """One line a flag, in groups; what each one means and why its default: docs/training.md."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpTable)
    ratio, nonneg = bounded(float, low=0.0, high=1.0), bounded(float, low=0.0)
    count = bounded(int, low=1)
    a = p.add_argument_group("data").add_argument
    a("--data", help="prepare.py's features (--online: a JSONL); default: the main job's train")
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
    c = replace_config(c, **o)  # validates the overridden config
    exp = args.position_weighting == "exp"  # its weights decay with gamma (loss.py)
    if exp and args.gamma is None and c.block_size not in loss.DEFAULT_GAMMA:
        raise UsageError(f"no default gamma for block size {c.block_size}; set --gamma")
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
        self.draft, self.cfg = draft, cfg
        self.attention = kernels.attention_kernel(attention)  # (mask, kernel) for the draft
        self.embed_weight, self.head_weight = embed_weight, head_weight

    def forward(self, batch, alpha_t, acceptance=False, sel_scale=None):
        b, embed = batch, lambda ids: F.embedding(ids, self.embed_weight)
        ids, anchors, valid, docs = b["input_ids"], b["anchors"], b["anchor_valid"], b["docs"]
        h = model.forward_training(
            self.draft, embed, ids, b["features"], anchors, b["positions"], docs, self.attention
        )
        kw = dict(target_hidden=b.get("target_hidden"), alpha_t=alpha_t, sel_scale=sel_scale)
        kw.update(docs=docs, acceptance=acceptance)
        return objective_with_metrics(  # loss.objective, and the metrics of its chunks
            self.draft, self.head_weight, h, ids, b["loss_mask"], anchors, valid, self.cfg, **kw
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
    kw = dict(final_hidden=need_final, use_cache=False, logits_to_keep=1)
    out = model.capture_features(
        target, cfg.target_layer_ids, **kw, input_ids=ids, attention_mask=mask
    )
    for name, value in [("features", out[1])] + ([("target_hidden", out[2])] if need_final else []):
        batch[name] = back(value.float()) if packed else value.float()


# ------------------------------------------------------------------- steps, evaluation, checkpoints
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


@torch.no_grad()
def evaluate(
    objective, samples, args, target, cfg, device, rank, world, autocast, acceptance=False
):
    """Teacher-forced held-out metrics over the first --eval-samples sequences, at random anchors.
    A --compile draft evaluates uncompiled: its no-grad graphs would compile again (torch 2.11's
    inductor could not lower flex's mask in them on CUDA: docs/training-at-scale.md, "The second
    run"), while flex attention stays compiled on its own (support/kernels.py): no dense scores."""
    n = min(len(samples), args.eval_samples)
    if n == 0:
        return {}
    inner = getattr(objective, "module", objective)  # DDP wraps it
    compiled, inner.draft = inner.draft, getattr(inner.draft, "_orig_mod", inner.draft)
    objective.eval()
    acc = {}
    # every rank runs as many forwards (FSDP gathers weights in each) and takes part in the
    # all_reduce: a rank short of samples of its own adds zero copies
    mine = [(i % n, float(i < n)) for i in range(rank, -(-n // world) * world, world)]
    for i, keep in mine:
        batch = data.collate([[samples[i]]], [10_000_000 + i], args.num_anchors, args.seed, device)
        if compiling.anything_compiles(args):
            batch = data.static_shapes(batch, args.num_anchors)
        if target is not None:
            add_target_features(batch, target, cfg, args.loss == "kl", packed=False)
        with autocast():
            metrics = objective(batch, alpha_t=None, acceptance=acceptance)["metrics"]
        add_into(acc, {k: (num * keep, den * keep) for k, (num, den) in metrics.items()})
    objective.train()
    inner.draft = compiled
    return reduce_metrics(acc)


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


# ----------------------------------------------------------------------------- setup
def main(argv=None):
    args = parse_args(argv)
    if args.data is None:
        data_dir, held_out = data.main_job_data(int(os.environ.get("RANK", 0)))
        args.data, args.eval_data = data_dir, args.eval_data or held_out
    args.attention = compiling.choose_attention(args.attention, distributed.rank_device())
    with compiling.guard(compiling.anything_compiles(args)):  # dynamo's settings, where it runs
        train(args)


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
    """-> (draft, the objective module DDP / FSDP see, its no_sync, trained parameters, selector
    trained?)."""
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
    step_draft = torch.compile(draft) if args.compile else draft
    objective = DraftObjective(step_draft, embed_w, head_w, loss_config(args), args.attention)
    # before the optimizer: sharded, its parameters become this rank's slices
    objective, no_sync = distributed.wrap(objective, draft.layers, target, device, *ranks, use_bf16)
    params = [p for p in draft.parameters() if p.requires_grad]
    return draft, objective, no_sync, params, selector_on


def build_optimizer(params, args, total) -> tuple:
    """AdamW (fused: one kernel for all tensors, 7% faster CPU steps here) and its lr schedule."""
    opt = torch.optim.AdamW(
        params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=True
    )
    return opt, build_schedule(opt, args, total)


# ----------------------------------------------------------------------------- training
def train(args):
    # ------------------------------------------------------------------ setup
    started = time.time()  # --max-seconds counts from here
    timeout = datetime.timedelta(minutes=args.dist_timeout)  # rank-skewed compiles, saves
    device, rank, world, ranked = distributed.start_ranks(timeout)
    sharded = args.fsdp and world > 1  # --fsdp on one process: nothing to shard
    master = rank == 0
    log = (lambda *m: print(*m, flush=True)) if master else (lambda *m: None)
    meter = flops.Meter(device, args.peak_tflops)  # tokens, anchors, FLOPs a second; MFU on a GPU
    torch.manual_seed(args.seed)  # the draft's initial weights
    cfg = build_config(args)
    use_bf16, target_dtype, said = machine.train_precision(
        args.dtype, args.target_dtype, args.online, device
    )
    log("\n".join(said))
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)
    target, tok, embed_w, head_w = load_frozen_target(args, cfg, target_dtype, device, sharded)
    samples, eval_samples = data.load_split(args, tok)
    rows, per_step, _, total = data.schedule(samples, args, world)
    ranks = (sharded, ranked and not args.fsdp)  # (FSDP, DDP)
    draft, objective, no_sync, params, selector_on = build_objective(
        args, cfg, embed_w, head_w, target, device, ranks, use_bf16
    )
    opt, sched = build_optimizer(params, args, total)
    os.makedirs(args.out_dir, exist_ok=True)
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    log_path = os.path.join(args.out_dir, "log.jsonl")
    if master and not args.resume and os.path.exists(log_path):
        os.remove(log_path)  # a fresh run starts a fresh log
    tracker = tracking.Tracker(args.report_to if master else "none", args.out_dir, vars(args))
    step, fitted = 0, None
    if args.resume:
        step, fitted = load_checkpoint(ckpt_path, draft, opt, sched, sharded)
        log(f"resumed from {ckpt_path} at step {step}")
    if fitted:  # the schedule goes on at the length --max-seconds fitted
        total, sched = fitted, build_schedule(opt, args, fitted, step)
    n_eval = min(len(eval_samples), args.eval_samples)
    fit = TimeFit(args.max_seconds, started, args.eval_interval, n_eval, device, ranked)
    log(
        f"{'DFlash2' if cfg.dflash2 else 'DFlash'} draft: "
        f"{sum(p.numel() for p in draft.parameters()):,} parameters; "
        f"{len(samples)} train / {len(eval_samples)} eval sequences; "
        f"{total} steps of {per_step} rows on {world} rank(s)"
        f"{f' ({torch.distributed.get_backend()})' if ranked else ''}, "
        f"{device}, {args.attention} attention"
        + (", FSDP" if sharded else "")
        + (f"; packed into {len(rows)} rows" if args.pack else "")
    )
    if meter.note:
        log(meter.note)  # a GPU without a known peak: no MFU

    # ------------------------------------------------------------------ loop
    last = step + args.steps_this_run if args.steps_this_run else None
    stop = min(total, last or total)
    # this rank's micro-batches on the host (pinned on a GPU: the copies run asynchronously)
    ends = None if args.max_seconds else stop  # fitted: open-ended, the loop stops it
    static, pin = compiling.anything_compiles(args), device.type == "cuda"
    ahead = data.batches(samples, rows, args, rank, world, step, ends, static, pin)

    def next_batch():
        host = next(ahead)
        meter.count(cfg, host, target)  # counted before the copy: no wait for the device
        batch = data.to_device(host, device)
        if target is not None:  # online: the target's features of this batch
            add_target_features(batch, target, cfg, args.loss == "kl", args.pack)
        return batch

    alpha = args.selector_loss_alpha, args.selector_warmup_ratio, args.selector_ramp_ratio
    quiet = not master or args.quiet
    bar = tqdm(total=total, initial=step, disable=quiet, desc="train", dynamic_ncols=True)
    t0, rates = time.time(), {}
    since = lambda: round(time.time() - t0, 3)  # this invocation's seconds, evaluations included
    meter.restart()
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
            distributed.end_ranks()
            sys.exit(1)
        step += 1
        bar.update(1)
        if fit.due(step):  # --max-seconds: the length that fits the time left (rank 0's)
            total = fit.total(step)
            sched = build_schedule(opt, args, total, step)
            stop, bar.total = min(total, last or total), total
        if master and (step % args.log_interval == 0 or step == total):
            rates = meter.rates()  # this interval's, per rank (per GPU), as usually quoted
            norm = None if grad_norm is None else grad_norm.item()
            record = dict(kind="train", step=step, lr=sched.get_last_lr()[0], alpha_t=alpha_t)
            record.update(grad_norm=norm, elapsed_s=since(), **rates, **metrics)
            tracking.append_log(log_path, record, tracker)
        acc = f"{metrics['unary_acc']:.3f}"
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=acc, **meter.brief(rates))
        # the checkpoint first: an evaluation that fails (out of memory) loses no step
        if step % args.save_interval == 0 or step == stop:
            with meter.paused():
                config = config_to_dict(cfg)  # what export.py writes as config.json
                save_checkpoint(ckpt_path, draft, config, opt, sched, step, total, args, master)
        if step % args.eval_interval == 0 and step < total:
            with fit.evaluation(), meter.paused():
                m = evaluate(
                    objective, eval_samples, args, target, cfg, device, rank, world, autocast
                )
            if master and m:
                record = {"kind": "eval", "step": step, "elapsed_s": since(), **m}
                tracking.append_log(log_path, record, tracker)
    bar.close()
    if args.max_seconds:
        log(fit.summary(total))

    # ------------------------------------------------------------------ end: the held-out summary
    if step < total:
        log(f"stopped at step {step} of {total}; continue with --resume")
        tracker.close()
        distributed.end_ranks()
        return
    final = evaluate(
        objective, eval_samples, args, target, cfg, device, rank, world, autocast, acceptance=True
    )
    distributed.end_ranks()  # what follows runs on rank 0 alone
    if master and final:
        tracking.final_report(args.out_dir, log_path, final, cfg, step, since(), tracker)
    tracker.close()


if __name__ == "__main__":
    run(main)
