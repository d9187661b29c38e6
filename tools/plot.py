"""Training, drawn: one or more runs' log.jsonl and acceptance.json as one SVG (support/draw.py).

    python -m tools.plot out/smollm2-math-dflash2     # writes out/smollm2-math-dflash2/training.svg
    python -m tools.plot out/toy/dflash out/toy/dflash2 --labels DFlash DFlash2 --out toy.svg

Three panels, one colour per run: the losses; held-out tau (teacher-forced, and served by
tools/served.py); acceptance.json's share of blocks accepted up to each position.
"""

import argparse
import itertools
import math
import os

from support import draw
from support.common import UsageError, read_json, run
from support.metrics import acceptance_file, read_acceptance
from support.tracking import read_log

# (panel, series name, record kinds, record key, dashed, dot radius or 0) for each line of the step
# panels. The train line is the loss's base term (base_loss; loss in a log without it): a held-out
# loss has no selector term (alpha_t), so the two lines measure the same thing.
LINES = [
    ("loss", "train loss", ("train",), "base_loss", False, 0),
    ("loss", "held-out loss", ("eval", "final"), "loss", True, 3),
    ("tau", "selector path", ("eval", "final"), "accept_selector", False, 3),
    ("tau", "unary path", ("eval", "final"), "accept_unary", True, 3),
    ("tau", "served", ("served",), "served_path_tau", False, 6),
]

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]  # one per run
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
    kept = [r for r in records if r["kind"] in kinds and value(r, key) is not None]
    return sorted({r["step"]: value(r, key) for r in kept}.items())


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


def ticks(lo: float, hi: float, n=5) -> list:
    """Round values from at or below lo to at or above hi, about n steps of 1, 2 or 5 times a power
    of ten: a chart's axis runs from the first to the last."""
    span = max(hi - lo, 1e-9)
    step = 10.0 ** math.floor(math.log10(span / n))
    step *= next(m for m in (1, 2, 5, 10) if span / (step * m) <= n)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [float(f"{k * step:.10g}") for k in range(first, last + 1)]


def chart(svg, x0, y0, w, h, series, title, xlabel, xt):
    """A panel of series [dict(points=[(x, y)], color, run, name, dashed, radius)] in a w x h frame
    at (x0, y0), x on the ticks xt; each tick holds its value and pixel, which a test reads back."""
    svg.group("chart", data_title=title)
    svg.text(x0, y0 - 12, title, "title")
    pts = [p for s in series for p in s["points"]]
    if not pts:
        svg.text(x0 + 10, y0 + h / 2, "(nothing recorded)", "note")
        svg.width, svg.height = max(svg.width, x0 + w), max(svg.height, y0 + h)
        svg.end_group()
        return
    ys = [p[1] for p in pts]
    flat = 0.5 if max(ys) == min(ys) else 0.0
    yt = ticks(min(ys) - flat, max(ys) + flat)
    X = lambda v: x0 + (v - xt[0]) / (xt[-1] - xt[0]) * w
    Y = lambda v: y0 + h - (v - yt[0]) / (yt[-1] - yt[0]) * h
    for v in yt:
        tick, y = f"{v:g}", Y(v)
        svg.line(x0, y, x0 + w, y, "grid")
        svg.text(x0 - 4, y, tick, "tick", "end", data_axis="y", data_value=tick, data_px=y)
    for v in xt:
        tick, x = f"{v:g}", X(v)
        svg.line(x, y0 + h, x, y0 + h + 4, "axis")
        svg.text(x, y0 + h + 14, tick, "tick", "middle", data_axis="x", data_value=tick, data_px=x)
    svg.line(x0, y0 + h, x0 + w, y0 + h, "axis")
    svg.line(x0, y0, x0, y0 + h, "axis")
    svg.text(x0 + w / 2, y0 + h + 32, xlabel, "note", "middle")
    for s in series:
        p = [(X(x), Y(y)) for x, y in s["points"]]
        kw = dict(stroke=s["color"], data_run=s["run"], data_name=s["name"])
        if len(p) > 1:
            svg.polyline(p, "series dashed" if s["dashed"] else "series", **kw)
        if s["radius"] or len(p) == 1:  # a lone point is a dot even on a line without them
            for x, y in p:
                svg.circle(x, y, s["radius"] or 3, "point", fill=s["color"], **kw)
    svg.end_group()


def picture(runs: list, title: str) -> draw.Svg:
    """runs [(label, records, {mode: acceptance by position})] -> the three panels and a legend."""
    svg, w, h = draw.Svg(title), 300, 210
    steps = [r["step"] for _, records, _ in runs for r in records]
    xticks = ticks(min(steps), max(steps) if max(steps) > min(steps) else min(steps) + 1)
    panels = {"loss": [], "tau": [], "accepted": []}  # each panel's series
    for (label, records, accepted), color in zip(runs, itertools.cycle(COLORS)):
        for panel, name, kinds, key, dashed, radius in LINES:
            pts = points(records, kinds, key)
            if pts:
                s = dict(points=pts, color=color, run=label, name=name, dashed=dashed)
                panels[panel].append(dict(s, radius=radius))
        for mode, shares in accepted.items():
            s = dict(points=list(enumerate(shares, 1)), color=color, run=label, name=mode)
            panels["accepted"].append(dict(s, dashed=mode == "unary", radius=3))
    L = max((len(s["points"]) for s in panels["accepted"]), default=0)
    chart(svg, 70, 60, w, h, panels["loss"], "loss", "step", xticks)  # both against the same steps
    chart(svg, 70 + w + 80, 60, w, h, panels["tau"], "held-out tau", "step", xticks)
    name, x = "accepted up to block position", 70 + 2 * (w + 80)
    chart(svg, x, 60, w, h, panels["accepted"], name, "block position j", list(range(1, L + 1)))
    y = 60 + h + 60
    for k, ((label, *_), color) in enumerate(zip(runs, itertools.cycle(COLORS))):
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
