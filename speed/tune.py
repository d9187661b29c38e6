"""How to run here: the one call each script makes into this package to choose how it runs.

    prepare.py   data_target(target, dtype, wanted)   the target's GEMM layout for batched forwards
    generate.py  add_flags(a)                         --fast, --draft-dtype, --target-gemm
                 choose(args, B)                      what those flags and the verify shapes ask
                 decoding(target, draft, ...)         the draft in its precision with the head that
                                                      scores its rows fastest (or as trained), the
                                                      target in its layout, and a line

`auto` follows the rule of machine.py and, where the rule cannot tell, a short measurement cached
per machine (cost.py). It is prepare.py's default (--target-gemm), not generate.py's: there nothing
of this package runs (the draft as trained, stock GEMMs) unless --fast, --draft-dtype or
--target-gemm asks. Each choice is said in one line, so a run shows what it chose and why.
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
        help=f"use speed/'s choices for this machine (auto below, a tree of {FAST_TREE} nodes) "
        "where not given",
    )
    a(
        "--draft-dtype",
        choices=["auto", *DTYPES, "int8"],
        default=None,
        help="the draft's precision (default: as trained; auto: the fastest here), which never "
        "changes the output",
    )
    a(
        "--target-gemm",
        choices=["auto", "stock", "onednn", "mkl"],
        default=None,
        help="the CPU layout of the target's weights (default: stock; auto: the fastest here)",
    )


def choose(args, B: int) -> tuple:
    """generate.py's flags -> (--draft-dtype, --target-gemm, the verify shapes, the line saying what
    --fast replaced: "" without it); B: the draft's block size. The defaults run what decoding.py
    shows: the draft as trained (None), stock GEMMs (None), the path of B-1 drafts. --fast puts
    speed/'s choices in place of each of the three not given: auto, auto, a tree of FAST_TREE
    nodes. args is left as parsed."""
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
    shapes = verify_shapes(paths, trees, B)
    if not args.fast:
        return draft_dtype, target_gemm, shapes, ""
    line = "--fast: " + (", ".join(replaced) if replaced else "nothing to replace, all three given")
    return draft_dtype, target_gemm, shapes, line


def verify_shapes(paths: list, trees: list, B: int) -> list:
    """--verify-tokens' and --tree-budget's values -> the verify shapes, ("path", k) for each k,
    then ("tree", n) for each n. A path verifies at most the B-1 drafts a cycle proposes (B: the
    draft's block size); more is refused in one line."""
    if any(k >= B for k in paths):
        raise UsageError(
            f"--verify-tokens: at most {B - 1}, the drafts this draft proposes a cycle (block size "
            f"{B})"
        )
    return [("path", k) for k in paths] + [("tree", n) for n in trees]


def data_target(target, dtype, wanted: str):
    """prepare.py: put the target's weights in the GEMM layout for its batched forwards (measuring
    prepare's own shapes where the rule must), and say what was chosen and why."""
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
    """generate.py: the draft in draft_dtype's precision here (choose's --draft-dtype), with the
    head that scores its rows fastest, or, with None, as trained: nothing of this package touches
    it; the target in target_gemm's layout (None: stock). -> (draft, head, layouts, line): head
    for the decoding loops' `head` (None: the target's own); layouts is cost.decoding_layouts'
    answer, whose plain layouts --bench decodes in."""
    device, head = next(target.parameters()).device, None
    if draft_dtype is None:
        draft = draft.to(device)
        precision = f"{dtype_name(next(draft.parameters()).dtype)} (as trained)"
    else:
        precision = machine.draft_precision(draft_dtype, device)
        draft, head = machine.draft_in(precision, draft, target, device)
        head = cost.fastest_head(draft, target, head)
    layouts = cost.decoding_layouts(target, draft, target_gemm)
    dtype = next(target.parameters()).dtype
    target_line = f"{dtype_name(dtype)}, {layouts['why']}"
    line = machine.choice_line(machine.describe(device), target=target_line, draft=precision)
    return draft, head, layouts, line
