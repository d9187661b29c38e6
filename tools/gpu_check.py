"""The GPU path in one call of at most 9 minutes on one H100 / H200, from a cold compile cache:
train.py at the Qwen3-8B draft's shape first, the CUDA tests last.

    python -m tools.gpu_check out/gpu-check                  # on a CUDA GPU: the whole plan
    python -m tools.gpu_check out/gpu-check2 --only tests    # one item again
    python -m tools.gpu_check out/dry --dry-run              # the plan, and the plumbing on the CPU

The plan (PLAN), in this order, each item in a fresh process group bounded by its share of
--budget-s (a run past it gets Ctrl-C INTERRUPT_S before its share ends, then is killed):

a. train     train.py itself, the README's default GPU path: torchrun at one rank (nccl), bf16
             autocast, flex attention compiled alone, no --compile, --data-workers 0; offline, on
             configs/qwen3-8b-dflash2.json against a random target's embedding and head (no decoder
             layer is written: offline training reads none) and random bf16 features in the
             feature-shard format, rows of --lengths tokens (one static-shape bucket). Step 1
             compiles; the steady step time is read per interval of log.jsonl's records, after
             WARM_STEPS; tokens/s and MFU are train.py's own (per interval); peak GPU memory is
             polled from this process (allocator's reservation + CUDA context).
b. compile   the same with --compile, the draft cut to --compile-layers layers: the whole 5-layer
             draft did not compile in 120 s (the first run), so it cannot in this item's share.
c. decode    decoding on the GPU: a random SmolLM2-135M-shaped target (fp32, the lossless rule)
             and a random draft of configs/smollm2-135m-dflash2.json, through
             support.show.speculate (the cycles generate.py and tools/served.py run): a path of
             B-1 and a tree of B-1 nodes against plain decoding (decoding.target_generate): greedy
             output equal, tau and tokens/s. Random weights: tau here measures the loop, not a
             trained draft.
d. tests     every CUDA test (a "cuda" in its name or parameter id) of every test file, one pytest
             run, with what is left of the budget.

SHARES says where each share comes from. An out-of-memory item is reported, not failed; an item its
share cut off says how far it got. Each item's result is appended to OUT/rows.jsonl the moment it
ends, and OUT/results.json and OUT/summary.txt are rewritten then and whatever ends the check (an
error, Ctrl-C, SIGTERM). OUT/rows.log and OUT/tests.log keep each command's output. --dry-run: the
same plumbing on the CPU at toy widths in a couple of minutes (b skipped: a CPU compiles the draft's
backward for minutes). Needs only what a GPU image has (torch, transformers, safetensors, pytest).
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

try:
    import triton
except ImportError:  # a CPU machine
    triton = None

import model
from compat import config_json as config
from decoding import target_generate
from support import features, flops
from support.common import bounded, cpu_name, run, write_json
from support.show import speculate
from support.target import check_draft_fits
from support.tracking import read_log

# the repository: the configs' home, and where the items' commands run (train.py, -m tools...)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (item, planned seconds) in the order they run; they add up to --budget-s, 9 minutes.
PLAN = [("train", 150), ("compile", 80), ("decode", 40), ("tests", 270)]
BUDGET_S = sum(s for _, s in PLAN)
# where each share comes from (docs/training-at-scale.md's three H200 runs, torch 2.11 + CUDA 13.0)
SHARES = {
    "train": "the 8B flex step alone did not finish in 60 s (first run's eager row, ~10 s of it "
    "the draft's build); the rest unmeasured: making 3.6 GB of target and features, 32 steps near "
    "the sdpa row's 0.218 s, the last step's 14 GB checkpoint",
    "compile": "the 5-layer --compile step did not finish in 120 s (first run): 1 layer, by "
    "arithmetic about a fifth of its inlined layers, + the process's start",
    "decode": "no GPU record, an allowance: a process's start (~15 s), a random 135M target and "
    "draft, 3 ways x 4 prompts of 128 tokens",
    "tests": "the first run reached the nccl test after 162 s and that test took 104 s alone "
    "(third run): 162 + 104 = 266 s from a cold cache",
}
# --dry-run changes these defaults (a flag given still wins) and shrinks both configs' widths
DRY_RUN = dict(lengths="40,64", rows=6, num_anchors=8, train_steps=6, decode_tokens=24)
DRY_RUN.update(decode_prompts=2)
WARM_STEPS = 2  # steps left out of the steady time: step 1 compiles, step 2 may still tune
INTERVAL = 10  # steps per interval of the steady time (log.jsonl's elapsed_s is at 0.1 s)
# every CUDA test has "cuda" in its name or parameter id; -v shows each as it ends, so a timeout
# still says where
TESTS = [sys.executable, "-m", "pytest", "-v", "-rfs", "--durations=10", "-p", "no:cacheprovider"]
TESTS += ["-k", "cuda"]  # every test file (pyproject.toml's testpaths)
INTERRUPT_S = 15  # a run past its bound: Ctrl-C, then this long to say so before it is killed
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|out of memory", re.IGNORECASE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    a = p.add_argument
    a("out_dir", help="folder for rows.jsonl, results.json, summary.txt, tests.log and rows.log")
    a(
        "--dry-run",
        action="store_true",
        help="on the CPU (also where a GPU is) at toy widths: "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in DRY_RUN.items())
        + "; sdpa, nothing compiled",
    )
    a("--only", default=",".join(n for n, _ in PLAN), help="comma-separated items of the plan")
    a("--draft-config", default=os.path.join(ROOT, "configs", "qwen3-8b-dflash2.json"))
    a("--lengths", default="3072,4096", help="items a, b: rows of LOW..HIGH tokens, uniform")
    a("--rows", type=bounded(int, low=2), default=8, help="items a, b: rows in the feature shard")
    a("--num-anchors", type=bounded(int, low=1), default=512, help="items a, b: per row")
    a("--train-steps", type=bounded(int, low=3), default=32, help="items a, b: optimizer steps")
    a("--compile-layers", type=bounded(int, low=1), default=1, help="item b: the draft's layers")
    a("--decode-config", default=os.path.join(ROOT, "configs", "smollm2-135m-dflash2.json"))
    a("--decode-tokens", type=bounded(int, low=2), default=128, help="item c: tokens a prompt")
    a("--decode-prompts", type=bounded(int, low=1), default=4, help="item c: random prompts")
    a(
        "--peak-tflops",
        type=bounded(float, above=0.0),
        default=None,
        help="the GPU's dense bf16 peak behind MFU; default: flops.PEAK_TFLOPS by device name",
    )
    a("--budget-s", type=bounded(float, above=0.0), default=float(BUDGET_S), help="for everything")
    a("--decode-run", action="store_true", help=argparse.SUPPRESS)  # item c's own process
    if p.parse_known_args(argv)[0].dry_run:
        p.set_defaults(**DRY_RUN)
    args = p.parse_args(argv)
    names = [n for n, _ in PLAN]
    args.only = [n for n in args.only.split(",") if n]
    bad = [n for n in args.only if n not in names] or ([] if args.only else ["(none)"])
    if bad:
        raise ValueError(f"--only: {', '.join(bad)} is not one of {', '.join(names)}")
    low, _, high = args.lengths.partition(",")
    if not (low.isdigit() and high.isdigit() and 2 <= int(low) <= int(high)):
        raise ValueError(f"--lengths: LOW,HIGH with 2 <= LOW <= HIGH, got {args.lengths}")
    args.band = (int(low), int(high))
    return args


def plan(args) -> list:
    """[(item, share in seconds)] of the items asked for, in PLAN's order, the shares scaled to
    --budget-s."""
    chosen = [(n, s) for n, s in PLAN if n in args.only]
    scale = args.budget_s / sum(s for _, s in chosen)
    return [(n, s * scale) for n, s in chosen]


def toy_config(path: str, out: str) -> str:
    """--dry-run: a draft config at toy widths, every other field (layers, layout, block rules) as
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
class PeakMemory:
    """The GPU's memory in use, polled from this process while a row runs (`with PeakMemory() as
    m:`): m.gib, the peak above what was in use before, or None on a CPU. It counts the row's CUDA
    context and its allocator's reservation, so it reads above torch.cuda.max_memory_allocated."""

    def __init__(self):
        self.gib, self.cuda = None, torch.cuda.is_available()

    def __enter__(self):
        if self.cuda:
            self.base, self.peak, self.done = self.used(), 0, threading.Event()
            self.thread = threading.Thread(target=self.poll, daemon=True)
            self.thread.start()
        return self

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def poll(self):
        while not self.done.wait(0.2):
            self.peak = max(self.peak, self.used() - self.base)

    def __exit__(self, *exc):
        if self.cuda:
            self.done.set()
            self.thread.join()
            self.gib = round(self.peak / 2**30, 2)


