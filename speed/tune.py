"""How to run here: one call per script, the core's door into this package.

    prepare.py   data_target(target, dtype, wanted)   the target's GEMM layout for batched forwards
    generate.py  add_flags(a), fill_defaults(args, B) --fast, --draft-dtype, --target-gemm
                 decoding(target, draft, args)        the draft in its precision with its
                                                      fastest head (or as trained), the target
                                                      in its layout, and a line
                 verify_shapes(args, B)               the verify shapes asked, each in range

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

FAST_TREE = 7  # the tree --fast verifies: what the removed cost model chose on the Zen 3 and Xeon


def add_flags(a):
    """generate.py's flags for speed/'s choices; a: its ArgumentParser's add_argument."""
    a(
        "--fast",
        action="store_true",
        help="run as fast as speed/ knows here: --draft-dtype auto, --target-gemm auto and "
        f"--tree-budget {FAST_TREE}, each where not given (docs/cpu.md)",
    )
    a(
        "--draft-dtype",
        choices=["auto", *DTYPES, "int8"],
        default=None,
        help="the draft's precision (default: as trained, fp32); auto: int8 weights on x86 CPUs "
        "(speed/int8.py), bf16 on a GPU, else bf16 where native, else fp32 (speed/machine.py). A "
        "precision given also scores the draft's head over the row count fastest here "
        "(speed/cost.py). Output is the target's either way",
    )
    a(
        "--target-gemm",
        choices=["auto", "stock", "onednn", "mkl"],
        default=None,
        help="the target's GEMM layout (speed/gemm.py; default stock): oneDNN's packed weights or "
        "MKL's packed GEMM; auto: whichever speed/cost.py measures fastest here (once per "
        "machine, cached; docs/cpu.md)",
    )


def fill_defaults(args, B: int) -> str:
    """The defaults run what decoding.py shows: the draft as trained, stock GEMMs, the path of B-1
    drafts. --fast puts speed/'s choices in place of each of the three not given: --draft-dtype
    auto, --target-gemm auto, a tree of FAST_TREE nodes. -> the line saying what it replaced (""
    without --fast)."""
    replaced = []
    if args.fast and args.draft_dtype is None:
        args.draft_dtype = "auto"
        replaced.append("--draft-dtype auto for the draft as trained")
    if args.fast and args.target_gemm is None:
        args.target_gemm = "auto"
        replaced.append("--target-gemm auto for stock GEMMs")
    if not (args.verify_tokens or args.tree_budget):
        if args.fast:
            args.tree_budget = [FAST_TREE]
            replaced.append(f"--tree-budget {FAST_TREE} for the {label(('path', B - 1))}")
        else:
            args.verify_tokens = [B - 1]
    if not args.fast:
        return ""
    return "--fast: " + (", ".join(replaced) if replaced else "nothing to replace, all three given")


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


def decoding(target, draft, args):
    """generate.py: the draft in --draft-dtype's precision here, with the head that scores its rows
    fastest (draft.head), or, with no --draft-dtype (None), as trained: nothing of this package
    touches it; the target in --target-gemm's layout (None: stock). -> (draft, layouts, line);
    layouts is cost.decoding_layouts' answer, whose plain layouts --bench decodes in."""
    device = next(target.parameters()).device
    if args.draft_dtype is None:
        draft = draft.to(device)
        precision = f"{dtype_name(next(draft.parameters()).dtype)} (as trained)"
    else:
        precision = machine.draft_precision(args.draft_dtype, device)
        draft = machine.draft_in(precision, draft, target, device)
        cost.use_fastest_rows(draft, target)
    layouts = cost.decoding_layouts(target, draft, args.target_gemm)
    dtype = next(target.parameters()).dtype
    target_line = f"{dtype_name(dtype)}, {layouts['why']}"
    line = machine.choice_line(machine.describe(device), target=target_line, draft=precision)
    return draft, layouts, line


def verify_shapes(args, B: int) -> list:
    """--verify-tokens / --tree-budget -> the verify shapes, ("path", k) for each k given, then
    ("tree", n) for each n. A path verifies at most the B-1 drafts a cycle proposes (B: the draft's
    block size); more is refused in one line."""
    if any(k >= B for k in args.verify_tokens or []):
        raise UsageError(
            f"--verify-tokens: at most {B - 1}, the drafts this draft proposes a cycle (block size "
            f"{B})"
        )
    paths = [("path", k) for k in args.verify_tokens or []]
    return paths + [("tree", n) for n in args.tree_budget or []]
