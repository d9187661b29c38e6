"""The GPU path in one command: the CUDA tests, then the training-step rows README.md marks "not
measured".

    # on a CUDA GPU: within 8 minutes on one H100 / H200
    python tools/gpu_check.py out/gpu-check
    # only the rows a first run did not reach
    python tools/gpu_check.py out/gpu-check2 --no-tests --modes compile
    # the same plumbing on the CPU at toy sizes, seconds
    python tools/gpu_check.py out/dry --dry-run

1. The CUDA tests of test_all.py (every test with "cuda" in its name or parameter id; on a CPU
   they skip): compiled flex vs sdpa, an online bf16 step vs the CPU's fp32 step and --compile vs
   eager, a torchrun + nccl run that resumes exactly and logs MFU, greedy generate.py vs
   transformers' generate.
2. One training step (tools/train_cost.py --part step: forward, objective, backward; bf16
   autocast; random weights and conversations, every token supervised) for each S in --lengths,
   attention in --attention and mode in --modes, in this order: every eager row, then every
   compiled one. Each row runs in a fresh process (a failed compile or an out-of-memory stays in
   its row; the peak memory is the row's own): --warmup untimed steps (they compile), then
   --repeats timed ones, median. tokens/s and MFU are per GPU: one process on one GPU.

Bounds: the tests get --tests-timeout-s, each row --row-timeout-s, all of it --budget-s; a row that
no longer fits is listed as not reached. Written, and rewritten after each part: OUT/results.json
(environment, tests, rows), OUT/summary.txt (the same with a table to paste into README.md),
OUT/tests.log (pytest's output), OUT/rows.log (each row's command and output). Needs only what the
GPU image has (torch, transformers, safetensors, tqdm, pytest).
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's modules
import config  # noqa: E402
import flops  # noqa: E402
from common import bounded, run, write_json  # noqa: E402

# --dry-run changes these defaults (a flag given still wins) and shrinks --draft-config's widths
# (toy_config)
DRY_RUN = dict(lengths="64,96", num_anchors=8, num_layers=2, warmup=1, repeats=1)
# every CUDA test has "cuda" in its name or parameter id; -v shows each as it ends, so a timeout
# still says where
TESTS = [
    sys.executable,
    "-m",
    "pytest",
    "-v",
    "-rs",
    "--durations=10",
    "-p",
    "no:cacheprovider",
    "test_all.py",
    "-k",
    "cuda",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    a = p.add_argument
    a("out_dir", help="folder for results.json, summary.txt, tests.log and rows.log")
    a(
        "--dry-run",
        action="store_true",
        help="on the CPU (also where a GPU is) at toy sizes: "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in DRY_RUN.items())
        + ", hidden 64, 4 / 2 heads of 16, vocabulary 256; no flex or compiled rows",
    )
    a("--draft-config", default=os.path.join(ROOT, "configs", "qwen3-8b-dflash2.json"))
    a("--num-layers", type=bounded(int, low=1), default=None, help="default: the config's")
    a("--block-size", type=bounded(int, low=2), default=16)
    a(
        "--lengths",
        default="2048,8192",
        help="S, tokens per row, comma-separated: one row set per S",
    )
    a("--num-anchors", type=bounded(int, low=1), default=512, help="per row")
    a("--batch-size", type=bounded(int, low=1), default=1, help="rows of S tokens per step")
    a("--attention", default="sdpa,flex", help="comma-separated: sdpa, flex")
    a(
        "--modes",
        default="eager,compile",
        help="comma-separated: eager, compile (train.py --compile)",
    )
    a(
        "--warmup",
        type=bounded(int, low=0),
        default=2,
        help="untimed steps per row first (they compile)",
    )
    a(
        "--repeats",
        type=bounded(int, low=1),
        default=3,
        help="timed steps per row; the median is reported",
    )
    a(
        "--peak-tflops",
        type=bounded(float, above=0.0),
        default=None,
        help="the GPU's dense bf16 peak behind MFU; default: flops.PEAK_TFLOPS by device name",
    )
    a("--no-tests", action="store_true", help="measure only")
    a("--tests-timeout-s", type=bounded(float, above=0.0), default=270.0)
    a("--row-timeout-s", type=bounded(float, above=0.0), default=150.0)
    a(
        "--budget-s",
        type=bounded(float, above=0.0),
        default=450.0,
        help="for everything; the check stops starting rows once it is spent",
    )
    if p.parse_known_args(argv)[0].dry_run:
        p.set_defaults(**DRY_RUN)
    args = p.parse_args(argv)
    args.lengths = int_list("--lengths", args.lengths)
    for flag, allowed in (("attention", ("sdpa", "flex")), ("modes", ("eager", "compile"))):
        names = [n for n in getattr(args, flag).split(",") if n]
        bad = [n for n in names if n not in allowed] or ([] if names else ["(none)"])
        if bad:
            raise ValueError(f"--{flag}: {', '.join(bad)} is not one of {', '.join(allowed)}")
        setattr(args, flag, names)
    return args


def int_list(flag: str, text: str) -> list:
    try:
        values = [int(n) for n in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: comma-separated token counts, got {text!r}") from None
    if min(values) < 2:
        raise ValueError(f"{flag}: a row needs 2 tokens or more, got {text!r}")
    return values


def toy_config(path: str, out: str) -> str:
    """--dry-run: the draft config at toy widths, every other field (layers, layout, block rules) as
    it was."""
    c = config.load_config(path)
    widths = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        mask_token_id=255,
    )
    if c.dflash2:
        widths.update(
            conv_group_size=16, selector_rank=16, selector_top_k=min(c.selector_top_k, 16)
        )
    write_json(out, config.config_to_dict(dataclasses.replace(c, **widths)))
    return out


# ----------------------------------------------------------------------------- running bounded
def run_bounded(cmd: list, timeout: float):
    """-> (exit status, or None if it ran past timeout, seconds, output). The command gets a process
    group of its own, so a timeout also ends what it started (torchrun's ranks, the compiler's
    workers)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}  # nothing here downloads
    if not torch.cuda.is_available():
        env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()
    with subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return None, time.monotonic() - t0, out
    return proc.returncode, time.monotonic() - t0, out


