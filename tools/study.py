"""The study (docs/study.md): what DFlash2's pieces buy. Each arm and seed is one `bash run.sh
[--toy] --epochs E --seed N FLAGS` (the arm's train.py flags, then the others given here)."""

import argparse
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from support.common import UsageError, count, cpu_name, run, run_logged
from support.tracking import read_log

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
ARMS = {
    "dflash2": [],  # the default: convolutions and selector, strict selector CE
    "dflash": ["--dflash"],  # neither: the baseline
    "conv-only": ["--selector-loss-alpha", "0"],  # a frozen fresh selector walks the unary path
    "selector-only": ["--freeze-conv"],  # every convolution stays at its identity
    "replace": ["--selector-miss", "replace"],  # SpecForge's insert-into-candidates form
    "stop-gradient": ["--selector-stop-gradient"],  # the selector CE trains the selector only
    "modelopt": ["--selector-weighting", "uniform", "--selector-miss", "replace"],  # PR #2216
    "kl": ["--loss", "kl"],  # KL to the target's distribution, Speculators' default
    "lk": ["--loss", "lk"],  # ce and tv mixed by the accepted mass, SpecForge's "lambda"
    "dpace": ["--position-weighting", "dpace", "--dpace-alpha", "0.5"],  # Model-Optimizer's
}
DS = ("dflash", "dflash2")  # the arms of the data-size curve (--sizes)
COLUMNS = ["tau_selector", "tau_unary", "lift", "recall", "served_path", "served_fast"]
# allow_abbrev: no train.py flag (--seed) is taken for a study flag it begins (--seeds)
PARSER = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
PARSER.add_argument("--toy", action="store_true", help="run.sh --toy's target and data, 2 epochs")
PARSER.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
PARSER.add_argument("--seeds", type=count, default=3, help="runs per arm")
PARSER.add_argument("--sizes", type=count, nargs="+", default=[], help="dflash(2) on N answers")
PARSER.add_argument("--jobs", type=count, default=2, help="runs at a time, one thread each")
PARSER.add_argument("--out", help="for the runs and study.md (default out/study-toy, out/study)")


def train_once(args, name: str, seed: int, flags: list, home: str) -> dict:
    """One arm and seed by run.sh in OUT/ARM/seedN, unless it has served already -> its numbers."""
    out = os.path.join(args.out, name, f"seed{seed}")
    toy = os.path.join(out, "draft-dflash" if "--dflash" in flags else "draft")
    draft = toy if args.toy else out  # where run.sh trains it
    if done := numbers(draft):
        return done
    os.makedirs(out, exist_ok=True)
    for part in ("target", "data") if args.toy and home != out else ():  # run.sh --toy reuses
        if not os.path.lexists(os.path.join(out, part)):
            os.symlink(os.path.abspath(os.path.join(home, part)), os.path.join(out, part))
    cmd = ["bash", "run.sh", *["--toy"] * args.toy, "--epochs", "2" if args.toy else "1"]
    cmd += ["--seed", str(seed), *args.train, *flags]
    env = {"OUT": out, **({"OMP_NUM_THREADS": "1"} if args.jobs > 1 else {})}
    run_logged(cmd, os.path.join(out, "run.log"), f"OUT={out} run.sh", env, cwd=HERE)
    return numbers(draft)


def numbers(draft: str):
    """A run's log.jsonl -> its final and served records' numbers, or None before it has served."""
    try:
        last = {r["kind"]: r for r in read_log(draft)[1]}  # the last record of each kind
    except UsageError:  # no log yet, or one cut off mid-line
        return None
    if not {"final", "served"} <= last.keys():
        return None
    f, s = last["final"], last["served"]
    sel, unary = f.get("accept_selector"), f["accept_unary"]  # lift: the selector's over unary
    got = [sel, unary, sel and sel / unary, f.get("topk_recall"), s["served_path_tau"]]
    return dict(zip(COLUMNS, got + [s.get("served_auto_tau")]))


def table(results: dict, names: list) -> list:
    """results {arm: [numbers of each seed]} -> markdown rows, one per arm: mean +- sample sd."""
    rows = ["| arm | seeds | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0
    for arm in names:
        got = [[m[c] for m in results[arm] if m[c] is not None] for c in COLUMNS]
        cells = [f"{statistics.mean(v):.3f} +- {sd(v):.3f}" if v else "-" for v in got]
        rows.append(f"| {arm} | {len(results[arm])} | " + " | ".join(cells) + " |")
    return rows


def verdicts(results: dict, arms: list, default: str = "dflash2") -> list:
    """Each arm against the default on the held-out tau of the path it serves (the selector's, or
    the unary one): the means' difference, and whether it passes twice the larger seed sd."""
    taus = lambda arm: [m["tau_selector"] or m["tau_unary"] for m in results[arm]]
    base, out = taus(default) if default in results else [], []
    for arm in [a for a in arms if a != default and min(len(results[a]), len(base)) > 1]:
        diff = statistics.mean(taus(arm)) - statistics.mean(base)
        noise = 2 * max(statistics.stdev(taus(arm)), statistics.stdev(base))
        word = "within noise" if abs(diff) <= noise else ("above" if diff > 0 else "below")
        out += [f"- {arm}: {diff:+.3f} against {default} (twice the spread: {noise:.3f}), {word}"]
    return out


def main(argv=None):
    args, args.train = PARSER.parse_known_args(argv)
    args.out = args.out or ("out/study-toy" if args.toy else "out/study")
    arms = {arm: ARMS[arm] for arm in args.arms}
    # the data-size curve: dflash and dflash2 on the first N training answers
    curve = {f"{a}-{n}": [*ARMS[a], "--num-samples", str(n)] for n in args.sizes for a in DS}
    # seed-major: a study cut short has as many seeds of each arm
    runs = [(name, s, flags) for s in range(args.seeds) for name, flags in (arms | curve).items()]
    home = os.path.join(args.out, runs[0][0], "seed0")  # the toy's target and data: its run's
    done = [train_once(args, *runs[0], home)]  # alone: it makes the data the others read
    with ThreadPoolExecutor(args.jobs) as pool:
        done += pool.map(lambda r: train_once(args, *r, home), runs[1:])
    results = {name: [m for (n, _, _), m in zip(runs, done) if n == name] for name in arms | curve}
    gpu = f" with one {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    argv = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"`python -m tools.study {argv}` on {cpu_name()}{gpu}, torch {torch.__version__}", ""]
    lines += [*table(results, arms), "", "Each arm against the default:", ""]
    lines += [*verdicts(results, arms), "", *(table(results, curve) if curve else [])]
    with open(os.path.join(args.out, "study.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    run(main)
