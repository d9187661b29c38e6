"""CPU speed: how to run the target and the draft fast on this machine. A reader learning DFlash2
can skip it: generate.py's defaults run none of it (the draft as trained, stock GEMMs, the path of
B-1 drafts); `--fast`, a `--draft-dtype` or a `--target-gemm` opt in. The scripts and tools/ reach
it through machine.py, tune.py and bench.py only. The map:
    machine.py  the rule (no measurement): each phase's precision and GEMM layout on this CPU
    tune.py     one call per script that says how to run here, measuring where the rule cannot tell
    gemm.py     the target's packed GEMM layouts: oneDNN's packed weights, MKL's packed GEMM
    int8.py     the draft with int8 weights, for x86 CPUs
    cost.py     the timings behind them, cached per machine: GEMM layouts, the head's row counts
    bench.py    `generate.py --bench`: each prompt decoded plainly and speculatively, every way
"""
