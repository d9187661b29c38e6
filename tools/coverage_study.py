"""Anchor coverage against held-out tau at equal wall time, on data prepare.py made (the maths
demo's, after `bash run.sh` step 1).

    python tools/coverage_study.py --data data/smollm2-math/train \
        --eval-data data/smollm2-math/eval --minutes 6 --out-dir out/coverage

Each setting trains a draft with train.py for the same wall time: a calibration run times its
steps 41..100 (the first ones are slower while oneDNN meets new shapes: timed from step 3, a run
of 642 steps took half of its --minutes), then the real run gets as many steps as fit --minutes,
so its learning-rate schedule ends where the time does. Reported per setting: the
supervised-token coverage of the training steps (train.py logs it per step; the mean over the run),
steps, wall time, and the held-out teacher-forced accepted lengths (selector path, unary) from the
final evaluation. Extra train.py flags follow `--`.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETTINGS = {  # name: train.py flags
    "row, 32 anchors": ["--num-anchors", "32"],
    "row, 64 anchors": ["--num-anchors", "64"],
    "packed 512, 32 per row": ["--num-anchors", "32", "--pack", "--anchors-per", "row"],
    "packed 512, 32 per document": ["--num-anchors", "32", "--pack", "--anchors-per", "document"],
}
PACK_LENGTH = ["--max-length", "512"]


def train(args, flags, out, steps, evaluate: bool) -> list:
    """train.py with these flags for `steps` steps -> its log records."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--data", args.data]
    cmd += ["--draft-config", args.draft_config, "--eval-data", args.eval_data, "--lr", "1e-3"]
    cmd += ["--out-dir", out, "--max-steps", str(steps), "--log-interval", "1", "--quiet"]
    cmd += ["--save-interval", str(10**9), "--eval-interval", str(10**9)]
    cmd += ["--eval-samples", str(args.eval_samples if evaluate else 0)]
    cmd += flags + (PACK_LENGTH if "--pack" in flags else []) + args.extra
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--eval-data", required=True)
    p.add_argument("--draft-config", default="configs/smollm2-135m-dflash2.json")
    p.add_argument("--minutes", type=float, default=6.0, help="training wall time per setting")
    p.add_argument("--eval-samples", type=int, default=48)
    p.add_argument("--out-dir", default="out/coverage")
    p.add_argument("extra", nargs="*", help="more train.py flags, after --")
    args = p.parse_args(argv)
    rows = []
    for name, flags in SETTINGS.items():
        out = os.path.join(args.out_dir, name.replace(" ", "").replace(",", "-"))
        calib = train(args, flags, out + "-calibration", 100, evaluate=False)
        t = {r["step"]: r["elapsed_s"] for r in calib if r["kind"] == "train"}
        per_step = (t[100] - t[40]) / 60
        steps = max(100, int(args.minutes * 60 / per_step))
        log = train(args, flags, out, steps, evaluate=True)
        steps_log = [r for r in log if r["kind"] == "train"]
        final = [r for r in log if r["kind"] == "final"][-1]
        row = {
            "setting": name,
            "s_per_step": round(per_step, 3),
            "steps": steps,
            "train_s": steps_log[-1]["elapsed_s"],
            "coverage": round(sum(r["coverage"] for r in steps_log) / len(steps_log), 4),
            "anchors_per_s": steps_log[-1]["anchors_per_s"],
            "tau_selector": round(final["accept_selector"], 4),
            "tau_unary": round(final["accept_unary"], 4),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| setting | s/step | steps | train s | coverage | tau selector | tau unary |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['setting']} | {r['s_per_step']} | {r['steps']} | {r['train_s']:.0f} | "
            f"{r['coverage']:.3f} | {r['tau_selector']:.3f} | {r['tau_unary']:.3f} |"
        )


if __name__ == "__main__":
    main()
