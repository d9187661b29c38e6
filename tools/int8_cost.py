"""Not part of the tests: what the draft's pieces cost in each precision on this machine, batch 1.

    python tools/int8_cost.py --draft out/smollm2-math-dflash2/export

For fp32, bf16 and int8 (speed/int8.py) it prints the median ms of the draft's forward (one block
of B rows against a context of 200 cached rows) and of the target's head over 3 and over B block
rows, the two parts of a cycle's draft cost that depend on the precision (speed/cost.py times the
whole cycle, selector walk included).
"""

import argparse
import os
import sys

import torch

# the project's modules
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from export import load_any  # noqa: E402
from speed import machine  # noqa: E402
from speed.cost import draft_block, median_ms  # noqa: E402
from support.common import bounded, run  # noqa: E402
from support.target import load_target  # noqa: E402


@torch.no_grad()
def costs(draft, target, context: int, repeats: int) -> dict:
    _, head, forward = draft_block(draft, target, context)
    h = forward()  # [1, B, H]
    return {
        "forward": median_ms(forward, repeats),
        "head, 3 rows": median_ms(lambda: head(h[:, :3]), repeats),
        f"head, {draft.config.block_size} rows": median_ms(lambda: head(h), repeats),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="The draft's forward and head in fp32, bf16 and int8, batch 1."
    )
    ap.add_argument(
        "--draft", required=True, help="exported draft directory or training checkpoint"
    )
    ap.add_argument(
        "--target", default=None, help="target model name or path (default: the embedded target)"
    )
    ap.add_argument("--context", type=bounded(int, low=1), default=200)
    ap.add_argument("--repeats", type=bounded(int, low=1), default=21)
    args = ap.parse_args(argv)
    target, _ = load_target(args.target, torch.float32)
    print(
        f"{machine.describe('cpu')}; {torch.get_num_threads()} threads; median ms of {args.repeats}"
    )
    for precision in ("fp32", "bf16", "int8"):
        draft = machine.draft_in(precision, load_any(args.draft).eval(), target, "cpu")
        ms = costs(draft, target, args.context, args.repeats)
        print(f"{precision:<5} " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))


if __name__ == "__main__":
    run(main)
