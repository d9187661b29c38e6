"""Time the target's GEMMs alone, by row count, in each layout this machine runs (speed/gemm.py):
the cause behind cost.py's table, without attention, norms or Python around them.

    python tools/gemm_rows.py                   # rows 1 2 3 5 8, the embedded target
    python tools/gemm_rows.py --rows 1 4 9 17

For each row count M: the median ms of one pass through every nn.Linear of the target (its 30
layers' projections and the 49,152-row head, in the order a forward runs them) on an [M, in] input.
A batch-1 forward at 1 token is a 1-row pass, a verify of n tokens an n-row one; the weights (540 MB
in fp32) do not fit any cache, so a pass that reads them once at the memory's speed costs the same
for every M.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from speed import machine  # noqa: E402
from speed.cost import median_ms  # noqa: E402
from speed.gemm import LAYOUTS, drop_packs, set_layout  # noqa: E402
from support.common import bounded, run  # noqa: E402
from support.target import load_target  # noqa: E402


@torch.no_grad()
def pass_ms(target, rows: int, repeats: int) -> float:
    """Median ms of every linear of the target, each on its own random [rows, in] input."""
    linears = [m for m in target.modules() if isinstance(m, (torch.nn.Linear, *LAYOUTS.values()))]
    xs = [torch.randn(rows, m.weight.shape[1]) for m in linears]
    ms = median_ms(lambda: [m(x) for m, x in zip(linears, xs)], repeats)
    drop_packs(target)
    return ms


def main(argv=None):
    ap = argparse.ArgumentParser(description="Time the target's GEMMs by row count in each layout.")
    ap.add_argument(
        "--target", default=None, help="target model name or path (default: the embedded target)"
    )
    ap.add_argument("--rows", nargs="+", type=bounded(int, low=1), default=[1, 2, 3, 5, 8])
    ap.add_argument("--repeats", type=bounded(int, low=1), default=15)
    args = ap.parse_args(argv)
    target, _ = load_target(args.target, torch.float32)
    print(
        f"{machine.describe('cpu')}; {torch.get_num_threads()} threads; every linear of the "
        f"target, median ms of {args.repeats}"
    )
    print(f"{'layout':<8}" + "".join(f"{f'{m} rows':>10}" for m in args.rows))
    for layout in machine.layouts_here(torch.float32, "cpu"):
        set_layout(target, layout)
        print(
            f"{layout:<8}"
            + "".join(f"{pass_ms(target, m, args.repeats):>10.1f}" for m in args.rows),
            flush=True,
        )


if __name__ == "__main__":
    run(main)
