"""How to run here: the one call each script makes into this package.

    prepare.py   data_target(target, dtype, wanted)   the target's GEMM layout for batched forwards
    generate.py  add_flags(a), choose(args, B)        --fast, --draft-dtype, --target-gemm
                 decoding(target, draft, ...)         the draft, its head and the target, set up

`auto` follows machine.py's rule and, where it cannot tell, a measurement cached per machine
(cost.py). It is prepare.py's default, not generate.py's: there nothing of this package runs unless
--fast, --draft-dtype or --target-gemm asks. Each choice is said in one line.
"""

import sys

from speed import cost, machine
from speed.gemm import set_layout
from support.common import DTYPES, UsageError, dtype_name
from support.show import label

# --fast's tree: in docs/cpu.md's benches ("What each piece of speed/ buys") a tree of 7 nodes beat
# both the default path of 7 drafts and a tree of 4 (Zen 3, Xeon); `generate.py --bench
# --verify-tokens 7 --tree-budget 4 7 16` compares them on this machine.
FAST_TREE = 7


def add_flags(a):
    """generate.py's flags for speed/'s choices; a: its ArgumentParser's add_argument."""
    a(
        "--fast",
        action="store_true",
        help=f"--draft-dtype auto, --target-gemm auto and a tree of {FAST_TREE} nodes where not "
        "given",
    )
    a(
        "--draft-dtype",
        choices=["auto", *DTYPES, "int8"],
        help="the draft's precision (default: as trained; auto: the fastest here); never changes "
        "the output",
    )
    a(
        "--target-gemm",
        choices=["auto", "stock", "onednn", "mkl"],
        help="the CPU layout of the target's weights (default: stock; auto: the fastest here)",
    )


def choose(args, B: int) -> tuple:
    """generate.py's flags -> (--draft-dtype, --target-gemm, the verify shapes: ("path", k) then
    ("tree", n), the line saying what --fast replaced, "" without it); B: the draft's block size."""
    draft_dtype, target_gemm = args.draft_dtype, args.target_gemm
    paths, trees = args.verify_tokens or [], args.tree_budget or []
    replaced = []
    if args.fast and draft_dtype is None:
        draft_dtype = "auto"
        replaced.append("--draft-dtype auto for the draft as trained")
    if args.fast and target_gemm is None:
        target_gemm = "auto"
        replaced.append("--target-gemm auto for stock GEMMs")
    if not (paths or trees):
        if args.fast:
            trees = [FAST_TREE]
            replaced.append(f"--tree-budget {FAST_TREE} for the {label(('path', B - 1))}")
        else:
            paths = [B - 1]
    if any(k >= B for k in paths):  # a path verifies at most the B-1 drafts a cycle proposes
        raise UsageError(
            f"--verify-tokens: at most {B - 1}, the drafts this draft proposes a cycle (block size "
            f"{B})"
        )
    shapes = [("path", k) for k in paths] + [("tree", n) for n in trees]
    line = "--fast: " + (", ".join(replaced) or "nothing to replace, all three given")
    return draft_dtype, target_gemm, shapes, line if args.fast else ""


def data_target(target, dtype, wanted: str):
    """prepare.py: the target's weights in the GEMM layout for its batched forwards, said."""
    device = next(target.parameters()).device
    layout, why = machine.choose_layout(dtype, device, wanted, lambda: cost.data_costs(target))
    set_layout(target, layout)
    print(
        machine.choice_line(machine.describe(device), target=f"{dtype_name(dtype)}, {why}"),
        file=sys.stderr,
    )
    note = machine.slow_bf16_note(dtype, device)
    if note:
        print(note, file=sys.stderr)


def decoding(target, draft, draft_dtype, target_gemm) -> tuple:
    """generate.py: the draft in draft_dtype's precision (None: as trained, untouched) with the head
    that scores its rows fastest, the target in target_gemm's layout (None: stock). -> (draft,
    head (None: the target's own), cost.decoding_layouts' answer, line)."""
    device, head = next(target.parameters()).device, None
    if draft_dtype is None:
        draft = draft.to(device)
        precision = f"{dtype_name(next(draft.parameters()).dtype)} (as trained)"
    else:
        precision = machine.draft_precision(draft_dtype, device)
        draft, head = machine.draft_in(precision, draft, target, device)
        head = cost.fastest_head(draft, target, head)
    layouts = cost.decoding_layouts(target, draft, target_gemm)
    target_line = f"{dtype_name(next(target.parameters()).dtype)}, {layouts['why']}"
    line = machine.choice_line(machine.describe(device), target=target_line, draft=precision)
    return draft, head, layouts, line
