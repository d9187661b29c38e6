"""Resident memory per rank of train.py on the CPU, DDP against --fsdp: what sharding saves.

    python tools/fsdp_memory.py                                   # H 1024; 4 and 8 layers; 2 ranks
    python tools/fsdp_memory.py --hidden-size 1024 --layers 4 8 --nproc 2 --steps 3

For each layer count and each mode, train.py runs offline under torchrun (gloo) for --steps steps on
random features, and every rank reports three numbers: its resident set just after the last
optimizer step (the state it holds: weights, gradients, AdamW moments), its peak before the
checkpoint save (training), and its peak at the end (rank 0 then also held the whole state it
wrote). The draft is random and wide enough that its state dominates; the target is a random
2-layer Llama of the same width made in memory (train.py's load_target is replaced: offline,
train.py keeps only its embedding and head). The difference between two layer counts, divided by
the parameters those layers add, is what a draft parameter costs a rank, free of the fixed costs
(torch, target, data):

    DDP:   fp32 weight 4 + gradient 4 + AdamW moments 8 = 16 bytes, + 4 for DDP's gradient buckets
    FSDP:  those 16 bytes / world; the peak adds the one or two layers gathered whole while
           they compute

glibc keeps freed blocks under its mmap threshold (adaptive, up to 32 MiB) on its heap, where the
resident set still counts them: the runs fix MALLOC_MMAP_THRESHOLD_ at 128 KiB and
MALLOC_TRIM_THRESHOLD_ at 0, so that what torch frees leaves the resident set (a single process then
measures 16.1 bytes a parameter after the step, where glibc's defaults gave 18).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model  # noqa: E402
import train  # noqa: E402
from compat import config_json as config  # noqa: E402  (the repository's modules, one folder up)
from support import features  # noqa: E402
from support.common import bounded, run  # noqa: E402
from train_cost import rss_gib  # noqa: E402


def draft_config(hidden: int, layers: int, vocab: int) -> dict:
    c = model.DraftConfig(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        head_dim=64,
        vocab_size=vocab,
        num_target_layers=2,
        target_layer_ids=[0, 1],
        mask_token_id=vocab - 1,
        block_size=8,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=64,
        selector_top_k=16,
    )
    return config.config_to_dict(c)


def random_features(out: str, hidden: int, vocab: int, samples: int, length: int):
    """A feature directory without a target: random tokens and features, every token supervised."""
    os.makedirs(out)
    g = torch.Generator().manual_seed(0)
    rows = [
        {
            "input_ids": torch.randint(0, vocab - 1, (length,), generator=g),
            "loss_mask": torch.ones(length, dtype=torch.long),
            "features": torch.randn(length, 2 * hidden, generator=g).to(torch.bfloat16),
        }
        for _ in range(samples)
    ]
    features.save_shard(
        features.shard_path(out, 0),
        rows,
        {
            "target_layer_ids": "[0, 1]",
            "feature_dtype": "bf16",
            "max_length": length,
            "target_hidden": False,
            "shard_size": samples,
            "num_samples": samples,
            "skipped_nonfinite": 0,
            "skipped_no_anchor": 0,
        },
    )
    features.write_manifest(out, samples, samples, "random", 2 * hidden)


def worker(report: str, argv: list):
    """One torchrun rank: train.py's main with a random in-memory target; writes this rank's three
    numbers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = json.load(open(argv[argv.index("--draft-config") + 1]))

    def random_target(name, dtype, layers=True):  # train.py offline: layers=False, unused here
        torch.manual_seed(0)
        H = c["hidden_size"]
        t = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=c["vocab_size"],
                hidden_size=H,
                intermediate_size=256,
                num_hidden_layers=2,
                num_attention_heads=H // 64,
                num_key_value_heads=H // 128,
                head_dim=64,
            )
        )
        return t.to(dtype).eval().requires_grad_(False), None

    peaks, save, step = {}, train.save_checkpoint, torch.optim.AdamW.step  # peaks in MiB

    def measured_step(*args, **kw):
        out = step(*args, **kw)
        peaks["state"] = rss_gib("VmRSS") * 1024
        return out

    def measured_save(*args, **kw):
        peaks.setdefault("train", rss_gib("VmHWM") * 1024)
        save(*args, **kw)

    train.load_target, train.save_checkpoint, torch.optim.AdamW.step = (
        random_target,
        measured_save,
        measured_step,
    )
    train.main(argv)
    peaks["end"] = rss_gib("VmHWM") * 1024
    with open(f"{report}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(peaks, f)


def main(argv=None):
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3:])
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden-size", type=bounded(int, low=128), default=1024)
    p.add_argument("--layers", type=bounded(int, low=1), nargs="+", default=[4, 8])
    p.add_argument("--vocab-size", type=bounded(int, low=64), default=4096)
    p.add_argument("--nproc", type=bounded(int, low=2), default=2)
    p.add_argument("--steps", type=bounded(int, low=1), default=3)
    p.add_argument("--length", type=bounded(int, low=16), default=128, help="tokens per sequence")
    args = p.parse_args(argv)
    if args.hidden_size % 128:
        raise ValueError(
            f"--hidden-size: a multiple of 128 (heads of 64, 2 per KV head), got {args.hidden_size}"
        )
    tmp = tempfile.mkdtemp(prefix="fsdp-memory-")
    samples = 2 * args.nproc * args.steps
    random_features(
        os.path.join(tmp, "feats"), args.hidden_size, args.vocab_size, samples, args.length
    )
    rows, params = [], {}
    for layers in args.layers:
        cfg_file = os.path.join(tmp, f"draft-{layers}.json")
        with open(cfg_file, "w") as f:
            json.dump(draft_config(args.hidden_size, layers, args.vocab_size), f)
        with torch.device("meta"):
            params[layers] = sum(
                q.numel() for q in model.DraftModel(config.load_config(cfg_file)).parameters()
            )
        for mode in ("ddp", "fsdp"):
            report = os.path.join(tmp, f"peaks-{mode}-{layers}")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={args.nproc}",
                os.path.abspath(__file__),
                "--worker",
                report,
                "--draft-config",
                cfg_file,
                "--data",
                os.path.join(tmp, "feats"),
                "--out-dir",
                os.path.join(tmp, f"out-{mode}-{layers}"),
                "--quiet",
                "--max-steps",
                str(args.steps),
                "--eval-samples",
                "0",
                "--num-anchors",
                "16",
                "--gamma",
                "4",
                "--save-interval",
                "1000000",
                "--eval-interval",
                "1000000",
            ] + (["--fsdp"] if mode == "fsdp" else [])
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "MALLOC_MMAP_THRESHOLD_": "131072",
                "MALLOC_TRIM_THRESHOLD_": "0",
            }
            subprocess.run(cmd, check=True, env=env)
            ranks = []
            for r in range(args.nproc):
                with open(f"{report}.{r}") as f:
                    ranks.append(json.load(f))
            rows.append((mode, layers, ranks))
    print(
        f"\ndraft H {args.hidden_size}, vocab {args.vocab_size}, {args.nproc} ranks, {args.steps} "
        "steps; resident MiB per rank: after the last optimizer step / peak of training; rank 0's "
        "peak with the checkpoint save"
    )
    ranks_head = " | ".join(f"rank {r}" for r in range(args.nproc))
    print(f"| mode | layers | draft parameters | {ranks_head} | with the save |")
    print("|---|---|---|" + "---|" * (args.nproc + 1))
    for mode, layers, ranks in rows:
        print(
            f"| {mode} | {layers} | {params[layers]:,} | "
            + " | ".join(f"{r['state']:,.0f} / {r['train']:,.0f}" for r in ranks)
            + f" | {ranks[0]['end']:,.0f} |"
        )
    if len(args.layers) > 1:
        lo, hi = min(args.layers), max(args.layers)
        added = params[hi] - params[lo]
        for mode in ("ddp", "fsdp"):
            for what, key in (("after the step", "state"), ("at the training peak", "train")):
                mib = {layers: max(r[key] for r in ranks) for m, layers, ranks in rows if m == mode}
                print(
                    f"{mode}: layers {lo} -> {hi} add {added:,} parameters and "
                    f"{mib[hi] - mib[lo]:,.0f} MiB {what} (the largest rank): "
                    f"{(mib[hi] - mib[lo]) * 2**20 / added:.1f} bytes a parameter"
                )


if __name__ == "__main__":
    run(main)
