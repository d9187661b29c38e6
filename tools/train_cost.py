"""Time and peak memory of one training step at scale: random weights, random conversations, no
download.

    # padded (one conversation per row), then the same conversations packed
    OMP_NUM_THREADS=1 python tools/train_cost.py --num-anchors 64
    OMP_NUM_THREADS=1 python tools/train_cost.py --num-anchors 64 --pack
    OMP_NUM_THREADS=1 python tools/train_cost.py --part attention --attention flex --warmup 1
    python tools/train_cost.py --num-layers 5 --lengths 8192 --attention flex --dtype bf16 \\
        --compile --warmup 2
    # one long conversation, each layer recomputed in backward (docs/training-at-scale.md)
    python tools/train_cost.py --num-layers 2 --lengths 32768 --gradient-checkpointing

The draft is --draft-config (default the Qwen3-8B-shaped DFlash2 config) cut to --num-layers with
block size --block-size; the target's embedding and head are random [V, H] matrices and the
conversations random tokens of --lengths, every token supervised, with random features. The step is
train.py's own: data.collate (right-padded rows, or with --pack the rows of data.plan_rows),
train.DraftObjective (draft, objective, metrics) and the numerator's backward. --part forward runs
the same without gradient (FlexAttention has no CPU backward); --part attention runs only the
attention of one layer's shapes on the same layout (random q, k, v): the mask, dense or a BlockMask,
and one SDPA or flex call, forward.
The draft is built as train.py builds it (on the CPU, then moved to the device).
--compile compiles the draft as train.py --compile does, --gradient-checkpointing checkpoints its
layers as train.py --gradient-checkpointing does. On a GPU the step's MFU is printed too: its
model FLOPs (flops.step_flops, the objective's target-free offline step) / time / the GPU's peak.
--json writes the measured row to a file (the first GPU check's 8B rows came so; tools/gpu_check.py
now runs train.py itself).

Memory: the peak during the timed step(s), on a GPU of allocated memory, on the CPU of the process's
resident set (VmHWM, reset before the step), which includes the weights; the amount before the step
is printed beside it.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's modules
import attention  # noqa: E402
import data  # noqa: E402
import model  # noqa: E402
import train  # noqa: E402
from support import flops, kernels  # noqa: E402
from support.common import bounded, run, write_json  # noqa: E402


def conversations(lengths, cfg, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(0, cfg.vocab_size - 1, (n,), generator=g),
            "loss_mask": torch.ones(n, dtype=torch.long),
            "features": torch.randn(n, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g),
        }
        for n in lengths
    ]


def rss_gib(field: str) -> float:
    """VmRSS (resident now) or VmHWM (peak resident since the last reset_peak_rss) in GiB."""
    with open("/proc/self/status") as f:
        # kB
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 2**20


def reset_peak_rss():
    # Linux: "5" resets VmHWM to the current resident set
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def attention_call(cfg, batch, how: str, device):
    """One layer's attention on the batch's layout (layer 0's kind), random q, k, v: mask +
    attention."""
    c = cfg
    _, q_pos, q_anchor, q_block, q_doc = model.anchored_blocks(
        batch["input_ids"],
        batch["anchors"],
        c.block_size,
        c.mask_token_id,
        batch["positions"],
        batch["docs"],
    )
    queries = (q_anchor, q_pos, q_block, q_doc)
    keys = attention.attention_keys(q_pos, q_block, q_doc, batch["positions"], batch["docs"])
    sliding = c.layer_types[0] == "sliding_attention"
    rule = (c.causal_in_block(sliding=sliding), c.sliding_window if sliding else None)
    (N, Q), K = q_pos.shape, keys[0].shape[1]
    g = torch.Generator(device).manual_seed(0)
    q = torch.randn(N, c.num_attention_heads, Q, c.head_dim, generator=g, device=device)
    k, v = (
        torch.randn(N, c.num_key_value_heads, K, c.head_dim, generator=g, device=device)
        for _ in range(2)
    )

    def call():
        if how == "sdpa":
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attention.block_attention_mask(queries, keys, *rule),
                enable_gqa=True,
            )
        return kernels.flex(q, k, v, kernels.flex_block_mask(queries, keys, *rule), True)

    def tiles() -> str:
        bm = kernels.flex_block_mask(queries, keys, *rule)
        used = bm.kv_num_blocks.sum().item() + (
            0 if bm.full_kv_num_blocks is None else bm.full_kv_num_blocks.sum().item()
        )
        total = N * -(-Q // bm.BLOCK_SIZE[0]) * -(-K // bm.BLOCK_SIZE[1])
        return (
            f"; the BlockMask leaves {used} of {total} tiles of {bm.BLOCK_SIZE[0]} x "
            f"{bm.BLOCK_SIZE[1]} scores to compute"
        )

    return call, tiles


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--draft-config", default=os.path.join(ROOT, "configs", "qwen3-8b-dflash2.json"))
    p.add_argument("--num-layers", type=bounded(int, low=1), default=1)
    p.add_argument("--block-size", type=bounded(int, low=2), default=16)
    p.add_argument(
        "--lengths",
        default="2048,1024,640,384",
        help="conversation lengths in tokens, comma-separated",
    )
    p.add_argument(
        "--max-length", type=bounded(int, low=2), default=2048, help="--pack: tokens per row"
    )
    p.add_argument("--num-anchors", type=bounded(int, low=1), default=512, help="per row")
    p.add_argument("--pack", action="store_true")
    p.add_argument("--attention", choices=["sdpa", "flex"], default="sdpa")
    p.add_argument("--part", choices=["step", "forward", "attention"], default="step")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: autocast, as train.py --dtype bf16",
    )
    p.add_argument(
        "--warmup",
        type=bounded(int, low=0),
        default=0,
        help="untimed runs first (flex compiles on its first)",
    )
    p.add_argument("--repeats", type=bounded(int, low=1), default=1)
    p.add_argument(
        "--compile", action="store_true", help="torch.compile the draft, as train.py --compile"
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each layer in backward, as train.py --gradient-checkpointing",
    )
    p.add_argument(
        "--peak-tflops",
        type=bounded(float, above=0.0),
        default=None,
        help="GPU only: the peak TFLOP/s behind MFU; default: flops.PEAK_TFLOPS by device name",
    )
    p.add_argument("--json", default=None, help="also write the measured row to this file")
    args = p.parse_args(argv)
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        raise ValueError(f"--lengths: comma-separated token counts, got {args.lengths!r}") from None
    if min(lengths) < 2:
        raise ValueError(
            f"--lengths: every conversation needs 2 tokens or more, got {args.lengths!r}"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.attention == "flex" and device.type == "cpu" and args.part == "step":
        raise ValueError(
            "--attention flex: torch runs FlexAttention on CPU forward only; use --part forward "
            "or attention"
        )
    if args.compile and args.part == "attention":
        raise ValueError("--compile compiles the draft; --part attention runs no draft")
    peak = flops.peak_flops(device, args.peak_tflops)
    targs = train.parse_args(
        [
            "--data",
            "-",
            "--draft-config",
            args.draft_config,
            "--num-layers",
            str(args.num_layers),
            "--block-size",
            str(args.block_size),
            "--num-anchors",
            str(args.num_anchors),
            "--attention",
            args.attention,
        ]
    )
    cfg = train.build_config(targs)
    torch.manual_seed(0)

    samples = conversations(lengths, cfg, seed=0)
    rows = (
        data.plan_rows(lengths, args.max_length)
        if args.pack
        else [[i] for i in range(len(lengths))]
    )
    batch = data.collate(
        [[samples[i] for i in r] for r in rows], list(range(len(rows))), args.num_anchors, 0, device
    )
    del samples  # train.py streams its samples: only the batch stays (S x 80 KiB at 8B shape)
    note = lambda: ""
    if args.part == "attention":
        step, tiles = attention_call(cfg, batch, args.attention, device)
        note = tiles if args.attention == "flex" else note
    else:
        # built as train.py builds it: on the CPU, then moved (about 10 s at 8B shape on 16 cores)
        draft = model.DraftModel(cfg).to(device)
        draft.gradient_checkpointing = args.gradient_checkpointing
        embed_w, head_w = (
            torch.empty(cfg.vocab_size, cfg.hidden_size, device=device).normal_(0, 0.02)
            for _ in range(2)
        )
        objective = train.DraftObjective(
            torch.compile(draft) if args.compile else draft,
            embed_w,
            head_w,
            train.loss_config(targs),
            targs.attention,
        )

        def step():
            with (
                torch.autocast(device.type, torch.bfloat16, enabled=args.dtype == "bf16"),
                torch.set_grad_enabled(args.part == "step"),
            ):
                out = objective(batch, alpha_t=targs.selector_loss_alpha)
                if args.part == "step":
                    out["numerator"].backward()
            draft.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    before = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else rss_gib("VmRSS")
    torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else reset_peak_rss()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak_mem = (
        torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else rss_gib("VmHWM")
    )
    N, S = batch["input_ids"].shape
    t = sorted(times)[len(times) // 2]
    tokens, anchors = batch["attention_mask"].sum().item(), batch["anchor_valid"].sum().item()
    mfu = flops.step_flops(cfg, batch) / t / peak if peak and args.part == "step" else None
    print(
        f"{args.part}, {args.attention}, {'packed' if args.pack else 'padded'}, "
        f"{args.dtype}{', compiled' if args.compile else ''}"
        f"{', checkpointed' if args.gradient_checkpointing else ''}, "
        f"{torch.get_num_threads()} thread(s), "
        f"{device}: {N} rows x {S} tokens ({tokens} real), {batch['anchors'].shape[1]} anchor "
        f"slots per row ({anchors} valid), B = {cfg.block_size}: {t:.2f} s (median of "
        f"{len(times)}); {tokens / t:.0f} tokens/s, {anchors / t:.1f} "
        f"anchors/s{'' if mfu is None else f', MFU {mfu:.3f}'}; peak memory {peak_mem:.2f} GiB "
        f"({before:.2f} GiB before the step){note()}"
    )
    if args.json:
        write_json(
            args.json,
            {
                "part": args.part,
                "attention": args.attention,
                "packed": args.pack,
                "dtype": args.dtype,
                "compile": args.compile,
                "gradient_checkpointing": args.gradient_checkpointing,
                "device": str(device),
                "rows": N,
                "row_tokens": S,
                "tokens": tokens,
                "anchors": anchors,
                "block_size": cfg.block_size,
                "num_layers": cfg.num_hidden_layers,
                "seconds": t,
                "times": times,
                "tokens_per_s": tokens / t,
                "anchors_per_s": anchors / t,
                "mfu": mfu,
                "peak_memory_gib": peak_mem,
                "memory_before_gib": before,
            },
        )


if __name__ == "__main__":
    run(main)
