"""How to run here: one call per script, the core's door into this package.

    prepare.py   data_target(target, dtype, wanted)   the target's GEMM layout for batched forwards
    generate.py  decoding(target, draft, args)        the draft in its precision with its
                                                      fastest head (or as trained), the target
                                                      in its layout, and a line
                 verify_shapes(args, draft, mode, layouts)   the verify shapes asked, `auto` chosen

Each choice follows the rule of machine.py and, where the rule cannot tell, a short measurement
cached per machine (cost.py). Each is said in one line, so a run shows what it chose and why.
"""

import sys

from speed import auto, cost, machine
from speed.gemm import set_layout


def data_target(target, dtype, wanted: str):
    """prepare.py: put the target's weights in the GEMM layout for its batched forwards (measuring
    prepare's own shapes where the rule must), and say what was chosen and why."""
    device = next(target.parameters()).device
    layout, why = machine.choose_layout(dtype, device, wanted, lambda: cost.data_costs(target))
    set_layout(target, layout)
    print(
        machine.choice_line(machine.describe(device), target=f"{machine.dtype_name(dtype)}, {why}"),
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
        precision = f"{machine.dtype_name(next(draft.parameters()).dtype)} (as trained)"
    else:
        precision = machine.draft_precision(args.draft_dtype, device)
        draft = machine.draft_in(precision, draft, target, device)
        cost.use_fastest_rows(draft, target)
    layouts = cost.decoding_layouts(target, draft, args.target_gemm)
    dtype = next(target.parameters()).dtype
    target_line = f"{machine.dtype_name(dtype)}, {layouts['why']}"
    line = machine.choice_line(machine.describe(device), target=target_line, draft=precision)
    return draft, layouts, line


def verify_shapes(args, draft, mode: str, layouts) -> list:
    """--verify-tokens / --tree-budget -> the verify shapes, ("path", k) or ("tree", n); `auto` (the
    default) is chosen from this machine's costs and the draft's held-out statistics (auto.py)."""
    return auto.plan(
        args.verify_tokens, args.tree_budget, draft, args.draft, mode, layouts["costs"]
    )
