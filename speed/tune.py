"""How to run here: one call per script, the core's door into this package.

    prepare.py   data_target(target, dtype, wanted)   the target's GEMM layout for batched forwards
    generate.py  add_flags(a), fill_defaults(args, B) --fast, --draft-dtype, --target-gemm
                 decoding(target, draft, args)        the draft in its precision with its
                                                      fastest head (or as trained), the target
                                                      in its layout, and a line
                 verify_shapes(args, draft, mode, layouts)   the verify shapes asked, `auto` chosen

Each choice follows the rule of machine.py and, where the rule cannot tell, a short measurement
cached per machine (cost.py). Each is said in one line, so a run shows what it chose and why.
"""

import sys

from speed import auto, cost, machine
from speed.gemm import set_layout
from support.common import DTYPES, dtype_name
from support.show import label


def add_flags(a):
    """generate.py's flags for speed/'s choices; a: its ArgumentParser's add_argument."""
    a(
        "--fast",
        action="store_true",
        help="run as fast as speed/ knows here: --draft-dtype auto, --target-gemm auto and "
        "--tree-budget auto, each where not given (docs/cpu.md)",
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
    drafts. --fast puts speed/'s `auto` in place of each of the three not given. -> the line saying
    what it replaced ("" without --fast)."""
    replaced = []
    if args.fast and args.draft_dtype is None:
        args.draft_dtype = "auto"
        replaced.append("--draft-dtype auto for the draft as trained")
    if args.fast and args.target_gemm is None:
        args.target_gemm = "auto"
        replaced.append("--target-gemm auto for stock GEMMs")
    if not (args.verify_tokens or args.tree_budget):
        if args.fast:
            args.tree_budget = ["auto"]
            replaced.append(f"--tree-budget auto for the {label(('path', B - 1))}")
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
    layouts is cost.decoding_layouts' answer, which verify_shapes and --bench price with."""
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


def verify_shapes(args, draft, mode: str, layouts) -> list:
    """--verify-tokens / --tree-budget -> the verify shapes, ("path", k) or ("tree", n); `auto` (the
    default) is chosen from this machine's costs and the draft's held-out statistics (auto.py)."""
    return auto.plan(
        args.verify_tokens, args.tree_budget, draft, args.draft, mode, layouts["costs"]
    )
