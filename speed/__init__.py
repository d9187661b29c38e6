"""CPU speed: how to run the target and the draft fast on this machine. A reader learning DFlash2
can skip this package: generate.py's defaults run nothing of it on the draft or the target (the
draft as trained, stock GEMMs, the path of B-1 drafts); `--fast`, a `--draft-dtype` or a
`--target-gemm` opt in.

The scripts (prepare.py, train.py, generate.py) and tools/ reach it through machine.py and tune.py
only (and bench.py, which is generate.py --bench). The map:
    machine.py  the rule (no measurement): the precision and the GEMM layout of each phase on
                this CPU. train.py asks it.
    tune.py     one call per script that says how to run here, measuring where the rule cannot
                tell: prepare.py's target layout; generate.py's verify shapes (--fast's tree:
                FAST_TREE), draft precision, head and layouts.
    gemm.py     the target's packed GEMM layouts: oneDNN's packed weights, MKL's packed GEMM.
    int8.py     the draft with int8 weights, for x86 CPUs.
    cost.py     the timings behind them, cached per machine: the GEMM layouts' decode and data
                tables, the draft head's fastest row counts (fastest_head).
    bench.py    `generate.py --bench`: each prompt decoded plainly and speculatively, every way.
"""