def run_tests(timeout: float) -> tuple:
    """pytest on the CUDA tests -> (record, its output)."""
    status, seconds, out = run_bounded(TESTS, timeout)
    last = next(
        (
            line.strip(" =")
            for line in reversed(out.splitlines())
            if re.search(r"\d+ (passed|failed|skipped|error|deselected)", line)
        ),
        "no summary line",
    )
    counts = {
        k if k != "errors" else "error": int(n)
        for n, k in re.findall(
            r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", last
        )
    }
    record = {
        "command": "python " + " ".join(TESTS[1:]),
        "exit_status": status,
        "seconds": round(seconds, 1),
        "summary": last if status is not None else f"timed out after {timeout:.0f} s",
        "counts": counts,
    }
    return record, out


def row_command(
    args, cfg_path: str, layers: int, S: int, how: str, mode: str, json_path: str
) -> list:
    cmd = [
        sys.executable,
        os.path.join("tools", "train_cost.py"),
        "--part",
        "step",
        "--dtype",
        "bf16",
        "--draft-config",
        cfg_path,
        "--num-layers",
        str(layers),
        "--block-size",
        str(args.block_size),
        "--lengths",
        ",".join([str(S)] * args.batch_size),
        "--num-anchors",
        str(args.num_anchors),
        "--attention",
        how,
        "--warmup",
        str(args.warmup),
        "--repeats",
        str(args.repeats),
        "--json",
        json_path,
    ]
    return (
        cmd
        + (["--compile"] if mode == "compile" else [])
        + (["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else [])
    )


def why_not(args, how: str, mode: str, cuda: bool):
    """Why a row cannot run here, or None."""
    if how == "flex" and not cuda:
        return "FlexAttention has no backward on the CPU (torch 2.13)"
    if mode == "compile" and args.dry_run:
        return "--dry-run: compiling the draft with its backward takes minutes on a CPU"
    return None


# ----------------------------------------------------------------------------- what is written
def environment(cuda: bool, peak_tflops) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    with open("/proc/cpuinfo") as f:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            platform.machine(),
        )
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "device": "cpu",
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        peak = flops.peak_flops(torch.device("cuda"), peak_tflops)
        env.update(
            device=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            peak_tflops=peak and peak / 1e12,
        )
    return env


def summary(results: dict) -> str:
    e, a, t = results["environment"], results["args"], results["tests"]
    gpu = (
        f"{e['device']} ({e['gpu_memory_gib']} GiB, {e['multiprocessors']} SMs, bf16 peak "
        f"{e['peak_tflops'] or 'unknown'} TFLOP/s)"
        if e["device"] != "cpu"
        else "no GPU"
    )
    lines = [
        f"GPU check, {e['date']}: {gpu}; torch {e['torch']} (CUDA {e['cuda']}), transformers "
        f"{e['transformers']}, triton {e['triton']}, Python {e['python']}; CPU {e['cpu']} "
        f"({e['cpu_count']} threads)"
    ]
    if a["dry_run"]:
        lines.append(
            "DRY RUN on the CPU at toy sizes: the plumbing only; these numbers say nothing about "
            "a GPU."
        )
    lines.append(
        f"CUDA tests: {t['summary']}"
        + (
            f"; exit status {t['exit_status']}; {t['command']}, output in tests.log"
            if "command" in t
            else ""
        )
    )
    draft = (
        os.path.relpath(a["draft_config"], ROOT)
        if a["draft_config"].startswith(ROOT)
        else a["draft_config"]
    )
    lines += [
        "\nOne training step (tools/train_cost.py --part step, bf16 autocast): "
        f"{draft}{' at toy widths' if a['dry_run'] else ''}, {results['num_layers']} layers, block "
        f"{a['block_size']}, {a['num_anchors']} anchors a row, {a['batch_size']} row(s) of S "
        f"tokens; median of {a['repeats']} timed steps after {a['warmup']} warm-up; tokens/s and "
        "MFU per GPU; peak memory of the timed steps (a GPU's allocated, a CPU's resident)\n",
        "| S | attention | mode | step (s) | tokens/s | anchors/s | MFU | peak memory (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        head = f"| {r['row_tokens']} | {r['attention']} | {r['mode']} |"
        if r["status"] != "measured":
            lines.append(f"{head} {r['status']}: {r['reason']} | | | | |")
            continue
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.3f}"
        lines.append(
            f"{head} {r['seconds']:.3f} | {r['tokens_per_s']:.0f} | {r['anchors_per_s']:.1f} | "
            f"{mfu} | {r['peak_memory_gib']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def save(out_dir: str, results: dict):
    write_json(os.path.join(out_dir, "results.json"), results)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(summary(results))


# ----------------------------------------------------------------------------- main
def measure(args, results: dict, cfg_path: str, cuda: bool, left, tmp: str):
    """Every row of the plan, in order, each in a fresh process; results are saved after each."""
    plan = [(S, how, mode) for mode in args.modes for S in args.lengths for how in args.attention]
    with open(os.path.join(args.out_dir, "rows.log"), "w") as log:
        for i, (S, how, mode) in enumerate(plan):
            row = {
                "row_tokens": S,
                "attention": how,
                "mode": mode,
                "status": "skipped",
                "reason": why_not(args, how, mode, cuda),
            }
            spent = f"the --budget-s of {args.budget_s:.0f} s ran out"
            if row["reason"] is None and left() < 10:
                row.update(status="not reached", reason=spent)
            elif row["reason"] is None:
                json_path = os.path.join(tmp, f"row{i}.json")
                cmd = row_command(args, cfg_path, results["num_layers"], S, how, mode, json_path)
                limit = min(args.row_timeout_s, left())
                status, seconds, out = run_bounded(cmd, limit)
                log.write(f"$ {' '.join(cmd)}\n{out}\n")
                log.flush()
                row.update(command=" ".join(cmd[1:]), wall_s=round(seconds, 1))
                last = (out.strip().splitlines() or ["no output"])[-1][-200:]
                if status == 0:
                    with open(json_path) as f:
                        row.update(json.load(f), status="measured", reason=None)
                elif status is None and limit < args.row_timeout_s:
                    row.update(
                        status="not reached", reason=f"{spent} after {limit:.0f} s of the row"
                    )
                else:
                    row.update(
                        status="failed",
                        reason=f"timed out after {limit:.0f} s"
                        if status is None
                        else f"exit status {status}: {last}",
                    )
            print(
                f"  S {S}, {how}, {mode}: "
                + (
                    f"{row['tokens_per_s']:.0f} tokens/s, peak {row['peak_memory_gib']:.2f} GiB"
                    if row["status"] == "measured"
                    else f"{row['status']}: {row['reason']}"
                ),
                flush=True,
            )
            results["rows"].append(row)
            save(args.out_dir, results)


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:  # the CPU, also on a GPU machine: its tests and rows too
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        raise ValueError("no CUDA GPU here: run with --dry-run to check the plumbing on the CPU")
    start = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - start)
    os.makedirs(args.out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        cfg_path = os.path.abspath(args.draft_config)
        if args.dry_run:
            cfg_path = toy_config(cfg_path, os.path.join(tmp, "toy-draft.json"))
        results = {
            "environment": environment(cuda, args.peak_tflops),
            "args": vars(args),
            "num_layers": args.num_layers or config.load_config(cfg_path).num_hidden_layers,
            "tests": {"summary": "not run (--no-tests)"},
            "rows": [],
        }
        print(summary(results).splitlines()[0], flush=True)
        if not args.no_tests:
            print(
                f"CUDA tests: python {' '.join(TESTS[1:])} (at most "
                f"{min(args.tests_timeout_s, left()):.0f} s)",
                flush=True,
            )
            results["tests"], out = run_tests(min(args.tests_timeout_s, left()))
            with open(os.path.join(args.out_dir, "tests.log"), "w") as f:
                f.write(out)
            print(f"  {results['tests']['summary']}", flush=True)
            save(args.out_dir, results)
        measure(args, results, cfg_path, cuda, left, tmp)
    save(args.out_dir, results)
    print(
        f"wrote {args.out_dir}/summary.txt and results.json in {time.monotonic() - start:.0f} s",
        flush=True,
    )
    tests_ok = args.no_tests or results["tests"]["exit_status"] == 0
    sys.exit(0 if tests_ok and not any(r["status"] == "failed" for r in results["rows"]) else 1)


if __name__ == "__main__":
    run(main)
