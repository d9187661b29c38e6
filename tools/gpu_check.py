"""The GPU path in one call of at most 9 minutes on one H100 / H200, from a cold compile cache
(docs/training-at-scale.md, "GPU check": what each item runs, and where its share comes from).

    python -m tools.gpu_check out/gpu-check                  # on a CUDA GPU: the whole plan
    python -m tools.gpu_check out/dry --dry-run              # the plan, and the plumbing on the CPU

The plan (PLAN), in this order, each item in a process group of its own, bounded by its share of the
budget (past it: Ctrl-C, INTERRUPT_S to say why, then killed), on random weights made here: a. train
(train.py at the Qwen3-8B draft's shape, the README's default GPU path: torchrun at one rank, bf16,
flex compiled alone), b. compile (train.py as run.sh's main job runs it, with its --compile auto:
compiled on a GPU), c. decode (generate.py --bench's code on the GPU: a path and a tree against
plain decoding), d. tests (every CUDA test). An out-of-memory item is reported, not failed. As each
item ends, and whatever ends the check, OUT/results.json and OUT/summary.txt are rewritten;
OUT/rows.log and OUT/tests.log keep each command's output.
--dry-run: the same plumbing on the CPU at toy widths (b skipped: a CPU compiles the backward for
minutes).
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
from speed import bench, tune
from support import distributed, features, flops
from support.common import UsageError, cpu_name, last_line, recipe, run, write_json
from support.target import check_draft_fits
from support.tracking import read_log

# the repository: the configs' home, and where the items' commands run (train.py, -m tools...)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (item, planned seconds) in the order they run; they add up to the budget, 9 minutes.
PLAN = [("train", 150), ("compile", 80), ("decode", 40), ("tests", 270)]
BUDGET_S = sum(s for _, s in PLAN)
# each item's draft config: item a the Qwen3-8B draft's, items b and c run.sh's main job's
CONFIGS = {
    "train": "configs/qwen3-8b-dflash2.json",
    "compile": "configs/smollm2-135m-dflash2.json",
    "decode": "configs/smollm2-135m-dflash2.json",
}
# the main job's recipe flags, as run.sh gives them to train.py
MAIN_JOB = recipe("main", "train")
# the items' sizes on a GPU and at --dry-run's toy widths: rows of LOW..HIGH tokens in the feature
# shard (item a: the 8B's long rows; item b: a GSM8K question and an answer of at most 160 tokens,
# one static shape), anchors a row (item a), optimizer steps, and item c's prompts and tokens
SIZES = {
    "gpu": dict(lengths=(3072, 4096), main_lengths=(160, 256), rows=8, anchors=512, steps=32),
    "dry": dict(lengths=(40, 64), main_lengths=(40, 64), rows=6, anchors=8, steps=6),
}
SIZES["gpu"].update(decode_prompts=4, decode_tokens=128)
SIZES["dry"].update(decode_prompts=2, decode_tokens=24)
WARM_STEPS = 2  # steps left out of the steady time: step 1 compiles, step 2 may still tune
INTERVAL = 10  # steps per interval of the steady time
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
    a("out_dir", help="folder for results.json, summary.txt, tests.log and rows.log")
    a("--dry-run", action="store_true", help="on the CPU (also where a GPU is) at toy widths")
    a("--decode-run", metavar="CONFIG", help=argparse.SUPPRESS)  # item c's own process
    args = p.parse_args(argv)
    args.sizes = SIZES["dry" if args.dry_run else "gpu"]
    return args


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
    if status == 0:
        return "measured", None
    if OOM.search(out):
        return "out of memory", next(line for line in out.splitlines() if OOM.search(line))[-300:]
    if status is None:
        return "timed out", f"its share of {limit:.0f} s ran out"
    return "failed", f"exit status {status}: {last_line(out)}"


def bounded_row(cmd: list, limit: float, log, env=None) -> tuple:
    """cmd run within limit, its output kept in rows.log -> (status, reason, seconds, output)."""
    status, seconds, out = run_bounded(cmd, bound(limit), env)
    settings = "".join(f"{k}={v} " for k, v in (env or {}).items())
    log.write(f"$ {settings}{' '.join(cmd)}\n{out}\n")
    log.flush()
    return *outcome(status, out, limit), seconds, out


def run_tests(timeout: float) -> tuple:
    """pytest on the CUDA tests -> (record, its output)."""
    status, seconds, out = run_bounded(TESTS, bound(timeout))
    counted = r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)"
    last = next(
        (line.strip(" =") for line in reversed(out.splitlines()) if re.search(counted, line)),
        "no summary line",
    )
    record = {
        "item": "tests",
        "command": "python " + " ".join(TESTS[1:]),
        "exit_status": status,
        "seconds": round(seconds, 1),
        "summary": last if status is not None else f"timed out after {timeout:.0f} s",
        "passed_before": re.findall(r"::(\S+) PASSED", out),
        "failed": sorted(set(re.findall(r"::(\S+) FAILED", out))),
        "counts": {k if k != "errors" else "error": int(n) for n, k in re.findall(counted, last)},
    }
    return record, out


# ----------------------------------------------------------------------------- items a and b
def target_config(c) -> LlamaConfig:
    """A Llama target of draft config c's widths and num_target_layers, its embedding and head tied
    as c says (SmolLM2's are, Qwen3-8B's not)."""
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_target_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        tie_word_embeddings=c.tie_word_embeddings,
    )


def make_train_data(cfg_path: str, out: str, lengths: tuple, rows: int) -> tuple:
    """A random target of the draft config's shape, embedding, final norm and head only (bf16;
    config.json counts its num_target_layers: offline training builds no decoder layer,
    support/target.load_target) with a one-token tokenizer, and a feature shard of `rows` random
    rows of LOW..HIGH tokens, bf16 features of the config's target layers, the first tenth of each
    row unsupervised. -> (target dir, feature dir)."""
    c = config.load_config(cfg_path)
    target_dir, feat_dir = os.path.join(out, "target"), os.path.join(out, "features")
    target_config(c).save_pretrained(target_dir)
    g = torch.Generator().manual_seed(0)
    weight = lambda: (torch.randn(c.vocab_size, c.hidden_size, generator=g) * 0.02).bfloat16()
    weights = {"model.embed_tokens.weight": weight()}
    weights["model.norm.weight"] = torch.ones(c.hidden_size, dtype=torch.bfloat16)
    if not c.tie_word_embeddings:
        weights["lm_head.weight"] = weight()
    save_file(weights, os.path.join(target_dir, "model.safetensors"), metadata={"format": "pt"})
    unk = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=unk, unk_token="<unk>").save_pretrained(target_dir)
    low, high = lengths
    width = len(c.target_layer_ids) * c.hidden_size
    # one random block of features, each row a copy of a slice of it: the values do not matter,
    # the bytes read per token do
    block = torch.randn(high, width, generator=g).bfloat16()
    samples = []
    for _ in range(rows):
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


def train_command(name: str, args, cfg_path, target_dir, feat_dir, out_dir) -> list:
    """Item a: the README's GPU command at one rank (torchrun; attention auto: flex; dtype auto:
    bf16; no --compile, --data-workers 0), no evaluation. Item b: run.sh's train.py command, its
    recipe flags, its --compile auto (compiled on a GPU) and a final evaluation. Both log every
    step and save only at the end."""
    if name == "train":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
        cmd += ["train.py", "--num-anchors", str(args.sizes["anchors"]), "--eval-samples", "0"]
        cmd += ["--max-length", str(args.sizes["lengths"][1])]
    else:
        cmd = [sys.executable, "train.py", *MAIN_JOB, "--compile", "auto"]  # run.sh's: on a GPU, on
        cmd += ["--eval-data", feat_dir, "--eval-samples", "4"]
    cmd += ["--draft-config", cfg_path, "--target", target_dir, "--data", feat_dir]
    cmd += ["--out-dir", out_dir, "--max-steps", str(args.sizes["steps"]), "--log-interval", "1"]
    cmd += ["--eval-interval", "100000", "--save-interval", "100000", "--quiet"]
    # the CPU has no flex backward: the plumbing only
    return cmd + (["--attention", "sdpa"] if args.dry_run else [])


def steady(records: list) -> dict:
    """log.jsonl's train records (one a step) -> step 1's seconds (it compiles), the steady step
    time over the steps after WARM_STEPS (that span's seconds / its steps: never from the loop's
    start) and per INTERVAL steps, and train.py's tokens/s and MFU (per logging interval, here a
    step: their median over the span). Raises ValueError naming what is missing."""
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
    mfu = [r.get("mfu") for r in span[1:]]
    return {
        "compile_s": round(steps[0]["elapsed_s"] - step_s, 1),
        "steady_steps": n,
        "step_s": round(step_s, 4),
        "interval_step_s": [round(per_step(a, b), 3) for a, b in zip(marks, marks[1:])],
        "tokens_per_s": round(statistics.median(r["target_tok_per_s"] for r in span[1:])),
        "mfu": statistics.median(mfu) if None not in mfu else None,
    }


def train_row(args, name: str, tmp: str, limit: float, log) -> dict:
    """Items a and b: make the item's data, run train.py, read its log."""
    t0 = time.monotonic()
    made = os.path.join(tmp, f"data-{name}")
    lengths = args.sizes["lengths" if name == "train" else "main_lengths"]
    make_train_data(args.configs[name], made, lengths, args.sizes["rows"])
    data_s = time.monotonic() - t0
    out_dir = os.path.join(tmp, name)
    target_dir, feat_dir = os.path.join(made, "target"), os.path.join(made, "features")
    cmd = train_command(name, args, args.configs[name], target_dir, feat_dir, out_dir)
    env = {"TORCH_LOGS": "recompiles,graph_breaks"}
    with PeakMemory() as memory:
        state, reason, seconds, out = bounded_row(cmd, limit - data_s, log, env)
    try:
        records, unread = read_log(out_dir)[1], None
    except UsageError as e:  # no log: train.py ended before its first step (killed, or refused)
        records, unread = [], str(e)
    row = {
        "command": " ".join(cmd[1:]),
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
            row.update(steady(records))
        except ValueError as e:
            row.update(status="failed", reason=unread or str(e))
    shutil.rmtree(out_dir, ignore_errors=True)  # its ckpt.pt: 14 GB at the 8B shape
    return row


# ----------------------------------------------------------------------------- item c
def decode_run(args):
    """Item c in its own process (--decode-run CONFIG; out_dir is the JSON to write): random
    prompts decoded by generate.py --bench's code (speed/bench.py) on a random target and draft,
    plainly and on the selector's path and tree of B-1, each timed after one warm-up."""
    device = distributed.rank_device()
    c = config.load_config(args.decode_run)
    torch.manual_seed(0)
    target = LlamaForCausalLM(target_config(c))
    target = target.to(device, torch.float32).eval()  # fp32: the lossless rule
    draft = model.DraftModel(c).to(device).eval()  # as trained: fp32
    check_draft_fits(c, target)
    # generate.py's defaults: the draft as trained, the stock GEMMs
    draft, head, layouts, line = tune.decoding(target, draft, None, None)
    print(line)
    g = torch.Generator().manual_seed(1)
    ids = lambda: torch.randint(0, c.mask_token_id, (1, 32), generator=g).to(device)
    prompts = [ids() for _ in range(args.sizes["decode_prompts"])]
    B, kw = c.block_size, dict(temperature=0.0, generator=None, stop_ids=())
    rows = [("selector", ("path", B - 1)), ("selector", ("tree", B - 1))]
    n = args.sizes["decode_tokens"]
    ways = bench.decode_every_way(target, draft, head, prompts, ids(), n, kw, layouts, rows)
    done = {"device": str(device), "block_size": B, "prompts": len(prompts), "ways": ways}
    write_json(args.out_dir, done)


def decode_row(args, tmp: str, limit: float, log) -> dict:
    json_path = os.path.join(tmp, "decode.json")
    cmd = [sys.executable, "-m", "tools.gpu_check", json_path, "--decode-run"]
    cmd += [args.configs["decode"]] + ["--dry-run"] * args.dry_run
    state, reason, seconds, _ = bounded_row(cmd, limit, log)
    row = {"command": " ".join(cmd[1:]), "status": state, "reason": reason}
    row["wall_s"] = round(seconds, 1)
    if state == "measured":
        with open(json_path) as f:
            row.update(json.load(f))
        unequal = [
            f"{w['mode']} {w['verify']}"
            for w in row["ways"]
            if w["same"] not in (None, row["prompts"])
        ]
        if unequal:
            row.update(status="failed", reason=f"greedy output differs from plain: {unequal}")
    return row


# ----------------------------------------------------------------------------- what is written
def environment(cuda: bool) -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton and triton.__version__,
        "cpu": cpu_name(),  # with its core count
        "device": "cpu",
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        peak = flops.peak_flops(torch.device("cuda"))
        env.update(
            device=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            peak_tflops=peak and peak / 1e12,
            cudnn=torch.backends.cudnn.version(),
        )
    return env


def plan_lines(results: dict) -> list:
    """The plan as printed and kept: each item and its share."""
    total = sum(s for _, s in results["plan"])
    lines = [f"plan, {total:.0f} s of the {BUDGET_S} s budget, in order:"]
    for i, (name, share) in enumerate(results["plan"]):
        lines.append(f"  {'abcd'[i]}. {name:8s} {share:4.0f} s")
    return lines


def train_line(name: str, t: dict) -> str:
    what = {
        "train": f"train.py, {os.path.basename(CONFIGS['train'])}, torchrun 1 rank, flex alone",
        "compile": f"run.sh's train.py --compile, {os.path.basename(CONFIGS['compile'])}",
    }[name]
    head = f"{what}: {t['status']}" + (f" ({t['reason']})" if t.get("reason") else "")
    if "step_s" not in t:
        return head + f"; {t.get('steps_done', 0)} steps logged"
    mfu = "-" if t["mfu"] is None else f"{t['mfu']:.3f}"
    peak = "-" if t["peak_gib"] is None else f"{t['peak_gib']} GiB"
    return (
        f"{head}; step 1 (compiling) {t['compile_s']} s; steady {t['step_s']} s a step over "
        f"{t['steady_steps']} steps (intervals of {INTERVAL}: {t['interval_step_s']}), "
        f"{t['tokens_per_s']} tokens/s, MFU {mfu}, peak GPU memory {peak}, "
        f"{t['recompiles']} recompiles, {t['graph_breaks']} graph breaks; data made in "
        f"{t['data_s']} s, train.py ran {t['wall_s']} s"
    )


def summary(results: dict) -> str:
    e = results["environment"]
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
    if results["args"]["dry_run"]:
        lines.append(
            "DRY RUN on the CPU at toy widths: the plumbing only; these numbers say nothing about "
            "a GPU."
        )
    if results.get("stopped"):
        lines.append(f"STOPPED: {results['stopped']}")
    lines.append("")
    for name, t in results["items"].items():
        if name in ("train", "compile") and "steps_done" in t:
            lines.append(train_line(name, t))
        elif name == "decode" and "ways" in t:
            ways = "; ".join(
                f"{w['mode']} {w['verify']}".strip()
                + f" tau {w['tau']:.2f}, {w['tok_s']:.1f} tokens/s"
                + ("" if w["same"] in (None, t["prompts"]) else ", NOT EQUAL to plain")
                for w in t["ways"]
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
    """An item ended: the results and summary rewritten at once."""
    results["items"][name] = record
    save(out_dir, results)


# ----------------------------------------------------------------------------- main
def run_item(name, args, tmp, limit, log) -> dict:
    if name in ("train", "compile"):
        if name == "compile" and args.dry_run:
            why = "--dry-run: a CPU compiles the backward for minutes; its command is tested"
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
        raise UsageError("no CUDA GPU here: run with --dry-run to check the plumbing on the CPU")
    # a SIGTERM (a job's timeout) ends the check through the finally below, as Ctrl-C does
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.monotonic()
    left = lambda: BUDGET_S - (time.monotonic() - start)
    os.makedirs(args.out_dir, exist_ok=True)
    results = {"environment": environment(cuda), "args": vars(args), "budget_s": BUDGET_S}
    results.update(plan=PLAN, items={}, stopped=None)
    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir=scratch()) as tmp:
        args.configs = {n: os.path.join(ROOT, path) for n, path in CONFIGS.items()}
        if args.dry_run:
            for n, path in args.configs.items():
                args.configs[n] = toy_config(path, os.path.join(tmp, f"toy-{n}.json"))
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
                f"wrote {args.out_dir}/summary.txt and results.json in "
                f"{time.monotonic() - start:.0f} s",
                flush=True,
            )
    sys.exit(1 if any(failed(r) for r in results["items"].values()) else 0)


if __name__ == "__main__":
    run(main)
