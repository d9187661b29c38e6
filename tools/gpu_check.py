"""The GPU path in one command, inside 8 minutes on one H100 / H200: the most valuable rows first,
the CUDA tests last.

    python tools/gpu_check.py out/gpu-check                  # on a CUDA GPU: the whole plan
    python tools/gpu_check.py out/gpu-check2 --only tests    # what a first run did not reach
    python tools/gpu_check.py out/dry --dry-run              # the plumbing on the CPU, toy sizes

The plan (PLAN), in this order, each item in a fresh process bounded by its share of --budget-s:

1. train     train.py itself, offline, on the shipped block-8 config (--train-config) against a
             random target of that config's shape and random bf16 features (made here, no
             download), --compile and flex attention (auto): its DataLoader, static shapes, the
             compiled block mask and flex kernels forward and backward, the recompile guard, as a
             user runs it. Steps alternate between two lengths (two static shapes) and end with an
             evaluation (no-grad variants): median step time of the second half, recompiles and
             graph breaks (TORCH_LOGS), an `error:` line if one ended it.
2. compile   one training step (tools/train_cost.py --part step: train.py's collate, objective and
             backward; the draft built on the CPU and moved, as train.py does) of --draft-config
             (Qwen3-8B-shaped, its own block size 8) at S = --length, flex, --compile: time,
             tokens/s, MFU, peak memory.
3. eager     the same step with only flex compiled (train.py without --compile).
4. sdpa      the same step through --attention sdpa, the fallback: on CUDA k/v heads repeated and
             memory-safe kernels only (kernels.memory_safe_sdpa), so it fits where the math
             kernel would not.
5. tests     the CUDA tests of test_all.py (every test with "cuda" in its name or parameter id),
             with what the rows left of the budget, at least its planned share.

A row that runs out of memory is reported as such, not as a failure; a row cut by its share says how
far it got. OUT/results.json and OUT/summary.txt (a table for docs/training-at-scale.md) are written
after every item and again on the way out, whatever ended the check (an error, Ctrl-C, SIGTERM).
OUT/rows.log and OUT/tests.log keep each command's output. Needs only what the GPU image has
(torch, transformers, safetensors, tqdm, pytest).
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's modules
from compat import config_json as config  # noqa: E402
from support import features, flops  # noqa: E402
from support.common import bounded, run, write_json  # noqa: E402

# (item, planned seconds), most valuable first. The shares add up to the default --budget-s: 8
# minutes. A row gets at most its share; the tests get everything left, at least theirs.
PLAN = [("train", 150), ("compile", 120), ("eager", 60), ("sdpa", 60), ("tests", 90)]
BUDGET_S = sum(s for _, s in PLAN)
# --dry-run changes these defaults (a flag given still wins) and shrinks both configs' widths
DRY_RUN = dict(length=96, num_anchors=8, num_layers=2, train_steps=4, warmup=1, repeats=1)
# every CUDA test has "cuda" in its name or parameter id; -v shows each as it ends, so a timeout
# still says where
TESTS = [sys.executable, "-m", "pytest", "-v", "-rfs", "--durations=10", "-p", "no:cacheprovider"]
TESTS += ["test_all.py", "-k", "cuda"]
INTERRUPT_S = 15  # a run past its bound: Ctrl-C, then this long to say so before it is killed
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|out of memory", re.IGNORECASE)


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
        + ", hidden 64, 4 / 2 heads of 16, vocabulary 256; sdpa, nothing compiled",
    )
    a("--only", default=",".join(n for n, _ in PLAN), help="comma-separated items of the plan")
    a("--train-config", default=os.path.join(ROOT, "configs", "smollm2-135m-dflash2.json"))
    a("--train-steps", type=bounded(int, low=2), default=16, help="optimizer steps of item train")
    a("--draft-config", default=os.path.join(ROOT, "configs", "qwen3-8b-dflash2.json"))
    a("--num-layers", type=bounded(int, low=1), default=None, help="default: the config's")
    a("--length", type=bounded(int, low=2), default=8192, help="S, tokens per row of a step row")
    a("--num-anchors", type=bounded(int, low=1), default=512, help="per row")
    a("--batch-size", type=bounded(int, low=1), default=1, help="rows of S tokens per step")
    a("--warmup", type=bounded(int, low=0), default=2, help="untimed steps per row (they compile)")
    a("--repeats", type=bounded(int, low=1), default=3, help="timed steps per row; the median")
    a(
        "--peak-tflops",
        type=bounded(float, above=0.0),
        default=None,
        help="the GPU's dense bf16 peak behind MFU; default: flops.PEAK_TFLOPS by device name",
    )
    a("--budget-s", type=bounded(float, above=0.0), default=float(BUDGET_S), help="for everything")
    if p.parse_known_args(argv)[0].dry_run:
        p.set_defaults(**DRY_RUN)
    args = p.parse_args(argv)
    names = [n for n, _ in PLAN]
    args.only = [n for n in args.only.split(",") if n]
    bad = [n for n in args.only if n not in names] or ([] if args.only else ["(none)"])
    if bad:
        raise ValueError(f"--only: {', '.join(bad)} is not one of {', '.join(names)}")
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


# ----------------------------------------------------------------------------- item train
def make_train_data(cfg_path: str, out: str, dry_run: bool) -> tuple:
    """A random target of the draft config's shape (config + bf16 weights + a one-token tokenizer:
    offline training reads only its embedding and head) and a feature directory of random bf16
    features: conversations of two length bands (one static shape each), the first tenth of each
    unsupervised. -> (target dir, feature dir)."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    c = config.load_config(cfg_path)
    target_dir, feat_dir = os.path.join(out, "target"), os.path.join(out, "features")
    hf = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_target_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(hf).to(torch.bfloat16).save_pretrained(target_dir)
    unk = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=unk, unk_token="<unk>").save_pretrained(target_dir)
    bands = ((40, 64), (70, 128)) if dry_run else ((1100, 2048), (2100, 4096))
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(24):
        low, high = bands[i % 2]
        n = int(torch.randint(low, high + 1, (), generator=g))
        mask = torch.ones(n, dtype=torch.long)
        mask[: n // 10] = 0
        width = len(c.target_layer_ids) * c.hidden_size
        samples.append(
            {
                "input_ids": torch.randint(0, c.vocab_size - 1, (n,), generator=g),
                "loss_mask": mask,
                "features": torch.randn(n, width, generator=g).bfloat16(),
            }
        )
    os.makedirs(feat_dir)
    settings = {
        "target_layer_ids": json.dumps(c.target_layer_ids),
        "feature_dtype": "bf16",
        "max_length": str(bands[1][1]),
        "target_hidden": "False",
        "shard_size": str(len(samples)),
        "chat_template_kwargs": "{}",
        "num_samples": len(samples),
        "skipped_nonfinite": 0,
        "skipped_no_anchor": 0,
    }
    features.save_shard(features.shard_path(feat_dir, 0), samples, settings)
    features.write_manifest(feat_dir, len(samples), len(samples), "random", c.hidden_size)
    return target_dir, feat_dir


def train_command(args, cfg_path, target_dir, feat_dir, out_dir) -> list:
    cmd = [sys.executable, "train.py", "--draft-config", cfg_path, "--target", target_dir]
    cmd += ["--data", feat_dir, "--out-dir", out_dir, "--max-steps", str(args.train_steps)]
    cmd += ["--log-interval", "1", "--eval-interval", "100000", "--save-interval", "100000"]
    cmd += [
        "--eval-samples",
        "2",
        "--num-anchors",
        str(args.num_anchors),
        "--quiet",
    ]
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    # the CPU has no flex backward and compiles for minutes: the plumbing only
    # on the GPU as users run it: compiled, batches made ahead by two workers into pinned memory
    return cmd + (["--attention", "sdpa"] if args.dry_run else ["--compile", "--data-workers", "2"])


def train_row(args, cfg_path: str, tmp: str, limit: float, log) -> dict:
    """Item train: make the data, run train.py, read its log and the compiler's."""
    t0 = time.monotonic()
    target_dir, feat_dir = make_train_data(cfg_path, os.path.join(tmp, "train"), args.dry_run)
    out_dir = os.path.join(tmp, "train", "out")
    cmd = train_command(args, cfg_path, target_dir, feat_dir, out_dir)
    made = time.monotonic() - t0
    env = {"TORCH_LOGS": "recompiles,graph_breaks"}
    status, seconds, out = run_bounded(cmd, limit - made, env)
    log.write(f"$ TORCH_LOGS={env['TORCH_LOGS']} {' '.join(cmd)}\n{out}\n")
    log.flush()
    state, reason = outcome(status, out, limit)
    path = os.path.join(out_dir, "log.jsonl")
    steps = []
    if os.path.exists(path):
        with open(path) as f:
            steps = [r for r in map(json.loads, f) if r["kind"] == "train"]
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])]
    later = times[len(times) // 2 :]
    return {
        "command": " ".join(cmd[1:]),
        "status": state,
        "reason": reason,
        "data_s": round(made, 1),
        "wall_s": round(seconds, 1),
        "steps_done": len(steps),
        "step_s": round(statistics.median(later), 3) if later else None,
        "mfu": steps[-1].get("mfu") if steps else None,
        "loss": [round(r["loss"], 4) for r in steps],
        "recompiles": len(re.findall(r"Recompiling function", out)),
        "graph_breaks": len(re.findall(r"Graph break", out)),
        "error_line": next((line for line in out.splitlines() if line.startswith("error:")), None),
    }


# ----------------------------------------------------------------------------- the step rows
STEP_ROWS = {"compile": ("flex", True), "eager": ("flex", False), "sdpa": ("sdpa", False)}


def step_command(args, cfg_path: str, how: str, compiled: bool, json_path: str) -> list:
    cmd = [sys.executable, os.path.join("tools", "train_cost.py"), "--part", "step"]
    cmd += ["--dtype", "bf16", "--draft-config", cfg_path, "--num-layers", str(args.layers)]
    cmd += ["--block-size", str(config.load_config(cfg_path).block_size)]
    cmd += ["--lengths", ",".join([str(args.length)] * args.batch_size)]
    cmd += ["--num-anchors", str(args.num_anchors), "--attention", how, "--json", json_path]
    cmd += ["--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    cmd += ["--compile"] if compiled else []
    return cmd + (["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else [])


def why_not(args, how: str, compiled: bool, cuda: bool):
    """Why a step row cannot run here, or None."""
    if how == "flex" and not cuda:
        return "FlexAttention has no backward on the CPU (torch 2.13)"
    if compiled and args.dry_run:
        return "--dry-run: compiling the draft with its backward takes minutes on a CPU"
    return None


def step_row(args, name: str, cfg_path: str, cuda: bool, tmp: str, limit: float, log) -> dict:
    how, compiled = STEP_ROWS[name]
    row = {"attention": how, "compile": compiled, "row_tokens": args.length}
    skip = why_not(args, how, compiled, cuda)
    if skip:
        return {**row, "status": "skipped", "reason": skip}
    json_path = os.path.join(tmp, f"{name}.json")
    cmd = step_command(args, cfg_path, how, compiled, json_path)
    status, seconds, out = run_bounded(cmd, limit)
    log.write(f"$ {' '.join(cmd)}\n{out}\n")
    log.flush()
    state, reason = outcome(status, out, limit)
    row.update(command=" ".join(cmd[1:]), wall_s=round(seconds, 1), status=state, reason=reason)
    if state == "measured":
        with open(json_path) as f:
            row.update(json.load(f))
    return row


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
    dynamo = torch._dynamo.config
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
        f"{e['transformers']}, triton {e['triton']}, Python {e['python']}; CPU {e['cpu']} "
        f"({e['cpu_count']} threads)",
        "plan: "
        + ", ".join(f"{n} {s:.0f} s" for n, s in results["plan"])
        + f" = {sum(s for _, s in results['plan']):.0f} s of the {a['budget_s']:.0f} s budget",
    ]
    if a["dry_run"]:
        lines.append(
            "DRY RUN on the CPU at toy sizes: the plumbing only; these numbers say nothing about "
            "a GPU."
        )
    if results.get("stopped"):
        lines.append(f"STOPPED: {results['stopped']}")
    t = results["items"].get("train")
    if t and "steps_done" not in t:
        lines.append(f"\ntrain.py: {t['status']} ({t['reason']})")
    elif t:
        how = "eager sdpa (dry run)" if a["dry_run"] else "--compile, flex"
        lines.append(
            f"\ntrain.py, {os.path.basename(a['train_config'])}, offline random bf16 features, "
            f"{how}: {t['status']}"
            + (f" ({t['reason']})" if t["reason"] else "")
            + f"; {t['steps_done']} of {a['train_steps']} steps, median step {t['step_s']} s "
            f"(second half), MFU {t['mfu']}, {t['recompiles']} recompiles, "
            f"{t['graph_breaks']} graph breaks, data made in {t['data_s']} s, train.py ran "
            f"{t['wall_s']} s" + (f"; {t['error_line']}" if t["error_line"] else "")
        )
    steps = [(n, results["items"][n]) for n in STEP_ROWS if n in results["items"]]
    if steps:
        draft = os.path.basename(a["draft_config"])
        lines += [
            f"\nOne training step (tools/train_cost.py --part step, bf16 autocast): {draft}"
            f"{' at toy widths' if a['dry_run'] else ''}, {results['num_layers']} layers, "
            f"{a['num_anchors']} anchors a row, {a['batch_size']} row(s) of {a['length']} tokens; "
            f"median of {a['repeats']} timed steps after {a['warmup']} warm-up; tokens/s and MFU "
            "per GPU; peak memory of the timed steps (a GPU's allocated, a CPU's resident)\n",
            "| item | attention | compiled | step (s) | tokens/s | anchors/s | MFU | peak (GiB) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for n, r in steps:
            head = f"| {n} | {STEP_ROWS[n][0]} | {'yes' if STEP_ROWS[n][1] else 'no'} |"
            if r["status"] != "measured":
                lines.append(f"{head} {r['status']}: {r['reason']} | | | | |")
                continue
            mfu = "-" if r["mfu"] is None else f"{r['mfu']:.3f}"
            lines.append(
                f"{head} {r['seconds']:.3f} | {r['tokens_per_s']:.0f} | "
                f"{r['anchors_per_s']:.1f} | {mfu} | {r['peak_memory_gib']:.2f} |"
            )
    t = results["items"].get("tests")
    if t:
        said = t["summary"] if "summary" in t else f"{t['status']} ({t['reason']})"
        lines.append(
            f"\nCUDA tests: {said}"
            + (f"; failed: {', '.join(t['failed'])}" if t.get("failed") else "")
            + (f"; exit status {t['exit_status']}; {t['command']}" if "command" in t else "")
        )
    return "\n".join(lines) + "\n"


def save(out_dir: str, results: dict):
    write_json(os.path.join(out_dir, "results.json"), results)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(summary(results))


# ----------------------------------------------------------------------------- main
def run_item(name, args, results, cuda, tmp, limit, log) -> dict:
    if name == "train":
        cfg = results["train_config"]
        return train_row(args, cfg, tmp, limit, log)
    if name == "tests":
        record, out = run_tests(limit)
        with open(os.path.join(args.out_dir, "tests.log"), "w") as f:
            f.write(out)
        return record
    return step_row(args, name, results["draft_config"], cuda, tmp, limit, log)


def failed(record: dict) -> bool:
    """A failed row or test, or one its share cut off: the check says so in its exit status. Out of
    memory, skipped and not reached do not fail it."""
    if "exit_status" in record:  # the tests
        return record["exit_status"] != 0
    return record["status"] in ("failed", "timed out")


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:  # the CPU, also on a GPU machine: its tests and rows too
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        raise ValueError("no CUDA GPU here: run with --dry-run to check the plumbing on the CPU")
    # a SIGTERM (a job's timeout) ends the check through the finally below, as Ctrl-C does
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.monotonic()
    left = lambda: args.budget_s - (time.monotonic() - start)
    os.makedirs(args.out_dir, exist_ok=True)
    results = {"environment": environment(cuda, args.peak_tflops), "args": vars(args)}
    results.update(plan=plan(args), items={}, stopped=None)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        train_cfg, draft_cfg = os.path.abspath(args.train_config), args.draft_config
        if args.dry_run:
            train_cfg = toy_config(train_cfg, os.path.join(tmp, "toy-train.json"))
            draft_cfg = toy_config(draft_cfg, os.path.join(tmp, "toy-draft.json"))
        args.layers = args.num_layers or config.load_config(draft_cfg).num_hidden_layers
        results.update(train_config=train_cfg, draft_config=draft_cfg, num_layers=args.layers)
        print(summary(results).splitlines()[0] + "\n" + summary(results).splitlines()[1])
        try:
            with open(os.path.join(args.out_dir, "rows.log"), "w") as log:
                for i, (name, share) in enumerate(results["plan"]):
                    last = i == len(results["plan"]) - 1
                    limit = left() if last else min(share, left())
                    if limit < min(10, share):
                        results["items"][name] = {"status": "not reached", "reason": "no budget"}
                        continue
                    print(f"{name}: at most {limit:.0f} s", flush=True)
                    record = run_item(name, args, results, cuda, tmp, limit, log)
                    results["items"][name] = record
                    said = record.get("summary") or f"{record['status']} {record['reason'] or ''}"
                    print(f"  {said}", flush=True)
                    save(args.out_dir, results)
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
