"""Training, drawn: one or more runs' log.jsonl and acceptance.json as one SVG (support/draw.py).

    python -m tools.plot out/smollm2-math-dflash2     # writes out/smollm2-math-dflash2/training.svg
    python -m tools.plot out/toy/dflash out/toy/dflash2 --labels DFlash DFlash2 --out toy.svg

Three panels, one colour per run: the training and held-out loss; held-out tau teacher-forced on
the selector's and the unary path, and served tau (tools/served.py, a large dot); acceptance.json's
share of blocks accepted up to each position. A step logged twice draws its later record.
"""

import argparse
import os

from support import draw
from support.common import UsageError, read_json, run
from support.metrics import acceptance_file, read_acceptance
from support.tracking import read_log

# (panel, series name, record kinds, record key, dashed) for each line of the step panels. The train
# line is the loss's base term (base_loss; loss in a log without it): a held-out loss has no
# selector term (alpha_t), so the two lines measure the same thing.
LINES = [
    ("loss", "train loss", ("train",), "base_loss", False),
    ("loss", "held-out loss", ("eval", "final"), "loss", True),
    ("tau", "selector path", ("eval", "final"), "accept_selector", False),
    ("tau", "unary path", ("eval", "final"), "accept_unary", True),
    ("tau", "served", ("served",), "served_path_tau", False),
]

KEY = [
    "solid: the training loss (its base term); held-out tau on the selector's path (DFlash2); the",
    "    share of held-out blocks accepted up to each position (acceptance.json)",
    "dashed: the held-out loss; held-out tau and that share on the unary argmax path (plain DFlash",
    "    has only these); a large dot: served tau, the real decoding loop (tools/served.py)",
]


def value(record, key):
    """The number a record holds at key (base_loss: loss where it has none), or None."""
    v = record.get(key, record.get("loss") if key == "base_loss" else None)
    return v if isinstance(v, (int, float)) else None


def points(records, kinds, key) -> list:
    """[(step, value)] of the records of these kinds that hold a number at key, by step; a step
    logged twice (a resumed run) keeps its later record."""
    by_step = {
        r["step"]: value(r, key)
        for r in records
        if r["kind"] in kinds and value(r, key) is not None
    }
    return sorted(by_step.items())


def by_position(folder: str):
    """acceptance.json beside the run -> {mode: [share accepted up to position j]}, or {}."""
    file = acceptance_file(folder)
    if not os.path.isfile(file):
        return {}
    d = read_json(file)  # it names the file if it is not JSON
    block_size = d.get("block_size") if isinstance(d, dict) else None
    if not isinstance(block_size, int) or block_size < 2:
        raise UsageError(f"{file}: no block_size (an integer >= 2)")
    stats = read_acceptance(folder, block_size) or {}  # it checks the file, naming it
    return {mode: s["accepted"] for mode, s in stats.items()}


def picture(runs: list, title: str) -> draw.Svg:
    """runs [(label, records, {mode: acceptance by position})] -> the three panels and a legend."""
    svg, w, h = draw.Svg(), 300, 210
    svg.text(10, 14, title, "title")
    panels = {"loss": (70, "loss", "step"), "tau": (70 + w + 80, "held-out tau", "step")}
    steps = [r["step"] for _, records, _ in runs for r in records]
    xticks = draw.ticks(min(steps), max(steps) if max(steps) > min(steps) else min(steps) + 1)
    for panel, (x, name, xlabel) in panels.items():  # both against the same steps
        series = []
        for k, (label, records, _) in enumerate(runs):
            for p, line, kinds, key, dashed in LINES:
                pts = points(records, kinds, key)
                if p == panel and pts:
                    color = draw.COLORS[k % len(draw.COLORS)]
                    dots = kinds != ("train",)
                    radius = 6 if key == "served_path_tau" else 3
                    s = dict(points=pts, color=color, run=label, name=line, dashed=dashed)
                    series.append(dict(s, dots=dots, radius=radius))
        draw.chart(svg, x, 60, w, h, series, name, xlabel, xticks)
    series, L = [], 0
    for k, (label, _, accepted) in enumerate(runs):
        for mode, shares in accepted.items():
            L = max(L, len(shares))
            pts = list(enumerate(shares, 1))
            color = draw.COLORS[k % len(draw.COLORS)]
            series.append(
                dict(points=pts, color=color, run=label, name=mode, dashed=mode == "unary", dots=1)
            )
    x = 70 + 2 * (w + 80)
    name = "accepted up to block position"
    draw.chart(svg, x, 60, w, h, series, name, "block position j", list(range(1, L + 1)) or None)
    y = 60 + h + 60
    for k, (label, *_) in enumerate(runs):
        color = draw.COLORS[k % len(draw.COLORS)]
        svg.line(70 + 200 * k, y, 110 + 200 * k, y, style=f"stroke: {color}; stroke-width: 3")
        svg.text(118 + 200 * k, y, label)
    for i, line in enumerate(KEY):
        svg.text(70, y + 24 + 18 * i, line, "note")
    return svg


def main(argv=None):
    ap = argparse.ArgumentParser(description="Plot training runs' log.jsonl and acceptance.json.")
    ap.add_argument("runs", nargs="+", help="train.py output folders (or their log.jsonl)")
    ap.add_argument("--labels", nargs="+", help="one name per run (default: the folder's name)")
    ap.add_argument("--out", help="the SVG to write (default: RUN/training.svg for one run)")
    args = ap.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        ap.error(f"--labels: one per run ({len(args.runs)}), got {len(args.labels)}")
    if args.out is None and len(args.runs) > 1:
        ap.error("several runs: name the picture with --out FILE")
    runs = []
    for k, path in enumerate(args.runs):
        folder, records = read_log(path)
        label = args.labels[k] if args.labels else os.path.basename(folder)
        runs.append((label, records, by_position(folder)))
    out = args.out or os.path.join(folder, "training.svg")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise UsageError(f"--out {out}: no folder {folder}")
    title = "training: " + ", ".join(label for label, *_ in runs)
    picture(runs, title).save(out)
    print(f"[plot.py] {out}")


if __name__ == "__main__":
    run(main)
