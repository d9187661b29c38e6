"""CPU speed: how to run the target and the draft fast on this machine. A reader learning DFlash2
can skip this package: with `--target-dtype fp32 --draft-dtype fp32 --target-gemm stock
--verify-tokens K` nothing in it changes what runs.

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