def run_bounded(cmd: list, timeout: float, env=None):
    """-> (exit status, or None if it ran past timeout, seconds, output). The command gets a process
    group of its own, so a timeout also ends what it started (torchrun's ranks, the compiler's
    workers, the DataLoader's)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
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
        # a job started in the background (nohup ... &) ignores Ctrl-C, and its children with it:
        # give the row Python's own handler back, so that the Ctrl-C below reaches it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            # Ctrl-C first: pytest then prints what failed and why, a Python row where it was
            os.killpg(proc.pid, signal.SIGINT)
            try:
                out, _ = proc.communicate(timeout=INTERRUPT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            return None, time.monotonic() - t0, out
        except BaseException:  # Ctrl-C or SIGTERM: the row's processes go too
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return proc.returncode, time.monotonic() - t0, out


def bound(share: float) -> float:
    """The seconds a row runs before its Ctrl-C: its share, less the time to say why."""
    return max(share - INTERRUPT_S, 1)


def outcome(status, out: str, limit: float) -> tuple:
    """A bounded run -> (status, reason): measured, out of memory (reported, not a failure),
    timed out (its share ran out), or failed, with the last line that says why."""
    last = next((line for line in reversed(out.strip().splitlines()) if line.strip()), "no output")[
        -300:
    ]
    if status == 0:
        return "measured", None
    if OOM.search(out):
        return "out of memory", next(line for line in out.splitlines() if OOM.search(line))[-300:]
    if status is None:
        return "timed out", f"its share of {limit:.0f} s ran out"
    return "failed", f"exit status {status}: {last}"


def run_tests(timeout: float) -> tuple:
    """pytest on the CUDA tests -> (record, its output)."""
    status, seconds, out = run_bounded(TESTS, bound(timeout))
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
        "item": "tests",
        "command": "python " + " ".join(TESTS[1:]),
        "exit_status": status,
        "seconds": round(seconds, 1),
        "summary": last if status is not None else f"timed out after {timeout:.0f} s",
        "passed_before": re.findall(r"::(\S+) PASSED", out),
        "failed": sorted(set(re.findall(r"::(\S+) FAILED", out))),
        "counts": counts,
    }
    return record, out


# ----------------------------------------------------------------------------- items a and b
def target_config(c, tied: bool) -> LlamaConfig:
    """A Llama target of draft config c's widths and num_target_layers; tied: one embedding and head
    (SmolLM2's), untied as Qwen3-8B's."""
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_target_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        tie_word_embeddings=tied,
    )


def make_train_data(cfg_path: str, out: str, args) -> tuple:
    """A random target of the draft config's shape, embedding, final norm and head only (bf16,
    untied as Qwen3-8B's; config.json counts its num_target_layers: offline training builds no
    decoder layer, support/target.load_target) with a one-token tokenizer, and a feature shard of
    --rows random rows of --lengths tokens, bf16 features of the config's target layers, the
    first tenth of each row unsupervised. -> (target dir, feature dir)."""
    c = config.load_config(cfg_path)
    target_dir, feat_dir = os.path.join(out, "target"), os.path.join(out, "features")
    target_config(c, tied=False).save_pretrained(target_dir)
    g = torch.Generator().manual_seed(0)
    weight = lambda: (torch.randn(c.vocab_size, c.hidden_size, generator=g) * 0.02).bfloat16()
    weights = {"model.embed_tokens.weight": weight(), "lm_head.weight": weight()}
    weights["model.norm.weight"] = torch.ones(c.hidden_size, dtype=torch.bfloat16)
    save_file(weights, os.path.join(target_dir, "model.safetensors"), metadata={"format": "pt"})
    unk = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=unk, unk_token="<unk>").save_pretrained(target_dir)
    low, high = args.band
    width = len(c.target_layer_ids) * c.hidden_size
    # one random block of features, each row a copy of a slice of it: the values do not matter,
    # the bytes read per token do
    block = torch.randn(high, width, generator=g).bfloat16()
    samples = []
    for _ in range(args.rows):
        n = int(torch.randint(low, high + 1, (), generator=g))
        mask = torch.ones(n, dtype=torch.long)
        mask[: n // 10] = 0
        ids = torch.randint(0, c.vocab_size - 1, (n,), generator=g)
        samples.append({"input_ids": ids, "loss_mask": mask, "features": block[:n].clone()})
    os.makedirs(feat_dir)
    # one shard as prepare.py --features writes it: its settings, then its counts (none skipped)
    settings = features.shard_settings(c.target_layer_ids, "bf16", high, False, len(samples), {})
    counts = dict(zip(features.COUNTS, (len(samples), 0, 0)))
    features.save_shard(features.shard_path(feat_dir, 0), samples, {**settings, **counts})
    features.write_manifest(feat_dir, len(samples), len(samples), "random", c.hidden_size)
    return target_dir, feat_dir


def train_command(args, cfg_path, target_dir, feat_dir, out_dir, compiled=False) -> list:
    """The README's GPU command at one rank: torchrun, attention auto (flex), dtype auto (bf16),
    no --compile, --data-workers 0; every step logged, no evaluation, no checkpoint but the last."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd += ["train.py", "--draft-config", cfg_path, "--target", target_dir, "--data", feat_dir]
    cmd += ["--out-dir", out_dir, "--max-steps", str(args.train_steps), "--log-interval", "1"]
    cmd += ["--eval-interval", "100000", "--save-interval", "100000", "--eval-samples", "0"]
    cmd += ["--num-anchors", str(args.num_anchors), "--max-length", str(args.band[1]), "--quiet"]
    cmd += ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []
    cmd += ["--compile", "--num-layers", str(args.compile_layers)] if compiled else []
    # the CPU has no flex backward: the plumbing only
    return cmd + (["--attention", "sdpa"] if args.dry_run else [])


