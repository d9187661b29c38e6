"""CPU speed: how to run the target and the draft fast on this machine. A reader learning DFlash2
can skip this package: generate.py's defaults run nothing of it on the draft or the target (the
draft as trained, stock GEMMs, the path of B-1 drafts); `--fast`, a `--draft-dtype`, a
`--target-gemm` or an `auto` shape opt in.

The core reaches it through two modules only:
    machine.py  the rule (no measurement): the precision of each phase on this CPU. train.py
                asks it.
    tune.py     one call per script that returns how to run here, measuring where the rule
                cannot tell: prepare.py's target layout, generate.py's draft precision, head,
                layouts and verify shape.
Behind them: gemm.py (packed GEMM layouts), int8.py (the int8 draft), cost.py (timings and the cost
model, `python -m speed.cost`), auto.py (a path or a tree, how big), bench.py (`generate.py
--bench`).
"""
