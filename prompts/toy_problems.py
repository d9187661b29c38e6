"""The toy run's word problems, each with its worked answer (bash run.sh --toy; a TOY, not the main
job): a few templates with small numbers, so that a tiny target learns them in a minute or two.

    toy_problems(n, seed) -> n distinct (question, worked answer) pairs, the same for the same seed
    toy_split()           -> (training pairs, held-out pairs): one pool, its last HELD_OUT held out

tools/toy_target.py trains the toy target on the training pairs; prepare.py --prompts toy /
toy-eval then has the toy target answer the questions itself, as for any target. The answers are
nearly all template text, which is what lets a draft commit several tokens per cycle.
"""

import random
import sys

from prompts.word_problems import distinct

NAMES = "Anna Ben Carla David Emma Hiro Lena Omar Priya Rosa Sam Zoe".split()
THINGS = "apples pencils stickers marbles cookies books shells cards".split()
CONTAINERS = "boxes bags jars packs".split()
POOL, HELD_OUT = 6000, 200

# (question, worked answer), filled from the slots in fill(): names A, B; things T; container C
# (c: one of them); small numbers n1, n2, n3 and what the answer computes from them.
TEMPLATES = [
    (
        "{A} has {n1} {C} of {T}. Each {c} holds {n2} {T}. {A} gives {n3} {T} to {B}. "
        "How many {T} does {A} have left?",
        "{A} has {n1} {C} with {n2} {T} in each, so {A} has {n1} x {n2} = {m12} {T}. "
        "{A} gives {n3} to {B}, so {m12} - {n3} = {r1} {T} are left. The answer is {r1}.",
    ),
    (
        "{A} buys {n1} {T} for ${n2} each and {n3} {C} for ${n2} each. How much does {A} spend?",
        "The {T} cost {n1} x {n2} = {m12} dollars. The {C} cost {n3} x {n2} = {m32} dollars. "
        "In total {A} spends {m12} + {m32} = {r2} dollars. The answer is {r2}.",
    ),
    (
        "{A} is {n1} years old. {B} is {n2} years older than {A}. How old will {B} be in {n3} "
        "years?",
        "{B} is {n1} + {n2} = {s12} years old now. In {n3} years {B} will be {s12} + {n3} = {r3} "
        "years old. The answer is {r3}.",
    ),
    (
        "{A} had {n1} {T} and bought {n2} more. Then {A} gave {n3} {T} to {B}. How many {T} does "
        "{A} have now?",
        "{A} had {n1} {T} and bought {n2} more, so {A} had {n1} + {n2} = {s12} {T}. {A} gave "
        "{n3} to {B}, so {s12} - {n3} = {r4} {T} are left. The answer is {r4}.",
    ),
    (
        "{A} reads {n1} pages every day for {n2} days. {B} reads {n3} pages every day for {n2} "
        "days. How many pages do they read together?",
        "{A} reads {n1} x {n2} = {m12} pages. {B} reads {n3} x {n2} = {m32} pages. Together "
        "they read {m12} + {m32} = {r2} pages. The answer is {r2}.",
    ),
    (
        "{A} packs {T} into {C}. {A} fills {n1} {C} with {n2} {T} each and has {n3} {T} over. "
        "How many {T} did {A} have?",
        "{A} fills {n1} {C} with {n2} {T} each, so {n1} x {n2} = {m12} {T} are packed. With "
        "the {n3} over, {A} had {m12} + {n3} = {r5} {T}. The answer is {r5}.",
    ),
]


def fill(i: int, rng: random.Random) -> tuple:
    question, answer = TEMPLATES[i % len(TEMPLATES)]
    A, B = rng.sample(NAMES, 2)
    C = rng.choice(CONTAINERS)
    n1, n2, n3 = (rng.randint(2, 9) for _ in range(3))
    m12, m32, s12 = n1 * n2, n3 * n2, n1 + n2
    slots = dict(A=A, B=B, T=rng.choice(THINGS), C=C, c="box" if C == "boxes" else C[:-1])
    slots.update(n1=n1, n2=n2, n3=n3, m12=m12, m32=m32, s12=s12)
    slots.update(r1=m12 - n3, r2=m12 + m32, r3=s12 + n3, r4=s12 - n3, r5=m12 + n3)
    return question.format(**slots), answer.format(**slots)


def toy_problems(n: int, seed: int = 0) -> list:
    """n distinct (question, worked answer) pairs, templates taken in turn."""
    rng = random.Random(seed)
    return distinct(n, lambda i: fill(i, rng), key=lambda pair: pair[0])


def toy_split() -> tuple:
    """(training pairs, held-out pairs): the held-out questions are never trained on, by the toy
    target or by its draft."""
    pool = toy_problems(POOL)
    return pool[:-HELD_OUT], pool[-HELD_OUT:]


if __name__ == "__main__":  # python -m prompts.toy_problems I: held-out question I (run.sh --toy)
    print(toy_split()[1][int(sys.argv[1])][0])
