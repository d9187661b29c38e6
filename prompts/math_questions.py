"""Print N school maths questions from DeepMind's `mathematics-dataset` generator as a JSON list.

    PYTHONHASHSEED=0 python prompts/math_questions.py N SEED

prepare.py runs this in a child process on purpose: the generator picks variable names by
iterating over sets of strings, so its output depends on Python's string hash seed, which can only
be fixed before the interpreter starts. Under that seed and `SEED` the list is the same on every
run and every torchrun rank. Two compatibility fixes for today's stack:
- sympy >= 1.12 moved `base_solution_linear`; we put it back where the generator imports it from;
- numpy 2 removed `np.object` and `ndarray.itemset`, which break some modules at sampling time:
  a sample that raises is skipped. The `*_composed` modules are left out because the order of
  their sentences depends on object ids, which no seed fixes.
"""

import json
import random
import sys
import warnings


def main(n: int, seed: int):
    warnings.simplefilter("ignore")  # np.object FutureWarnings from old code
    import numpy as np
    import sympy.core.random
    from sympy.solvers.diophantine.diophantine import base_solution_linear

    # the shim: restore the old import path (the package name is shadowed by a function of the
    # same name in sympy.solvers, so reach the module through sys.modules)
    sys.modules["sympy.solvers.diophantine"].base_solution_linear = base_solution_linear
    from mathematics_dataset.modules import modules

    random.seed(seed), np.random.seed(seed), sympy.core.random.seed(seed)

    def flatten(tree, prefix=""):
        for name, value in sorted(tree.items()):
            if isinstance(value, dict):
                yield from flatten(value, prefix + name + "__")
            elif not name.endswith("_composed"):
                yield prefix + name, value

    generators = list(flatten(modules.train(lambda entropy_range: entropy_range)))
    questions, i = [], 0
    while len(questions) < n and i < 20 * n:  # round-robin over modules
        _, generate = generators[i % len(generators)]
        i += 1
        try:
            questions.append(str(generate().question))
        except Exception:  # a numpy-2 casualty; see the docstring
            pass
    print(json.dumps(questions))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