def first(record: dict, *names):
    """The first of names a log record has (the log's field names have changed before)."""
    return next((record[n] for n in names if record.get(n) is not None), None)


def steady(records: list, band: tuple, rows_per_step: int = 1) -> dict:
    """log.jsonl's train records (one a step) -> step 1's seconds (it compiles), the steady step
    time over the steps after WARM_STEPS (that span's seconds / its steps: per interval, never
    from the loop's start) and per INTERVAL steps, tokens/s and MFU (train.py's rates: the median
    over the span). Rates that cannot be per interval (tokens a step outside the rows' band)
    are dropped with a note, tokens/s then from the band's middle. Raises ValueError naming what
    is missing."""
    steps = [r for r in records if r.get("kind") == "train"]
    if not steps or any("step" not in r or "elapsed_s" not in r for r in steps):
        raise ValueError("log.jsonl: no train records with step and elapsed_s")
    if [r["step"] for r in steps] != list(range(1, len(steps) + 1)):
        raise ValueError("log.jsonl: train records are not one a step (--log-interval 1)")
    span = steps[WARM_STEPS - 1 :]  # the record ending the warm-up starts the span
    n = span[-1]["step"] - span[0]["step"]
    if n < 1:
        raise ValueError(f"log.jsonl: {len(steps)} steps, none after the {WARM_STEPS} warm-up")
    step_s = (span[-1]["elapsed_s"] - span[0]["elapsed_s"]) / n  # the whole span's
    if step_s <= 0:
        raise ValueError(f"log.jsonl: {n} steps in 0 s of elapsed_s, below the log's resolution")
    marks = span[::INTERVAL]
    per_step = lambda a, b: (b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"])
    intervals = [per_step(a, b) for a, b in zip(marks, marks[1:])]
    out = {
        "compile_s": round(steps[0]["elapsed_s"] - step_s, 1),
        "steady_steps": n,
        "step_s": round(step_s, 4),
        "interval_step_s": [round(t, 3) for t in intervals],
        "rates_note": None,
    }
    tok = [first(r, "target_tok_per_s", "tokens_per_s", "tok_per_s") for r in span[1:]]
    mfu = [r.get("mfu") for r in span[1:]]
    low, high = band[0] * rows_per_step, band[1] * rows_per_step
    tokens = statistics.median(tok) * step_s if None not in tok else None  # a step's
    if tokens is not None and 0.7 * low <= tokens <= 1.3 * high:
        out["tokens_per_s"] = round(statistics.median(tok))
        out["mfu"] = statistics.median(mfu) if None not in mfu else None
    else:
        out["tokens_per_s"] = round((low + high) / 2 / step_s)
        out["mfu"] = None
        out["rates_note"] = (
            "log.jsonl's tokens/s are not per interval (cumulative from the loop's start?): "
            "tokens/s from the rows' mean length, no MFU"
        )
    return out


def train_row(args, name: str, tmp: str, limit: float, log) -> dict:
    """Items a and b: make the data (once), run train.py under torchrun, read its log."""
    t0 = time.monotonic()
    made = os.path.join(tmp, "data")
    if not os.path.isdir(made):
        make_train_data(args.draft, made, args)
    data_s = time.monotonic() - t0
    out_dir = os.path.join(tmp, name)
    compiled = name == "compile"
    layers = args.compile_layers if compiled else config.load_config(args.draft).num_hidden_layers
    target_dir, feat_dir = os.path.join(made, "target"), os.path.join(made, "features")
    cmd = train_command(args, args.draft, target_dir, feat_dir, out_dir, compiled)
    env = {"TORCH_LOGS": "recompiles,graph_breaks"}
    with PeakMemory() as memory:
        status, seconds, out = run_bounded(cmd, bound(limit - data_s), env)
    log.write(f"$ TORCH_LOGS={env['TORCH_LOGS']} {' '.join(cmd)}\n{out}\n")
    log.flush()
    state, reason = outcome(status, out, limit)
    try:
        records, unread = read_log(out_dir)[1], None
    except ValueError as e:  # no log: train.py ended before its first step (killed, or refused)
        records, unread = [], str(e)
    row = {
        "command": " ".join(cmd[3:]),
        "layers": layers,
        "status": state,
        "reason": reason,
        "data_s": round(data_s, 1),
        "wall_s": round(seconds, 1),
        "steps_done": sum(r.get("kind") == "train" for r in records),
        "peak_gib": memory.gib,
        "recompiles": len(re.findall(r"Recompiling function", out)),
        "graph_breaks": len(re.findall(r"Graph break", out)),
        "error_line": next((line for line in out.splitlines() if line.startswith("error:")), None),
    }
    if state == "measured":
        try:
            row.update(steady(records, args.band))
        except ValueError as e:
            row.update(status="failed", reason=unread or str(e))
    shutil.rmtree(out_dir, ignore_errors=True)  # its ckpt.pt: 14 GB at the 8B shape
    return row


# ----------------------------------------------------------------------------- item c
def decode_run(args):
    """Item c in its own process (--decode-run; out_dir is the JSON to write): plain, path and
    tree decoding of random prompts, timed after one warm-up each."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    c = config.load_config(args.decode_config)
    torch.manual_seed(0)
    target = LlamaForCausalLM(target_config(c, tied=True))
    target = target.to(device, torch.float32).eval()  # fp32: the lossless rule
    draft = model.DraftModel(c).to(device).eval()  # as trained: fp32
    check_draft_fits(c, target)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, c.mask_token_id, (1, 32), generator=g).to(device)
        for _ in range(args.decode_prompts)
    ]
    B, n = c.block_size, args.decode_tokens
    ways = {
        "plain": lambda p, k: (target_generate(target, p, k)[0], None),
        "path": lambda p, k: speculate(target, draft, p, k, ("path", B - 1)),
        "tree": lambda p, k: speculate(target, draft, p, k, ("tree", B - 1)),
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    rows, outputs = {}, {}
    with torch.no_grad():
        for way, decode in ways.items():
            decode(prompts[0], 8)  # warm-up: kernels, the allocator
            sync()
            t0, taus, tokens, outputs[way] = time.perf_counter(), [], 0, []
            for p in prompts:
                ids, stats = decode(p, n)
                outputs[way].append(ids[0].tolist())
                tokens += ids.shape[1] - p.shape[1]
                taus += stats.taus if stats else []
            sync()
            seconds = time.perf_counter() - t0
            rows[way] = {
                "tokens_per_s": round(tokens / seconds, 1),
                "tau": round(sum(taus) / len(taus), 3) if taus else 1.0,
                "equal_to_plain": outputs[way] == outputs["plain"],
            }
    write_json(args.out_dir, {"device": str(device), "block_size": B, "ways": rows})


def decode_row(args, tmp: str, limit: float, log) -> dict:
    json_path = os.path.join(tmp, "decode.json")
    cmd = [sys.executable, "-m", "tools.gpu_check", json_path, "--decode-run"]
    cmd += ["--decode-config", args.decode_cfg, "--decode-tokens", str(args.decode_tokens)]
    cmd += ["--decode-prompts", str(args.decode_prompts)]
    status, seconds, out = run_bounded(cmd, bound(limit))
    log.write(f"$ {' '.join(cmd)}\n{out}\n")
    log.flush()
    state, reason = outcome(status, out, limit)
    row = {"command": " ".join(cmd[1:]), "status": state, "reason": reason}
    row["wall_s"] = round(seconds, 1)
    if state == "measured":
        with open(json_path) as f:
            row.update(json.load(f))
        unequal = [w for w, r in row["ways"].items() if not r["equal_to_plain"]]
        if unequal:
            row.update(status="failed", reason=f"greedy output differs from plain: {unequal}")
    return row


# ----------------------------------------------------------------------------- what is written
def environment(cuda: bool, peak_tflops) -> dict:
    dynamo = torch._dynamo.config
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton and triton.__version__,
        "cpu": cpu_name(),  # with its core count
        "device": "cpu",
        # what train.py's recompile guard sets (both are torch's since 2.6)
        "dynamo_configs": {
            k: hasattr(dynamo, k) for k in ("recompile_limit", "fail_on_recompile_limit_hit")
        },
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        peak = flops.peak_flops(torch.device("cuda"), peak_tflops)
        env.update(
            device=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            peak_tflops=peak and peak / 1e12,
            cudnn=torch.backends.cudnn.version(),
        )
    return env


def plan_lines(results: dict) -> list:
    """The plan as printed and kept: each item, its share and where the share comes from."""
    total = sum(s for _, s in results["plan"])
    lines = [f"plan, {total:.0f} s of the {results['args']['budget_s']:.0f} s budget, in order:"]
    for i, (name, share) in enumerate(results["plan"]):
        lines.append(f"  {'abcd'[i]}. {name:8s} {share:4.0f} s  ({SHARES[name]})")
    return lines


def train_line(name: str, t: dict, a: dict) -> str:
    what = {
        "train": f"train.py, {os.path.basename(a['draft_config'])}, torchrun 1 rank, flex alone",
        "compile": f"train.py --compile, {t.get('layers')} layer(s) of the draft",
    }[name]
    head = f"{what}: {t['status']}" + (f" ({t['reason']})" if t.get("reason") else "")
    if "step_s" not in t:
        return head + f"; {t.get('steps_done', 0)} steps logged"
    note = f"; {t['rates_note']}" if t["rates_note"] else ""
    mfu = "-" if t["mfu"] is None else f"{t['mfu']:.3f}"
    peak = "-" if t["peak_gib"] is None else f"{t['peak_gib']} GiB"
    return (
        f"{head}; step 1 (compiling) {t['compile_s']} s; steady {t['step_s']} s a step over "
        f"{t['steady_steps']} steps (intervals of {INTERVAL}: {t['interval_step_s']}), "
        f"{t['tokens_per_s']} tokens/s, MFU {mfu}, peak GPU memory {peak}, "
        f"{t['recompiles']} recompiles, {t['graph_breaks']} graph breaks; data made in "
        f"{t['data_s']} s, train.py ran {t['wall_s']} s{note}"
    )


def summary(results: dict) -> str:
    e, a = results["environment"], results["args"]
    gpu = (
        f"{e['device']} ({e['gpu_memory_gib']} GiB, {e['multiprocessors']} SMs, bf16 peak "
        f"{e['peak_tflops'] or 'unknown'} TFLOP/s)"
        if e["device"] != "cpu"
        else "no GPU"
    )
    lines = [
        f"GPU check, {e['date']}: {gpu}; torch {e['torch']} (CUDA {e['cuda']}), transformers "
        f"{e['transformers']}, triton {e['triton']}, Python {e['python']}; CPU {e['cpu']}",
        *plan_lines(results),
    ]
    if a["dry_run"]:
        lines.append(
            "DRY RUN on the CPU at toy widths: the plumbing only; these numbers say nothing about "
            "a GPU."
        )
    if results.get("stopped"):
        lines.append(f"STOPPED: {results['stopped']}")
    lines.append("")
    for name, t in results["items"].items():
        if name in ("train", "compile") and "steps_done" in t:
            lines.append(train_line(name, t, a))
        elif name == "decode" and "ways" in t:
            ways = "; ".join(
                f"{w} tau {r['tau']}, {r['tokens_per_s']} tokens/s"
                + ("" if r["equal_to_plain"] else ", NOT EQUAL to plain")
                for w, r in t["ways"].items()
            )
            lines.append(f"decoding on {t['device']} (random weights, B {t['block_size']}): {ways}")
        elif name == "tests" and "summary" in t:
            lines.append(
                f"CUDA tests: {t['summary']}"
                + (f"; failed: {', '.join(t['failed'])}" if t.get("failed") else "")
                + f"; exit status {t['exit_status']}; {t['command']}"
            )
        else:
            lines.append(f"{name}: {t['status']}" + (f" ({t['reason']})" if t["reason"] else ""))
    return "\n".join(lines) + "\n"


def save(out_dir: str, results: dict):
    write_json(os.path.join(out_dir, "results.json"), results)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(summary(results))


def finish(out_dir: str, results: dict, name: str, record: dict):
    """An item ended: its row appended to rows.jsonl at once, the results and summary rewritten."""
    results["items"][name] = record
    with open(os.path.join(out_dir, "rows.jsonl"), "a") as f:
        f.write(json.dumps({"item": name, **record}) + "\n")
    save(out_dir, results)


# ----------------------------------------------------------------------------- main
def run_item(name, args, tmp, limit, log) -> dict:
    if name in ("train", "compile"):
        if name == "compile" and args.dry_run:
            why = "--dry-run: a CPU compiles the backward for minutes; item a's command + --compile"
            return {"status": "skipped", "reason": why}
        return train_row(args, name, tmp, limit, log)
    if name == "decode":
        return decode_row(args, tmp, limit, log)
    record, out = run_tests(limit)
    with open(os.path.join(args.out_dir, "tests.log"), "w") as f:
        f.write(out)
    return record


def failed(record: dict) -> bool:
    """A failed row or test, or one its share cut off: the check says so in its exit status. Out of
    memory, skipped and not reached do not fail it."""
    if "exit_status" in record:  # the tests
        return record["exit_status"] != 0
    return record["status"] in ("failed", "timed out")


def scratch() -> str:
    """Where items a and b write (3.6 GB of data, a 14 GB ckpt.pt): memory where it has room."""
    shm = "/dev/shm"
    roomy = os.path.isdir(shm) and shutil.disk_usage(shm).free > 40 * 2**30
    return shm if roomy and torch.cuda.is_available() else None


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:  # the CPU, also on a GPU machine: its tests and rows too
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.decode_run:
        return decode_run(args)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        raise ValueError("no CUDA GPU here: run with --dry-run to check the plumbing on the CPU")
    # a SIGTERM (a job's timeout) ends the check through the finally below, as Ctrl-C does
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - start)
    os.makedirs(args.out_dir, exist_ok=True)
    if os.path.exists(os.path.join(args.out_dir, "rows.jsonl")):
        os.remove(os.path.join(args.out_dir, "rows.jsonl"))
    results = {"environment": environment(cuda, args.peak_tflops), "args": vars(args)}
    results.update(plan=plan(args), items={}, stopped=None)
    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir=scratch()) as tmp:
        args.draft, args.decode_cfg = os.path.abspath(args.draft_config), args.decode_config
        if args.dry_run:
            args.draft = toy_config(args.draft, os.path.join(tmp, "toy-draft.json"))
            args.decode_cfg = toy_config(args.decode_cfg, os.path.join(tmp, "toy-decode.json"))
        print("\n".join(summary(results).splitlines()[:-1]), flush=True)
        try:
            with open(os.path.join(args.out_dir, "rows.log"), "w") as log:
                for i, (name, share) in enumerate(results["plan"]):
                    last = i == len(results["plan"]) - 1
                    # a dry run's items are bounded by what is left: a loaded CPU is no GPU
                    limit = left() if last or args.dry_run else min(share, left())
                    if limit < min(10, share):
                        skip = {"status": "not reached", "reason": "no budget"}
                        finish(args.out_dir, results, name, skip)
                        continue
                    print(f"{name}: at most {limit:.0f} s", flush=True)
                    record = run_item(name, args, tmp, limit, log)
                    finish(args.out_dir, results, name, record)
                    print("  " + summary(results).splitlines()[-1], flush=True)
        except BaseException as e:
            results["stopped"] = f"{type(e).__name__}: {e}"
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            save(args.out_dir, results)
            print(
                f"wrote {args.out_dir}/summary.txt, results.json and rows.jsonl in "
                f"{time.monotonic() - start:.0f} s",
                flush=True,
            )
    sys.exit(1 if any(failed(r) for r in results["items"].values()) else 0)


if __name__ == "__main__":
    run(main)
