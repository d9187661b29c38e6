"""Tools: what measures, checks, draws or serves around the pipeline; none is on the reading path.
Each runs from the repository's root as `python -m tools.NAME` (--help says how).

    served.py      served tau: held-out prompts decoded by the real loop after train.py
    plot.py        one or more training runs drawn as one SVG
    figures.py     the walkthrough's figures (docs/figures)
    toy_target.py  the tiny word-level target of run.sh --toy
    study.py       the pieces of DFlash2 at equal data and steps, several seeds (docs/study.md)
    mutants.py     breaks the method one rule at a time; the tests must notice (docs/mutants.md);
                   the breaks are data, mutants.toml
    gpu_check.py   the GPU path in one bounded call (docs/training-at-scale.md)
    llamacpp.py    llama.cpp: build it, convert to GGUF, check its tokens against generate.py
    form.py        the repository's form: imports, maps, cited names, line budgets, docs against
                   the code (python -m pytest -q tools/form.py; .ci/run runs it)
    test_tools.py  the tests of these tools (conftest.py: the fixtures they share with test_all.py)
"""
