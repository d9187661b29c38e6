"""What DFlash2 buys, measured: its pieces and the selector objective's forms, trained at equal
data and steps from ONE prepared data set, several seeds each (docs/study.md).

    python -m tools.study --quick      # the toy target (run.sh --toy's): 35 runs (the first
                                       # 6 arms' 26 took 7 min on a 2-core Zen 4;
                                       # docs/study-quick.md)
    python -m tools.study --data data/smollm2-math/train --eval-data data/smollm2-math/eval
                                       # the embedded target on the main job's data, 1 epoch
                                       # (the first 6 arms' 18 runs: 2 hours on that Zen 4;
                                       # docs/study.md)
    python -m tools.study ... --arms dflash2 modelopt kl lk    # some arms only

The arms are train.py flags, nothing else changes between them:

    dflash2         the default: convolutions and selector, strict selector CE
    dflash          --dflash: neither (the baseline)
    conv-only       --selector-loss-alpha 0: a frozen fresh selector walks exactly the unary path
    selector-only   --freeze-conv: every convolution stays at its exact identity
    replace         --selector-miss replace: an uncovered label takes the weakest candidate's place
                    (SpecForge's insert-into-candidates form; docs/semantics.md, section 4)
    stop-gradient   --selector-stop-gradient: the selector CE trains the selector only
                    (SpecForge #793)
    modelopt        --selector-weighting uniform --selector-miss replace: NVIDIA Model-Optimizer's
                    selector objective (PR #2216): replace, every slot weighs 1, its own mean
    kl              --loss kl: KL to the target's distribution (Speculators' documented default;
                    the prepared features carry the target's final hidden state for it)
    lk              --loss lk: ce and tv mixed by the accepted mass (SpecForge's lk_loss_type
                    "lambda"; a public Speculators checkpoint trained on CE 0.1 + TV 0.9)
    dpace           --position-weighting dpace: D-PACE's position weights at alpha 0.5 (NVIDIA
                    Model-Optimizer's default since PR #1724; Speculators PR #736)

and a data-size curve: dflash and dflash2 on the first N training answers (--sizes; with --answers
the arms take the first N of a larger set, so the curve can go past them). Per run it
records the held-out teacher-forced tau on the selector and unary paths (train.py's final record),
the candidate recall (label among the top-K), and served tau: the held-out prompts decoded greedily
by the real loop (tools/served.py's serve) on a path of B-1 drafts and on a tree of B-1 nodes.
Per arm: mean +- sd over seeds. A run whose study.json exists is not run again, so a stopped study
goes on where it stopped (--jobs 2: two one-thread runs at a time, each trained, then served).

Writes OUT/study.md (the tables, the machine, the command) and OUT/study.svg (held-out tau against
step, seed 0 of each arm, tools/plot.py); --docs copies both to docs/ (docs/study.md and
docs/figures/study.svg, or study-quick.* with --quick).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm

from support.common import UsageError, bounded, cpu_name, recipe, run
from support.target import load_target, stop_token_ids
from tools import served

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
ARMS = {
    "dflash2": [],
    "dflash": ["--dflash"],
    "conv-only": ["--selector-loss-alpha", "0"],
    "selector-only": ["--freeze-conv"],
    "replace": ["--selector-miss", "replace"],
    "stop-gradient": ["--selector-stop-gradient"],
    "modelopt": ["--selector-weighting", "uniform", "--selector-miss", "replace"],
    "kl": ["--loss", "kl"],
    "lk": ["--loss", "lk"],
    "dpace": ["--position-weighting", "dpace", "--dpace-alpha", "0.5"],
}
TOY_CONFIG = "configs/toy-dflash2.json"


# run.sh --toy's recipe (configs/toy.flags); the study trains it at fewer epochs so that every arm
# fits
TOY_PREPARE, TOY_TRAIN = recipe("toy", "prepare"), recipe("toy", "train")


def python(argv: list, log: str, threads=None) -> None:
    """Run one of the project's commands as a user would, its output appended to log; a failure
    ends the study naming the command and its log."""
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    with open(log, "a") as out:
        done = subprocess.run([sys.executable, *argv], cwd=HERE, env=env, stdout=out, stderr=out)
    if done.returncode != 0:
        command = " ".join(argv[: 2 if argv[0] == "-m" else 1])  # the script, or -m and the tool
        raise RuntimeError(f"python {command} failed (exit {done.returncode}); its output: {log}")


def finished(folder: str) -> bool:
    """Whether train.py ran to its end there (its final record at the checkpoint's step)."""
    try:
        served.read_run(folder)
        return True
    except UsageError:
        return False


def prepare_toy(out: str) -> tuple:
    """The toy target and ONE prepared data set (features captured once) -> (target, train, eval,
    config). Each part is made once and then reused."""
    target, log = os.path.join(out, "target"), os.path.join(out, "prepare.log")
    if not os.path.isdir(target):
        python(["-m", "tools.toy_target", target], log)
    sets = {"train": ("toy", 600), "eval": ("toy-eval", 32)}
    for part, (prompts, n) in sets.items():
        folder = os.path.join(out, "data", part)
        if not os.path.isfile(os.path.join(folder, "manifest.json")):
            argv = ["prepare.py", "--target", target, "--prompts", prompts, "--num-samples", str(n)]
            argv += [*TOY_PREPARE, "--draft-config", TOY_CONFIG]
            python([*argv, "--out-dir", folder], log)
    return target, os.path.join(out, "data", "train"), os.path.join(out, "data", "eval")


def plan(args, answers: int) -> tuple:
    """Every run: (name, arm, seed, answers or None, its train.py flags), and {curve point: the
    arm's run it is}: the arms train on the first --answers of the data (default: all of it); a
    curve point at that size is not trained again where an arm's own seed is that very run (the
    same answers, flags and seed train the same draft)."""
    arm_answers = args.answers or answers
    if arm_answers > answers:
        raise UsageError(f"--answers {arm_answers}: the training data holds {answers} answers")
    first = ["--num-samples", str(arm_answers)] if arm_answers < answers else []
    runs, same = [], {}
    for seed in range(args.seeds):  # seed-major: a study cut short has as many seeds of each arm
        for arm in args.arms:
            runs.append((f"{arm}/seed{seed}", arm, seed, None, [*ARMS[arm], *first]))
    for n in args.sizes:
        if n > answers:
            raise UsageError(f"--sizes {n}: the training data holds {answers} answers")
        for arm in ("dflash", "dflash2"):
            for seed in range(args.size_seeds):
                if n == arm_answers and arm in args.arms and seed < args.seeds:
                    same[f"{arm}-{n}/seed{seed}"] = f"{arm}/seed{seed}"
                else:
                    flags = [*ARMS[arm], "--num-samples", str(n)]
                    runs.append((f"{arm}-{n}/seed{seed}", arm, seed, n, flags))
    return runs, same


def answers_in(data: str) -> int:
    with open(os.path.join(data, "manifest.json")) as f:
        return json.load(f)["num_samples"]


def train_run(args, setup, name, seed, flags) -> str:
    """One arm and seed trained (skipped when its final record is there), then measured in a
    process of its own (skipped when its study.json is there): two runs at a time serve in
    parallel too -> its folder."""
    folder = os.path.join(args.out, name)
    if not finished(folder):
        train_once(args, setup, folder, seed, flags)
    if not os.path.isfile(os.path.join(folder, "study.json")):
        argv = ["-m", "tools.study", "--measure-run", folder, "--prompts", str(args.prompts)]
        python(argv, os.path.join(folder, "measure.log"), threads=args.threads)
    return folder


def train_once(args, setup, folder, seed, flags):
    target, train_data, eval_data, config = setup
    shutil.rmtree(folder, ignore_errors=True)  # a run stopped half-way starts again
    os.makedirs(folder)
    argv = ["train.py", "--draft-config", config, "--data", train_data, "--eval-data", eval_data]
    argv += ["--target", target] if target else []
    argv += ["--epochs", str(args.epochs), "--seed", str(seed), "--quiet"]
    argv += ["--eval-interval", str(args.eval_interval), "--eval-samples", "64"]
    argv += [*args.recipe, *flags, "--out-dir", folder]
    python(argv, os.path.join(folder, "train.log"), threads=args.threads)


def decode_device() -> torch.device:
    """The device train.py trained on (a GPU where there is one, as distributed.start_ranks picks it
    for one process): the study decodes there too."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def measure(folder: str, prompts: int) -> dict:
    """A finished run -> its numbers, also written to its study.json: held-out teacher-forced tau
    (selector and unary paths), candidate recall, and served tau on a path and a tree of B-1
    drafts."""
    args, draft, step, final = served.read_run(folder)
    target, tok = load_target(args.target, torch.float32)
    device = decode_device()  # served taus measured where the run trained
    target, draft = target.to(device), draft.to(device)
    samples = served.held_out(args, tok)[:prompts]
    B, use_selector = draft.config.block_size, draft.candidate_selector is not None
    kw = dict(use_selector=use_selector, stop_ids=stop_token_ids(target, tok))
    path = served.serve(target, draft.eval(), samples, ("path", B - 1), **kw)
    tree = served.serve(target, draft, samples, ("tree", B - 1), **kw)
    m = {
        "step": step,
        "tau_selector": final.get("accept_selector"),
        "tau_unary": final["accept_unary"],
        "recall": final.get("topk_recall"),
        "served_path": path["tau"],
        "served_tree": tree["tau"],
    }
    with open(os.path.join(folder, "study.json"), "w") as f:
        json.dump(m, f)
    return m


def mean_sd(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} +- {sd:.3f}"


def table(results: dict, names: list) -> list:
    """results {run name: numbers} -> markdown rows, one per arm (its seeds pooled)."""
    cols = ["tau_selector", "tau_unary", "lift", "recall", "served_path", "served_tree"]
    rows = ["| arm | seeds | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for arm in names:
        runs = [m for name, m in results.items() if name.split("/")[0] == arm]
        for m in runs:
            sel = m["tau_selector"]
            m["lift"] = sel / m["tau_unary"] if sel is not None else None
        cells = [mean_sd(m[c] for m in runs) for c in cols]
        rows.append(f"| {arm} | {len(runs)} | " + " | ".join(cells) + " |")
    return rows


def verdicts(results: dict, arms: list, default: str = "dflash2") -> list:
    """Each arm against the default, on the held-out tau of the path it serves (the selector's, or
    the unary one where it has none): the difference of the means, and whether it passes twice the
    larger of the two seed spreads (sd). Only an arm past that on both targets may become the
    default (docs/study.md)."""

    def taus(arm):
        runs = [m for name, m in results.items() if name.split("/")[0] == arm]
        return [m["tau_unary"] if m["tau_selector"] is None else m["tau_selector"] for m in runs]

    base = taus(default)
    lines = []
    for arm in arms:
        mine = taus(arm)
        if arm == default or len(mine) < 2 or len(base) < 2:
            continue
        diff = statistics.mean(mine) - statistics.mean(base)
        noise = 2 * max(statistics.stdev(mine), statistics.stdev(base))
        word = "within noise" if abs(diff) <= noise else ("above" if diff > 0 else "below")
        spread = f"twice the spread: {noise:.3f}"
        lines.append(f"- {arm}: {diff:+.3f} against {default} ({spread}), {word}")
    return lines


def machine_name() -> str:
    """Where the runs trained: the CPU, and the GPU where there is one (train.py takes it)."""
    gpu = f" with one {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return cpu_name() + gpu


def page(args, results, spent: list, figure, answers: int) -> str:
    arms = list(args.arms)
    sizes = [f"{arm}-{n}" for n in args.sizes for arm in ("dflash", "dflash2")]
    what = (
        f"The target {args.target}"
        if args.target
        else "The embedded target (SmolLM2-135M-Instruct)"
    )
    what = "The toy target (run.sh --toy's)" if args.quick else what
    lines = [
        f"# The study{' (quick)' if args.quick else ''}: what DFlash2's pieces buy",
        "",
        f"Made by `python -m tools.study {' '.join(args.argv)}` on {machine_name()}, torch "
        f"{torch.__version__}, in {sum(spent) / 60:.1f} min of wall time over {len(spent)} "
        f"invocation(s) (it resumes). {args.note + ' ' if args.note else ''}"
        f"{what}; every arm trained on the same prepared data ({args.answers or answers} "
        f"answers{f' of its {answers}' if args.answers else ''}) for "
        f"{args.epochs} epoch(s), "
        f"{args.seeds} seeds each; served tau over {args.prompts} held-out prompts, greedy.",
        "",
        "tau_selector / tau_unary: held-out accepted length, teacher-forced at random anchors, "
        "on the selector's path and on the unary argmax path (train.py's final record); lift: "
        "their ratio; recall: the share of labels among the top-K candidates; served_path / "
        "served_tree: the real decoding loop's tau on a path of B-1 drafts and a tree of B-1 "
        "nodes (DFlash serves its unary path). Mean +- sd over seeds.",
        "",
        *table(results, arms),
        "",
        "Each arm against the default (held-out tau of the path it serves; an arm becomes the "
        "default only where it is above on both targets):",
        "",
        *verdicts(results, arms),
        "",
    ]
    if args.sizes:
        lines += ["The data-size curve (answers: the first N of the same data):", ""]
        lines += [*table(results, sizes), ""]
    lines += [f"![held-out tau against step, seed 0 of each arm]({figure})", ""]
    return "\n".join(lines)


def add_wall_time(out: str, seconds: float) -> list:
    """This invocation's seconds added to OUT/wall_seconds.json -> the study's wall time so far,
    one entry per invocation that worked on it (it resumes)."""
    path = os.path.join(out, "wall_seconds.json")
    spent = json.load(open(path)) if os.path.isfile(path) else []
    spent.append(round(seconds, 1))
    with open(path, "w") as f:
        json.dump(spent, f)
    return spent


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="the toy target, prepared here")
    p.add_argument("--data", help="prepare.py's training features (not with --quick)")
    p.add_argument("--eval-data", help="prepare.py's held-out features (not with --quick)")
    p.add_argument("--target", default=None, help="the target of --data (default: embedded)")
    p.add_argument("--draft-config", default="configs/smollm2-135m-dflash2.json")
    p.add_argument("--out", help="default: out/study-quick or out/study")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--seeds", type=bounded(int, low=1), default=3, help="per arm")
    p.add_argument("--sizes", type=bounded(int, low=1), nargs="*", default=None, help="answers")
    p.add_argument("--size-seeds", type=bounded(int, low=1), default=2)
    a = "the arms train on the first N answers of --data (default: all); --sizes may go beyond"
    p.add_argument("--answers", type=bounded(int, low=1), default=None, help=a)
    p.add_argument("--epochs", type=bounded(int, low=1), default=None)
    p.add_argument("--eval-interval", type=bounded(int, low=1), default=None)
    p.add_argument("--prompts", type=bounded(int, low=1), default=None, help="served, per run")
    p.add_argument("--jobs", type=bounded(int, low=1), default=2, help="trainings at a time")
    p.add_argument("--docs", action="store_true", help="also write docs/study[-quick].md, figure")
    p.add_argument("--note", default="", help="a sentence for the page, e.g. what else was running")
    p.add_argument("--measure-run", metavar="DIR", help="measure one trained run (the study's own)")
    args = p.parse_args(argv)
    if args.measure_run:
        args.prompts = args.prompts or 16
        return args
    argv = list(sys.argv[1:] if argv is None else argv)
    args.argv = [a for i, a in enumerate(argv) if "--note" not in argv[i - 1 : i + 1]]
    if args.quick == bool(args.data):
        p.error("give --quick (the toy target) or --data and --eval-data (prepared features)")
    if args.data and not args.eval_data:
        p.error("--data: give --eval-data too, the held-out features every arm is measured on")
    quick = args.quick
    args.out = args.out or ("out/study-quick" if quick else "out/study")
    # full size, 1 epoch and 8 served prompts: 18 runs of 1,000 answers took 2.1 hours on 2 cores
    args.epochs = args.epochs or (2 if quick else 1)
    args.prompts = args.prompts or (16 if quick else 8)
    args.eval_interval = args.eval_interval or (50 if quick else 200)
    args.sizes = args.sizes if args.sizes is not None else ([150, 300] if quick else [250, 500])
    args.recipe = TOY_TRAIN if quick else recipe("main", "train")
    args.threads = 1 if args.jobs > 1 else None
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.measure_run:
        measure(args.measure_run, args.prompts)
        return
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    if args.quick:
        target, train_data, eval_data = prepare_toy(args.out)
        setup = (target, train_data, eval_data, TOY_CONFIG)
    else:
        for d in (args.data, args.eval_data):
            if not os.path.isfile(os.path.join(d, "manifest.json")):
                raise UsageError(f"{d}: no prepared features (prepare.py --features makes them)")
        setup = (args.target, args.data, args.eval_data, args.draft_config)
    answers = answers_in(setup[1])
    runs, same = plan(args, answers)
    bar = tqdm(total=len(runs), desc="study: runs trained and served", unit="run")
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            jobs = [pool.submit(train_run, args, setup, n, s, f) for n, _, s, _, f in runs]
            for job in jobs:
                job.result()
                bar.update()
    finally:  # an invocation cut short (Ctrl-C, a time bound) counts on the page too
        spent = add_wall_time(args.out, time.time() - t0)
    bar.close()
    results = {}
    for name, *_ in runs:
        with open(os.path.join(args.out, name, "study.json")) as f:
            results[name] = json.load(f)
    for point, arm_run in same.items():  # the curve's points that are arms' runs
        results[point] = results[arm_run]
    figure, log = os.path.join(args.out, "study.svg"), os.path.join(args.out, "plot.log")
    seed0 = [os.path.join(args.out, f"{arm}/seed0") for arm in args.arms]
    python(["-m", "tools.plot", *seed0, "--labels", *args.arms, "--out", figure], log)
    text = page(args, results, spent, "study.svg", answers)
    with open(os.path.join(args.out, "study.md"), "w") as f:
        f.write(text)
    print(text)
    if args.docs:
        name = "study-quick" if args.quick else "study"
        shutil.copy(figure, os.path.join(HERE, "docs", "figures", f"{name}.svg"))
        with open(os.path.join(HERE, "docs", f"{name}.md"), "w") as f:
            f.write(text.replace("](study.svg)", f"](figures/{name}.svg)"))
        print(f"wrote docs/{name}.md and docs/figures/{name}.svg")


if __name__ == "__main__":
    run(main)
