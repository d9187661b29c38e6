"""The GPU path in one call of at most 9 minutes on one H100 / H200, from a cold compile cache:
a. train.py at the Qwen3-8B draft's shape, b. train.py compiled as run.sh runs it, c. decoding as
generate.py --bench does, d. every CUDA test; each bounded by its share, on random weights
(docs/training-at-scale.md, "GPU check"). OUT/results.json and summary.txt are rewritten as each
item ends and whatever ends the check; rows.log and tests.log keep the output.

    python -m tools.gpu_check out/gpu-check                  # on a CUDA GPU: the whole plan
    python -m tools.gpu_check out/dry --dry-run              # the plumbing on the CPU, b skipped
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import model
from compat import config_json as config
from speed import bench, tune
from support import distributed, features, flops
from support.common import UsageError, cpu_name, last_line, recipe, run, write_json
from support.tracking import read_log

# the repository: the configs' home, and where the items' commands run (train.py, -m tools...)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (item, planned seconds) in the order they run; they add up to the budget, 9 minutes.
PLAN = [("train", 150), ("compile", 80), ("decode", 40), ("tests", 270)]
BUDGET_S = sum(s for _, s in PLAN)
# item a: the Qwen3-8B draft's config; items b and c: run.sh's main job's, with its recipe flags
BIG, SMALL = "configs/qwen3-8b-dflash2.json", "configs/smollm2-135m-dflash2.json"
CONFIGS = {"train": BIG, "compile": SMALL, "decode": SMALL}
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
# every CUDA test has "cuda" in its name or id; -v shows each as it ends: a timeout says where
TESTS = [sys.executable, "-m", "pytest", "-v", "-rfs", "--durations=10", "-p", "no:cacheprovider"]
TESTS += ["-k", "cuda"]  # every test file (pyproject.toml's testpaths)
INTERRUPT_S = 15  # a run past its bound: Ctrl-C, then this long to say so before it is killed
OOM = re.compile(r"OutOfMemoryError|out of memory", re.IGNORECASE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.formatter_class, a = argparse.RawDescriptionHelpFormatter, p.add_argument
    a("out_dir", help="folder for results.json, summary.txt, tests.log and rows.log")
    a("--dry-run", action="store_true", help="on the CPU (also where a GPU is) at toy widths")
    a("--decode-run", metavar="CONFIG", help=argparse.SUPPRESS)  # item c's own process
    args = p.parse_args(argv)
    args.sizes = SIZES["dry" if args.dry_run else "gpu"]
    return args


def toy_config(path: str, out: str) -> str:
    """--dry-run: the draft config at toy widths, every other field (layers, layout) as it was."""
    c = config.load_config(path)
    widths = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16)
    widths.update(num_key_value_heads=2, vocab_size=256, mask_token_id=255)
    if c.dflash2:
        k = min(c.selector_top_k, 16)
        widths.update(conv_group_size=16, selector_rank=16, selector_top_k=k)
    write_json(out, config.config_to_dict(dataclasses.replace(c, **widths)))
    return out


# ----------------------------------------------------------------------------- running bounded
def run_bounded(cmd: list, share: float, env=None) -> tuple:
    """cmd in a process group of its own (a timeout also ends torchrun's ranks, the compiler's
    workers) -> (exit status, or None if it ran past, seconds, output, peak GiB or None on a CPU).
    The peak is polled from here: it counts the run's CUDA context and allocator's reserve."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cuda = torch.cuda.is_available()
    if not cuda:
        env.setdefault("OMP_NUM_THREADS", "1")
    # the GPU memory the run uses: what it takes from the free memory at its start
    t0, free, peak = time.monotonic(), cuda and torch.cuda.mem_get_info()[0], 0
    with tempfile.TemporaryFile("w+", errors="replace") as out:
        # a job started in the background (nohup ... &) ignores Ctrl-C, and its children with it:
        # the run gets Python's own handler back, so that the Ctrl-C below reaches it
        sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
        kw = dict(cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=sigint)
        proc = subprocess.Popen(cmd, **kw, start_new_session=True)
        try:
            while proc.poll() is None and time.monotonic() - t0 < max(share - INTERRUPT_S, 1):
                peak = max(peak, free - torch.cuda.mem_get_info()[0]) if cuda else 0
                time.sleep(0.2)
            status = proc.poll()
            if status is None:  # Ctrl-C first: pytest then says what failed, Python where it was
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(INTERRUPT_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        except BaseException:  # Ctrl-C or SIGTERM here: the run's processes go too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        out.seek(0)
        text = out.read()
    return status, time.monotonic() - t0, text, round(peak / 2**30, 2) if cuda else None


def outcome(status, out: str, share: float) -> tuple:
    """A bounded run -> (status, reason): measured, out of memory (reported, not a failure),
    timed out, or failed, with the last line that says why."""
    if status == 0:
        return "measured", None
    if OOM.search(out):
        return "out of memory", next(line for line in out.splitlines() if OOM.search(line))[-300:]
    if status is None:
        return "timed out", f"its share of {share:.0f} s ran out"
    return "failed", f"exit status {status}: {last_line(out)}"


def bounded_row(cmd: list, share: float, log, env=None) -> tuple:
    """cmd run within its share, its output kept in rows.log -> (row, output)."""
    status, seconds, out, peak = run_bounded(cmd, share, env)
    settings = "".join(f"{k}={v} " for k, v in (env or {}).items())
    log.write(f"$ {settings}{' '.join(cmd)}\n{out}\n")
    log.flush()
    state, reason = outcome(status, out, share)
    row = {"command": " ".join(cmd[1:]), "status": state, "reason": reason}
    return row | {"wall_s": round(seconds, 1), "peak_gib": peak}, out


# ----------------------------------------------------------------------------- items a and b
def target_config(c) -> LlamaConfig:
    """A Llama target of draft config c's widths and layers, its head tied as c says."""
    same = "vocab_size hidden_size intermediate_size num_attention_heads num_key_value_heads"
    kw = {k: getattr(c, k) for k in same.split() + ["head_dim", "tie_word_embeddings"]}
    return LlamaConfig(num_hidden_layers=c.num_target_layers, **kw)


def make_train_data(cfg_path: str, out: str, lengths: tuple, rows: int) -> tuple:
    """A random bf16 target's embedding, norm and head (offline training builds no decoder layer)
    and one feature shard as prepare.py writes it -> (target dir, feature dir)."""
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
    # each row's features a slice of one random block: the values do not matter, the bytes read do
    block = torch.randn(high, len(c.target_layer_ids) * c.hidden_size, generator=g).bfloat16()
    samples = []
    for _ in range(rows):
        n = int(torch.randint(low, high + 1, (), generator=g))
        mask = (torch.arange(n) >= n // 10).long()  # the first tenth a prompt
        ids = torch.randint(0, c.vocab_size - 1, (n,), generator=g)
        samples.append({"input_ids": ids, "loss_mask": mask, "features": block[:n].clone()})
    os.makedirs(feat_dir)
    settings = features.shard_settings(c.target_layer_ids, "bf16", high, False, rows, {})
    counts = dict(zip(features.COUNTS, (rows, 0, 0)))  # none skipped
    features.save_shard(features.shard_path(feat_dir, 0), samples, {**settings, **counts})
    features.write_manifest(feat_dir, rows, rows, "random", c.hidden_size)
    return target_dir, feat_dir


def train_command(name: str, args, cfg_path, target_dir, feat_dir, out_dir) -> list:
    """Item a: the README's GPU command at one rank (torchrun; no --compile, no evaluation). Item b:
    run.sh's, its recipe flags and --compile auto. Both log every step and save only at the end."""
    if name == "train":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
        cmd += ["train.py", "--num-anchors", str(args.sizes["anchors"]), "--eval-samples", "0"]
        cmd += ["--max-length", str(args.sizes["lengths"][1])]
    else:
        cmd = [sys.executable, "train.py", *MAIN_JOB, "--compile", "auto"]
        cmd += ["--eval-data", feat_dir, "--eval-samples", "4"]
    cmd += ["--draft-config", cfg_path, "--target", target_dir, "--data", feat_dir]
    cmd += ["--out-dir", out_dir, "--max-steps", str(args.sizes["steps"]), "--log-interval", "1"]
    cmd += ["--eval-interval", "100000", "--save-interval", "100000", "--quiet"]
    # the CPU has no flex backward: the plumbing only
    return cmd + (["--attention", "sdpa"] if args.dry_run else [])


def steady(records: list) -> dict:
    """log.jsonl's train records, one a step -> step 1's seconds (it compiles), then the step time
    after the warm-up (never from the loop's start), per INTERVAL too, and train.py's rates."""
    steps = [r for r in records if r.get("kind") == "train"]
    if not steps:
        raise ValueError("log.jsonl: no train records")
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


def train_row(args, name: str, tmp: str, share: float, log) -> dict:
    """Items a and b: make the item's data, run train.py, read its log."""
    t0 = time.monotonic()
    lengths = args.sizes["lengths" if name == "train" else "main_lengths"]
    made = make_train_data(args.configs[name], f"{tmp}/data-{name}", lengths, args.sizes["rows"])
    data_s, out_dir = time.monotonic() - t0, os.path.join(tmp, name)
    cmd = train_command(name, args, args.configs[name], *made, out_dir)
    row, out = bounded_row(cmd, share - data_s, log, {"TORCH_LOGS": "recompiles,graph_breaks"})
    try:
        records, unread = read_log(out_dir)[1], None
    except UsageError as e:  # no log: train.py ended before its first step (killed, or refused)
        records, unread = [], str(e)
    row.update(
        data_s=round(data_s, 1),
        steps_done=sum(r.get("kind") == "train" for r in records),
        recompiles=out.count("Recompiling function"),
        graph_breaks=out.count("Graph break"),
        error_line=next((line for line in out.splitlines() if line.startswith("error:")), None),
    )
    if row["status"] == "measured":
        try:
            row.update(steady(records))
        except ValueError as e:
            row.update(status="failed", reason=unread or str(e))
    shutil.rmtree(out_dir, ignore_errors=True)  # its ckpt.pt: 14 GB at the 8B shape
    return row


# ----------------------------------------------------------------------------- item c
def decode_run(args):
    """Item c in its own process (out_dir: the JSON it writes): generate.py --bench's decoding on
    random weights, plainly and on the selector's path and tree of B-1."""
    device = distributed.rank_device()
    c = config.load_config(args.decode_run)
    torch.manual_seed(0)
    target = LlamaForCausalLM(target_config(c)).to(device, torch.float32).eval()  # lossless: fp32
    draft = model.DraftModel(c).to(device).eval()  # as trained: fp32
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


def decode_row(args, tmp: str, share: float, log) -> dict:
    json_path = os.path.join(tmp, "decode.json")
    cmd = [sys.executable, "-m", "tools.gpu_check", json_path, "--decode-run"]
    row, _ = bounded_row(cmd + [args.configs["decode"]] + ["--dry-run"] * args.dry_run, share, log)
    if row["status"] == "measured":
        with open(json_path) as f:
            row.update(json.load(f))
        # plain decoding is the reference: its same is None
        same = lambda w: w["same"] in (None, row["prompts"])
        unequal = [w["mode"] + " " + w["verify"] for w in row["ways"] if not same(w)]
        if unequal:
            row.update(status="failed", reason=f"greedy output differs from plain: {unequal}")
    return row


# ----------------------------------------------------------------------------- what is written
def environment() -> dict:
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    env = dict(date=now, python=sys.version.split()[0], torch=torch.__version__)
    env.update(cuda=torch.version.cuda, transformers=transformers.__version__, device="cpu")
    env["cpu"] = cpu_name()  # with its core count
    env["triton"] = version("triton") if importlib.util.find_spec("triton") else None
    if torch.cuda.is_available():
        props, peak = torch.cuda.get_device_properties(0), flops.peak_flops(torch.device("cuda"))
        env.update(device=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
        env["peak_tflops"] = peak and peak / 1e12
    return env


def item_line(name: str, t: dict) -> str:
    """An item's record in one line: its fields, then decoding's ways."""
    fields = [f"{k} {v}" for k, v in t.items() if k not in ("command", "ways") and v is not None]
    way = lambda w: (
        f"{w['mode']} {w['verify']}".strip() + f" tau {w['tau']:.2f}, {w['tok_s']:.1f} tokens/s"
    )
    ways = [way(w) for w in t.get("ways", [])]
    return f"{name}: " + "; ".join(fields + ways)


def summary(results: dict) -> str:
    e, plan = results["environment"], ", ".join(f"{n} {s} s" for n, s in PLAN)
    lines = [", ".join(f"{k} {v}" for k, v in e.items()), f"plan, {BUDGET_S} s: {plan}"]
    if results["args"]["dry_run"]:
        lines.append("DRY RUN on the CPU at toy widths: the plumbing only, no GPU numbers.")
    if results.get("stopped"):
        lines.append(f"STOPPED: {results['stopped']}")
    lines += ["", *(item_line(name, t) for name, t in results["items"].items())]
    return "\n".join(lines) + "\n"


def save(out_dir: str, results: dict):
    write_json(os.path.join(out_dir, "results.json"), results)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(summary(results))


# ----------------------------------------------------------------------------- main
def run_item(name, args, tmp, share, log) -> dict:
    if name == "compile" and args.dry_run:
        why = "--dry-run: a CPU compiles the backward for minutes; its command is tested"
        return {"status": "skipped", "reason": why}
    if name in ("train", "compile"):
        return train_row(args, name, tmp, share, log)
    if name == "decode":
        return decode_row(args, tmp, share, log)
    return tests_row(args, share)


def tests_row(args, share: float) -> dict:
    """Item d: every CUDA test in one pytest run, its output in tests.log."""
    with open(os.path.join(args.out_dir, "tests.log"), "w") as log:
        row, out = bounded_row(TESTS, share, log)
    counted = r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)"
    lines = [line.strip(" =") for line in out.splitlines() if re.search(counted, line)]
    row["summary"] = lines[-1] if lines else "no summary line"
    row["counts"] = {k: int(n) for n, k in re.findall(counted, row["summary"])}
    row["failed"] = sorted(set(re.findall(r"::(\S+) FAILED", out)))
    if row["status"] == "out of memory":  # a CUDA test that runs out of memory fails
        row["status"] = "failed"
    return row


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:  # the CPU, also on a GPU machine: its tests and rows too
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.decode_run:
        return decode_run(args)
    if not torch.cuda.is_available() and not args.dry_run:
        raise UsageError("no CUDA GPU here: run with --dry-run to check the plumbing on the CPU")
    # a SIGTERM (a job's timeout) ends the check through the finally below, as Ctrl-C does
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.monotonic()
    os.makedirs(args.out_dir, exist_ok=True)
    results = dict(environment=environment(), args=vars(args), plan=PLAN, items={}, stopped=None)
    # items a and b write 3.6 GB of data and a 14 GB ckpt.pt: to memory where a GPU's host has room
    roomy = not args.dry_run and shutil.disk_usage("/dev/shm").free > 40 * 2**30
    with tempfile.TemporaryDirectory(prefix="gpu-check-", dir="/dev/shm" if roomy else None) as tmp:
        args.configs = {n: os.path.join(ROOT, path) for n, path in CONFIGS.items()}
        if args.dry_run:
            for n, path in args.configs.items():
                args.configs[n] = toy_config(path, os.path.join(tmp, f"toy-{n}.json"))
        print(summary(results), end="", flush=True)
        try:
            with open(os.path.join(args.out_dir, "rows.log"), "w") as log:
                for name, share in PLAN:
                    left = BUDGET_S - (time.monotonic() - start)
                    # the last item, and a dry run's (a loaded CPU is no GPU), get all that is left
                    share = left if name == PLAN[-1][0] or args.dry_run else min(share, left)
                    if share < 10:
                        results["items"][name] = {"status": "not reached", "reason": "no budget"}
                        continue
                    print(f"{name}: at most {share:.0f} s", flush=True)
                    results["items"][name] = run_item(name, args, tmp, share, log)
                    save(args.out_dir, results)  # on disk before the next item starts
                    print("  " + summary(results).splitlines()[-1], flush=True)
        except BaseException as e:
            results["stopped"] = f"{type(e).__name__}: {e}"
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            save(args.out_dir, results)
            took = time.monotonic() - start
            print(f"wrote {args.out_dir}/summary.txt and results.json in {took:.0f} s", flush=True)
    # out of memory, skipped and not reached do not fail the check
    failed = [r for r in results["items"].values() if r["status"] in ("failed", "timed out")]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    run(main)
