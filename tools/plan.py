"""Sizing the main job to this machine: measure it with small probes (about 20 s on a 2-core Zen 4
with avx512_bf16), then choose how many answers to make and train on, how
many epochs, and how large the job's fixed costs are, so that `bash run.sh` ends within its budget
on a fast CPU and on a slow one, with the best draft the budget allows.

    python tools/plan.py --budget-min 45      # prints the plan, then N_TRAIN=... lines for run.sh
    python tools/plan.py --num-samples N --elapsed-s S ...
                                              # again before training: MAX_STEPS, the steps that
                                              # fit what the job's first S seconds left, and
                                              # TRAIN_S, their seconds: train.py --max-seconds
                                              # fits its steps to them at its own step time

The same job costs 16x more on a CPU without native bf16 (README, "Your machine"). Its time is

    T(N, E) = spent + LOAD_S + layouts + (N - have) * t_answer + held_out + N * E * t_step
              + evaluations + served

    t_answer     one on-policy answer and its features: regeneration decodes batches of 64 rows,
                 and every batch of the maths set ran all 160 steps (some answer in each is cut
                 there), so 160 / 64 batch steps per answer and its prompt's prefill (timed on
                 2 rows of PROMPT_TOKENS), plus prepare.py's feature step for one
                 conversation, run as prepare runs it (tokenize, forward with hooks, cast, check,
                 write the shard) on conversations of 178 tokens (the answers' mean, 179)
    t_step       one training step (one answer, 32 anchors), in the precision train.py picks here
    held_out     the N_EVAL held-out answers: one batch of 160 steps of N_EVAL rows and N_EVAL
                 feature steps (unless made)
    evaluations  one every EVAL_INTERVAL steps and one at the end, N_EVAL answers each, forward
                 only (~ t_step / 3 each)
    served       tools/served.py's evaluation: SERVED_SAMPLES held-out prompts decoded for up to
                 SERVED_TOKENS tokens each, twice (the path of B-1 drafts and auto's shape); a
                 token of the path costs a verify of B tokens plus the draft and its bookkeeping
                 over the tau it commits (a typical main job's, 1.7), in the layout --fast takes
                 where it is known, plus its fixed part: loading, and its one-off measurement of
                 the target's decoding layouts (speed/cost.py's decode table) unless cached
    layouts      prepare.py's one-off measurement of the target's GEMM layouts for its batched
                 shapes, where the rule must measure them (fp32 on a CPU with several layouts); the
                 plan does not run it (it cost minutes on a slow CPU) but prices it from its probes
    have         answers already made in the data folder (a rerun only trains)
    spent        this measurement itself (part of the job)

all measured with the project's own code, in the phases' own precisions, with probes small enough
to cost seconds anywhere: a decoding step of 64 rows after 160 tokens is timed on a KV cache filled
with random keys and values (a step's cost does not depend on them), not after a prefill of 10,240
tokens. Two of the probes are priced at what the real phase measured beside them: generate's steps
at REGEN_RATIO of the forward's, train.py's at TRAIN_RATIO of its train_step's. The probes run in
turn, round after round, each after an untimed call (in_rounds), so each reads the machine's
speed over the whole measurement, not in one burst: a shared VM's drifts. An explicit N_TRAIN
(--num-samples) skips the probes of the data (regeneration and features: its held-out set stays
at 48 unless N_EVAL is given), and with --epochs too the training step's probe; the served
evaluation's three short probes always run.

The fixed costs scale with the machine. On the AMD EPYC with avx512_bf16 of
docs/cpu.md the full-size ones take, of a 45-minute job: the 48 held-out answers
about 1%, the served evaluation of 16 prompts x 160 tokens about 9% (239 s, docs/acceptance.md),
an evaluation of 48 answers every 600 steps 16/600 of training. Here each gets the same share of
the budget at most (HELD_OUT_SHARE, SERVED_SHARE, EVAL_SHARE): fewer held-out answers (down to
16), fewer served prompts (down to 4) and then fewer served tokens (down to 64), an evaluation
every 12.5 x N_EVAL steps. The plan's line says what it shrank.

N and E are the pair whose T(N, E) is at most 92% of the budget (a native job planned to 44 of 45
minutes took 44.8: its training steps ran 12% slower than measured) with the highest expected
held-out tau, from the learning curve the project measured (CURVE: tau against answers x epochs on
this target and these 48 GSM8K questions, on three machines and an emulated one): tau = a + b
ln(steps), a and b fitted to CURVE by least squares, where repeated epochs count only up to
free_epochs(N) (2 up to 1,200 answers: the same 400 steps over 150 answers lost 0.11 against 400
fresh ones; 4 at 2,400: four epochs over 2,400 answers kept gaining). Below MIN_STEPS of such
steps a draft is not worth a budget (tau about 1.45), and the plan refuses in one line, with the
budget that would hold one.
"""

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from typing import NamedTuple, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

import data  # noqa: E402
import model  # noqa: E402
import prepare  # noqa: E402
import train  # noqa: E402
from compat.config_json import load_config  # noqa: E402
from decoding import crop, new_cache, with_cache  # noqa: E402
from speed import cost, machine, tune  # noqa: E402
from speed.auto import priced_sizes  # noqa: E402
from speed.gemm import drop_packs, set_layout  # noqa: E402
from support import regen, timefit  # noqa: E402
from support.common import bounded, run  # noqa: E402
from support.target import load_target  # noqa: E402

# decoding steps of a 64-row batch; its mean context (prompt + half an answer)
REGEN_STEPS, REGEN_CONTEXT = 160, 160
# 178 tokens rendered, as the maths answers' 179 on average (1,000 of them, prompt and template
# included; the conversation of 268 tokens this replaced priced the feature step 1.3x too high)
CAPTURE_CONVERSATION = [
    {"role": "user", "content": "How many apples are left at the end? " * 2},
    {"role": "assistant", "content": "She has 12 apples and gives 5 away, so 7 are left. " * 7},
]
# transformers' generate's 64-row steps against forward_step's step at the same mean context, the
# prompts' prefill priced apart (PROMPT_TOKENS): on the AMD EPYC Zen 4 (2026-12-04) natively in bf16
# 0.50 (a batch of 64 beside the probe: 35.2 s, less its 6.5 s prefill, over 160 steps of 0.18 s
# against the probe's 0.363) and 0.55 in job 7 (its regeneration ran 0.59 s an answer, the prompt
# about 0.065, where its probe read 0.383 s a step); in fp32 on one core held to AVX2 0.91 (106.8 s
# less a 27.9 s prefill, steps of 0.494 s against 0.543) and 1.16 in job 8 (1.38 s an answer, the
# prompt about 0.27, against 0.383). (0.69 before, the prefill inside, from 7 pairs natively.) The
# cause is not the cache's contents, its cropping, position ids, logits_to_keep or the cache object
# generate makes: each of those timed alike. Not found; the ratio prices it, by the data's dtype.
REGEN_RATIO = {torch.bfloat16: 0.55, torch.float32: 1.0}
# the prompts' prefill, timed on 2 rows of PROMPT_TOKENS: the maths prompts average 60 tokens
# rendered, 62 padded in prepare's length-sorted batches of 64. In fp32 on one AVX2 core a batch's
# prefill is a quarter of its regeneration; job 8, priced without it (and at 0.69), took 1.38 s an
# answer against 0.66
PROMPT_TOKENS = 64
CAPTURE_COUNT = 3  # conversations per timed call of the feature step
# train.py's steps, over a whole job, against train_step's probe timed by in_rounds (the Zen 4,
# 2026-12-04): 0.98 (a job's 0.379 s, steps 30-1,428 less its evaluations, against 0.374 and 0.400
# read beside it), 0.87 (job 6: 2,781 steps in 1,063 s with its evaluations, 0.382, against its
# replan's 0.44). train.py's first 200 steps run at 0.47-0.53 and the rest at 0.31-0.42, and the
# probe reads about the first (0.41-0.45, three tries, against 0.40-0.53 for train.py's first 250
# steps beside them). (1.16 before in_rounds made an untimed call per round, against probes read
# 0.61-0.87 s in the jobs; those jobs then trained at 0.36-0.39 and ended 15-20 min early.)
# Since job 14 it sizes the answers (the first plan) and the length train.py starts from; train.py
# --max-seconds then fits the steps to the time priced here (the ratio ran 1.31 on both cores held
# to AVX2, 0.69 on a real Zen 1: docs/cpu.md)
TRAIN_RATIO = 0.9
LOAD_S = 50  # loading the target five times (plan, prepare twice, train, served), the export
# of the budget: a shared VM's speed drifts by a tenth within one job (README, Your machine), and
# on the AMD EPYC of docs/cpu.md its probes read up to 30% apart minutes apart: 92%
# keeps a job that runs 8% over its plan inside the budget (one planned to 44 of 45 minutes once
# took 44.8)
AIM = 0.92

# ------------------------------------------------------------------------ the learning curve
# (answers, epochs, held-out tau of the selector path, where): bash run.sh's recipe (32 anchors,
# block 8, lr 1e-3 cosine), teacher-forced on the first 48 GSM8K test questions
CURVE = [
    (2400, 2, 2.037, "AMD EPYC, avx512_bf16"),
    (2400, 1, 1.856, "AMD EPYC, avx512_bf16, --epochs 1"),
    (2400, 4, 2.304, "AMD EPYC, avx512_bf16, --epochs 4"),
    (1800, 2, 1.889, "AMD EPYC, avx512_bf16"),
    (1000, 2, 1.860, "AMD EPYC, avx512_bf16 (Zen 4), a fresh clone's bash run.sh"),
    (1100, 2, 1.878, "AMD EPYC, avx512_bf16 (Zen 4), a fresh clone's bash run.sh"),
    (1200, 2.47, 1.903, "AMD EPYC, avx512_bf16 (Zen 4), a fresh clone's bash run.sh (job 4)"),
    (1000, 1.428, 1.790, "AMD EPYC, avx512_bf16 (Zen 4), a fresh clone's bash run.sh (job 5)"),
    (1000, 2.781, 1.882, "AMD EPYC, avx512_bf16 (Zen 4), a fresh clone's bash run.sh (job 6)"),
    (1200, 2.054, 1.906, "AMD EPYC, avx512_bf16 (Zen 4), a fresh clone's bash run.sh (job 7)"),
    (1500, 1.700, 1.876, "AMD EPYC, avx512_bf16 (Zen 4), a fresh clone's bash run.sh (job 14)"),
    (1500, 1.960, 1.919, "AMD EPYC, avx512_bf16 (Zen 4), a fresh clone's bash run.sh (job 17)"),
    (600, 2.290, 1.738, "AMD EPYC Zen 4, both cores held to AVX2, BUDGET_MIN=30 (job 15)"),
    (450, 1.473, 1.684, "AMD EPYC Zen 4, one core held to AVX2, BUDGET_MIN=30 (job 16)"),
    (
        800,
        1.531,
        1.780,
        "AMD EPYC Zen 3, AVX2 only, both cores, a fresh clone's bash run.sh (job 19)",
    ),
    (290, 1.731, 1.629, "AMD EPYC Zen 3, AVX2 only, one core, BUDGET_MIN=30 (job 20)"),
    (800, 2.068, 1.773, "AMD EPYC Zen 3, AVX2 only, a fresh clone's bash run.sh (job 21)"),
    (2400, 2, 1.956, "Xeon AMX, one thread beside other work"),
    (2300, 2, 1.984, "Xeon AMX"),
    (1500, 2, 1.896, "Xeon AMX"),
    (1400, 2, 1.894, "Xeon AMX"),
    (400, 2, 1.716, "Xeon AMX, BUDGET_MIN=15"),
    (600, 2, 1.734, "Xeon, emulated AVX2 (two variables)"),
    (500, 2, 1.751, "Xeon, emulated AVX2 (four caps), stock GEMMs"),
    (500, 2, 1.745, "Xeon, emulated AVX2 (four caps)"),
    (200, 2, 1.509, "Xeon, emulated AVX2, one thread beside other work"),
    (200, 2, 1.527, "AMD EPYC Zen 1, AVX2 only (issue 36)"),
]
# The recipe's other choices stay fixed: trained at equal wall time on an AVX2-only Zen 1 (250
# answers x 2 epochs' worth), 16 anchors, one or two layers, 96-token answers and a third epoch all
# landed within 0.03 of the mean of the recipe's two seeds (1.630, 1.651), and one epoch over more
# answers 0.05 under it (docs/cpu.md, "Findings")

# fewer effective steps than 150 answers twice: not worth a budget
MIN_STEPS = 300
# the plain DFlash baseline's tau over DFlash2's selector path on the same data (0.88-0.94 in
# docs/cpu.md)
DFLASH_RATIO = 0.90

# ------------------------------------------------------------------------------ the fixed costs
N_EVAL_FULL, N_EVAL_MIN, HELD_OUT_SHARE = 48, 16, 0.02
SERVED_FULL, SERVED_MIN, SERVED_SHARE = (16, 160), (4, 64), 0.09
# the two shapes served, at a typical main job's served tau on each. The path of B-1 drafts: 1.87
# and 1.76 native, 1.71 on a Zen 1, 1.63 on one core held to AVX2; the weakest ever, issue 36's,
# 1.45. Auto's shape (a tree): 2.12 and 1.94 native (jobs 7 and 9), 1.88 and 1.92 on one core held
# to AVX2 (jobs 8 and 10). Priced at the path's tau both (1.7), those four jobs' served phases came
# in 7%, 17%, -3% and 15% under their plans (docs/cpu.md); priced so, job 11's
# (both cores held to AVX2, tree tau 1.91) came in 3% under
SERVED_TAU = {"path": 1.7, "tree": 1.95}
# a cycle's draft and its bookkeeping, in plain target steps: what five jobs' served paths took a
# cycle (the phase's seconds on the path over its cycles, prefills and bookkeeping inside) less the
# replan's verify probe, over its plain step: 0.47 and 0.37 natively on both cores (jobs 7 and 9),
# 0.17 and 0.21 held to AVX2 on one core and on both (jobs 10 and 11), 0.10 natively on one core
# (job 12); the Zen 4, 2026-12-04. Part of it is not the draft: --fast serves in the layout it
# measured fastest, which the probe's verify does not take. At their mean, 0.26, those five served
# phases would have come within 12% of their plans (an in-sample estimate; at 0.45 they came in
# -7% to -17%); job 15 on are priced so
DRAFT_SHARE = 0.25
# the embedded target's greedy answers to the held-out questions, by domain: the 48 GSM8K ones
# average 141 tokens, none cut at 160 (the same on every machine: greedy; the first 11, 137). Priced
# at full length before they are made, job 6's served phase came in 19% under its plan.
ANSWER_TOKENS = {"math": 141}
SERVED_LOAD_S = 15  # loading the target and the draft, the draft's head rows: 12-16 s here
DECODE_CONTEXT = 200  # speed/cost.py's decode table: its context
# an evaluation of N_EVAL answers (~ N_EVAL / 3 steps) every EVAL_INTERVAL steps, as 48 every 600
EVAL_SHARE = 16 / 600


# ------------------------------------------------------------------------- the curve, as a rule
def free_epochs(n: int) -> float:
    """Epochs over n answers that train as well as fresh answers would: 2 up to 1,200 answers (e2
    against d1 in docs/cpu.md), 4 at 2,400 (the longer recipe there), linear
    between."""
    return min(4.0, max(2.0, n / 600))


def effective_steps(n: int, epochs: int) -> float:
    return n * min(epochs, free_epochs(n))


def fit_curve(points=CURVE) -> tuple:
    """(a, b) of tau = a + b ln(effective steps), least squares over the points."""
    xs = [math.log(effective_steps(n, e)) for n, e, _, _ in points]
    ys = [tau for _, _, tau, _ in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


A, B = fit_curve()


def expected_tau(n: int, epochs: int, dflash: bool = False) -> float:
    """The held-out tau the curve expects of n answers x epochs (residuals of the fit: 0.05 rms)."""
    tau = A + B * math.log(max(1.0, effective_steps(n, epochs)))
    return max(1.0, tau * (DFLASH_RATIO if dflash else 1.0))


# -------------------------------------------------------------------------------- the sizing
class Costs(NamedTuple):
    """What the probes measured, in seconds (None: not measured, because N_TRAIN / --epochs made
    it unnecessary). The sizing below is a function of these numbers alone, so a slow CPU can be
    planned for on a fast one."""

    spent: float  # the measurement itself
    t_step: Optional[float]  # one training step
    t_batch64: Optional[float]  # one generate step of 64 rows (the training answers)
    t_batch16: Optional[float]  # one of 16 rows (the held-out batch at its smallest)
    t_capture: Optional[float]  # prepare.py's feature step, per conversation
    served_fixed: float  # the served evaluation's part that does not scale with prompts x tokens
    served_token: float  # a served prompt-token, all shapes together
    layouts: float = 0.0  # prepare.py's one-off layout measurement, if it must make one
    have: int = 0  # training answers already made
    eval_have: int = 0  # held-out answers already made
    # their lengths in tokens, in the order served.py takes them (empty: not made yet); served
    # decoding is greedy and lossless, so it commits these answers again, up to --served-tokens
    answer_lengths: tuple = ()
    answer_tokens: Optional[float] = None  # until they are made: their mean, where known
    t_prompt: float = 0.0  # the prefill of one prompt in a regeneration batch


def t_answer(c: Costs) -> float:
    return c.t_prompt + REGEN_STEPS / 64 * c.t_batch64 + c.t_capture


def held_out_s(c: Costs, n_eval: int) -> float:
    """One regeneration batch of n_eval rows (its prefill, its step interpolated between 16 and 64
    rows) and n_eval feature steps; nothing if the set is made."""
    if c.eval_have >= n_eval:
        return 0.0
    rows = min(n_eval, 64)
    step = c.t_batch16 + (c.t_batch64 - c.t_batch16) * max(0, rows - 16) / 48
    return REGEN_STEPS * step + (n_eval - c.eval_have) * (c.t_prompt + c.t_capture)


def served_s(c: Costs, samples: int, tokens: int) -> float:
    """The served evaluation: its fixed part, and each prompt's answer on every shape: the
    held-out answers' own lengths once made; before, their known mean (ANSWER_TOKENS), else all
    of `tokens` (an answer may stop sooner)."""
    if not samples:
        return 0.0
    known = c.answer_lengths[:samples] if len(c.answer_lengths) >= samples else None
    each = min(tokens, c.answer_tokens or tokens)
    committed = sum(min(n, tokens) for n in known) if known else samples * each
    return c.served_fixed + committed * c.served_token


def eval_interval(n_eval: int) -> int:
    """Steps between evaluations so that they cost EVAL_SHARE of training: 600 for 48 answers."""
    return max(1, round(n_eval / 3 / EVAL_SHARE))


class Fixed(NamedTuple):
    n_eval: int
    served_samples: int
    served_tokens: int
    eval_interval: int
    shrunk: list  # what was made smaller than the full size, in words


def size_fixed(c: Costs, budget_s: float, n_eval=None, served=(None, None)) -> Fixed:
    """The held-out set, the served evaluation and the evaluation interval, each at its full size
    or the largest within its share of the budget (given ones kept)."""
    shrunk = []
    if n_eval is None:
        n_eval = N_EVAL_FULL
        if c.t_capture is not None and c.eval_have < N_EVAL_FULL:
            while n_eval > N_EVAL_MIN and held_out_s(c, n_eval) > HELD_OUT_SHARE * budget_s:
                n_eval -= 8
        if n_eval < N_EVAL_FULL:
            shrunk.append(f"held-out {n_eval} of {N_EVAL_FULL} answers")
    samples, tokens = served
    if samples is None or tokens is None:
        share = SERVED_SHARE * budget_s
        p = SERVED_FULL[0] if samples is None else samples
        t = SERVED_FULL[1] if tokens is None else tokens
        while samples is None and p > SERVED_MIN[0] and served_s(c, p, t) > share:
            p -= 1
        while tokens is None and t > SERVED_MIN[1] and served_s(c, p, t) > share:
            t -= 16
        if samples is None and served_s(c, p, t) > share:
            shrunk.append(
                f"served evaluation off ({p} prompts x {t} tokens would take "
                f"{served_s(c, p, t) / 60:.1f} min)"
            )
            p = 0
        elif (p, t) != SERVED_FULL:
            shrunk.append(f"served {p} of {SERVED_FULL[0]} prompts x {t} tokens")
        samples, tokens = p, t
    interval = eval_interval(n_eval)
    if interval != eval_interval(N_EVAL_FULL):
        shrunk.append(f"an evaluation every {interval} steps")
    return Fixed(n_eval, samples, tokens, interval, shrunk)


def evaluation_s(c: Costs, f: Fixed) -> float:
    """One evaluation during training: the held-out sequences, each at a fraction of a step
    (train.py prices one it has not yet timed the same way)."""
    return f.n_eval * c.t_step * timefit.EVAL_STEPS_PER_SEQUENCE


def job_seconds(c: Costs, n: int, epochs: int, f: Fixed) -> dict:
    """T(N, E) above, by part, in seconds (parts not measured are left out)."""
    steps = n * epochs
    parts = {
        "measuring": c.spent,
        "loading": LOAD_S,
        "layouts": c.layouts if n > c.have or f.n_eval > c.eval_have else 0.0,
        "held-out": held_out_s(c, f.n_eval) if c.t_capture is not None else 0.0,
        "served": served_s(c, f.served_samples, f.served_tokens),
    }
    if c.t_batch64 is not None:
        parts["answers"] = max(0, n - c.have) * t_answer(c)
    if c.t_step is not None:
        parts["training"] = steps * c.t_step
        parts["evaluations"] = (steps // f.eval_interval + 1) * evaluation_s(c, f)
    return parts


def steps_that_fit(c: Costs, n: int, f: Fixed, seconds_left: float) -> int:
    """The plan again, before training: the most steps over the n answers prepare made whose
    training, evaluations and served evaluation (with this measurement and the loading) fit
    seconds_left, what the budget's AIM leaves after the time the job has already taken. A shared
    VM's speed drifts between the first plan and training, and prepare's time is known by then:
    the job keeps its budget whatever the first plan's probes read."""
    fixed = c.spent + LOAD_S + served_s(c, f.served_samples, f.served_tokens)
    return timefit.total_that_fits(
        0, seconds_left - fixed, c.t_step, evaluation_s(c, f), f.eval_interval
    )


def sizes(most: int, have: int) -> list:
    """The answer counts the plan considers: tens below 500, fifties below 1,000, then hundreds,
    up to the most, and the answers already made."""
    grid = [*range(10, 500, 10), *range(500, 1000, 50), *range(1000, most, 100), most, have]
    return sorted({n for n in grid if 0 < n <= most})


class Plan(NamedTuple):
    n: int
    epochs: int
    fixed: Fixed
    seconds: dict
    tau: float
    why: str


def best_plan(c: Costs, budget_min: float, most, epochs, n_eval, served, dflash) -> Optional[Plan]:
    """The (N, E) with the highest expected tau (then the shortest job) among those of at least
    MIN_STEPS effective steps whose T(N, E) fits AIM of the budget; None if none does."""
    budget_s = 60 * budget_min
    f = size_fixed(c, budget_s, n_eval, served)
    best = None
    for e in [epochs] if epochs else [1, 2, 3, 4]:
        for k in sizes(most, c.have):
            seconds = job_seconds(c, k, e, f)
            if effective_steps(k, e) < MIN_STEPS or sum(seconds.values()) > AIM * budget_s:
                continue
            key = (round(expected_tau(k, e, dflash), 3), -sum(seconds.values()))
            if best is None or key > best[0]:
                spare = f"fits {budget_min:g} min, {100 - 100 * AIM:.0f}% spare"
                why = "the recipe's answers" if k == most else spare
                best = key, Plan(k, e, f, seconds, expected_tau(k, e, dflash), why)
    return best and best[1]


def choose(
    c: Costs,
    budget_min: float,
    most: int = 2400,
    n=None,
    epochs=None,
    n_eval=None,
    served=(None, None),
    dflash=False,
) -> Plan:
    """The plan: N_TRAIN (and --epochs, else the recipe's 2) as given, else best_plan. A
    ValueError if no job fits: its one line names the smallest budget, in fives of minutes, that
    holds one here, and what that job would give."""
    if n is not None:
        e = epochs or 2
        f = size_fixed(c, 60 * budget_min, n_eval, served)
        why = "N_TRAIN and --epochs given" if epochs else "N_TRAIN given"
        return Plan(n, e, f, job_seconds(c, n, e, f), expected_tau(n, e, dflash), why)
    plan = best_plan(c, budget_min, most, epochs, n_eval, served, dflash)
    if plan:
        return plan
    start = 5 * math.ceil(budget_min / 5 + 1e-9)
    for minutes in range(start, 24 * 60 + 1, 5):
        p = best_plan(c, minutes, most, epochs, n_eval, served, dflash)
        if p:
            raise ValueError(
                f"BUDGET_MIN={budget_min:g} cannot hold a useful job on this machine (at least "
                f"{MIN_STEPS} steps, as {MIN_STEPS // 2} answers x 2 epochs): BUDGET_MIN={minutes}"
                f" would, with {p.n} answers x {p.epochs} epochs, for a held-out tau of about "
                f"{p.tau:.2f}"
            )
    raise ValueError(f"BUDGET_MIN={budget_min:g} cannot hold a useful job here, nor can a day")


# ------------------------------------------------------------------------------- the probes
# Each probe is a function that runs its piece of the job once; in_rounds times them all.
@torch.no_grad()
def forward_step(target, rows: int, tokens: int, context: int):
    """One target forward of `tokens` new tokens in `rows` rows after `context` cached ones, the
    cache filled with random keys and values: a forward's cost does not depend on them, and no
    prefill of rows x context tokens is paid (on a slow CPU that prefill cost a minute). Each call
    crops the cache back, so every call sees the same context."""
    cfg, p = target.config, next(target.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (rows, cfg.num_key_value_heads, context, head_dim)
    cache = new_cache(target)
    for layer in range(cfg.num_hidden_layers):
        cache.update(torch.randn(shape, dtype=p.dtype), torch.randn(shape, dtype=p.dtype), layer)
    block = torch.randint(0, cfg.vocab_size, (rows, tokens))

    @torch.no_grad()
    def step():
        target(input_ids=block, **with_cache(target, cache))
        crop(cache, context)

    return step


def train_step(cfg_args: list, target, warm: int = 3):
    """One step of train.py's own train_step (objective, backward, clipping, metrics, fused AdamW
    and its schedule) on one random conversation of the maths answers' mean shape (180 tokens, 117
    supervised, bf16 features as prepare.py stores them) with 32 anchors. A fresh draft's first
    steps run slow (allocation, oneDNN's kernels for new shapes; timed, two of them read 0.58 s in a
    job whose 2,000 steps then ran at 0.32): `warm` steps are run here, untimed."""
    args = train.parse_args(
        ["--data", "-", "--num-anchors", "32", "--attention", "sdpa", *cfg_args]
    )
    cfg = train.build_config(args)
    torch.manual_seed(0)
    draft = model.DraftModel(cfg)
    weights = [
        m.weight.detach().float()
        for m in (target.get_input_embeddings(), target.get_output_embeddings())
    ]
    objective = train.DraftObjective(draft, *weights, train.loss_config(args), args.attention)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt, sched = train.build_optimizer(params, args, total=1000)
    n = 180
    sample = {
        "input_ids": torch.randint(0, cfg.vocab_size, (n,)),
        "loss_mask": (torch.arange(n) >= n - 117).long(),
        "features": torch.randn(n, len(cfg.target_layer_ids) * cfg.hidden_size).bfloat16(),
    }
    batch = data.collate([[sample]], [0], args.num_anchors, 0, "cpu")
    bf16 = machine.resolve_dtype("auto", "cpu", "train") == torch.bfloat16
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)  # noqa: E731
    alpha = 0.5 if cfg.dflash2 else None

    def step():
        train.train_step(
            objective, opt, sched, params, [batch], alpha, args, 1, contextlib.nullcontext, autocast
        )

    for _ in range(warm):
        step()
    return step


def capture_step(target, tokenizer, layer_ids, folder: str, n: int = CAPTURE_COUNT):
    """prepare.py's feature step on n conversations (CAPTURE_CONVERSATION), one shard, written to a
    new folder under `folder` on each call; its progress bars are not shown."""
    calls = []

    def step():
        calls.append(None)
        out = os.path.join(folder, str(len(calls)))
        os.makedirs(out)
        with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):
            prepare.write_features(
                target,
                tokenizer,
                [CAPTURE_CONVERSATION] * n,
                out,
                layer_ids,
                save_target_hidden=True,
            )

    return step


def in_rounds(probes: dict, rounds: int = 3, repeats: int = 2) -> dict:
    """{name: a function that runs it once} -> {name: its median seconds a call}. Round after
    round, every probe in turn: one untimed call, then `repeats` timed ones; each median is taken
    over the whole measurement, not one burst. A shared VM's speed drifts over seconds: a fixed GEMM
    timed for 40 s on the AMD EPYC of docs/cpu.md read 1.0 to 1.6 times its fastest.
    The untimed call is there because a probe's first call after another probe's runs slow: the
    training step timed right after the target's forwards read 0.43-0.79 s (median of 6, 2 tries)
    where it read 0.35 in a burst of its own, and 0.37-0.40 with the untimed call (the Zen 4 of
    docs/cpu.md, 2026-12-04); train.py, which runs nothing in between, took 0.39."""
    times = {name: [] for name in probes}
    for _ in range(rounds):
        for name, step in probes.items():
            step()
            for _ in range(repeats):
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def served_costs(t_1: float, t_verify: float, t_prefill: float, layouts: int, sizes: int) -> tuple:
    """(fixed s, s per prompt-token over all shapes) of tools/served.py's evaluation, from a plain
    step t_1, a verify of a block t_verify and a DECODE_CONTEXT-token prefill t_prefill: a cycle of
    either shape costs a verify and the draft and commits that shape's SERVED_TAU tokens; the decode
    table times `sizes` verify sizes in every layout, each after a prefill, over 8 forwards of about
    a verify each."""
    cycle = t_verify + DRAFT_SHARE * t_1
    per_token = sum(cycle / tau for tau in SERVED_TAU.values())
    table = layouts * sizes * (t_prefill + 8 * t_verify)
    return SERVED_LOAD_S + table, per_token


def must_measure_layout(dtype) -> bool:
    """Whether machine.py's rule would measure the layouts for this dtype here (it settles bf16
    and one-layout machines without measuring)."""

    class Measuring(Exception):
        pass

    def measure():
        raise Measuring

    try:
        machine.choose_layout(dtype, torch.device("cpu"), "auto", measure)
    except Measuring:
        return True
    return False


def answers_made(data_dir: str) -> int:
    """Answers already made (regenerated, then captured) in the data folder of an earlier run."""
    try:
        with open(os.path.join(data_dir, "conversations.jsonl"), encoding="utf-8") as f:
            return (
                sum(1 for _ in f) if os.path.isfile(os.path.join(data_dir, "manifest.json")) else 0
            )
    except OSError:
        return 0


def answer_lengths(data_dir: str) -> tuple:
    """The tokens of each answer prepare.py regenerated into data_dir, in the data's order (by
    index); () where it holds none."""
    done = regen.read_regenerated(data_dir) if os.path.isdir(data_dir) else {}
    return tuple(len(done[i]["messages"][-1]["token_ids"]) for i in sorted(done))


def measure(args) -> tuple:
    """-> (Costs, the probes' line)."""
    t0 = time.perf_counter()
    have = answers_made(args.data) if args.data else 0
    eval_have = answers_made(args.eval_data) if args.eval_data else 0
    data_dtype = machine.resolve_dtype("auto", "cpu", "data")
    decode_dtype = machine.resolve_dtype("auto", "cpu", "decode")
    need_data = args.num_samples is None
    need_step = not (args.num_samples and args.epochs)
    config = load_config(args.draft_config)
    probes, measuring = {}, False
    tmp = tempfile.TemporaryDirectory()
    target = None
    if need_data or need_step:
        target, tokenizer = load_target(None, data_dtype)
    if need_data:
        # prepare's layout: set here where the rule needs no measurement, else priced below and
        # left to prepare (these probes then run in the stock layout, the slowest of the choices)
        measuring = must_measure_layout(data_dtype) and not machine.is_cached(cost.data_key(target))
        if not measuring:
            tune.data_target(target, data_dtype, "auto")
        probes["batch64"] = forward_step(target, 64, 1, REGEN_CONTEXT)
        probes["batch16"] = forward_step(target, 16, 1, REGEN_CONTEXT)
        probes["capture"] = capture_step(target, tokenizer, config.target_layer_ids, tmp.name)
        probes["prompt"] = forward_step(target, 2, PROMPT_TOKENS, 0)
        if measuring:
            probes["prefill256"] = forward_step(target, 1, 256, 0)
    if need_step:
        cfg_args = ["--draft-config", args.draft_config] + (["--dflash"] if args.dflash else [])
        probes["train"] = train_step(cfg_args, target)
    decoder = target
    sizes = priced_sizes(config.block_size)
    if target is None or decode_dtype != data_dtype:
        decoder, _ = load_target(None, decode_dtype)
        if machine.is_cached(cost.decode_key(decoder, sizes)):  # the layout served --fast takes
            sums = cost.verify_sums(cost.decode_table(decoder, sizes), config.block_size)
            set_layout(decoder, min(sums, key=sums.get))
    probes["plain"] = forward_step(decoder, 1, 1, REGEN_CONTEXT)
    probes["verify"] = forward_step(decoder, 1, config.block_size, REGEN_CONTEXT)
    probes["prefill"] = forward_step(decoder, 1, DECODE_CONTEXT, 0)
    s = in_rounds(probes)
    tmp.cleanup()
    for m in {id(m): m for m in (target, decoder) if m is not None}.values():
        drop_packs(m)  # MKL's packs for the probes' rows: a copy of the weights each

    words = []
    t_step = t_batch64 = t_batch16 = t_capture = None
    layouts = t_prompt = 0.0
    if need_data:
        ratio = REGEN_RATIO[data_dtype]
        t_batch64, t_batch16 = ratio * s["batch64"], ratio * s["batch16"]
        t_prompt = s["prompt"] / 2
        t_capture = s["capture"] / CAPTURE_COUNT
        if measuring:
            count = len(machine.layouts_here(data_dtype, torch.device("cpu")))
            # data_costs per layout: a prefill of 64 x 128 tokens (about 96 steps of 64 rows: it
            # took 372 s for 3 layouts where a step of 64 rows was 1.16 s and a prefill of 256
            # tokens 3.0 s, one core held to AVX2, docs/cpu.md), 4 steps, 4 such prefills
            layouts = count * (100 * s["batch64"] + 4 * s["prefill256"])
        regen = t_prompt + REGEN_STEPS / 64 * t_batch64
        words.append(
            f"one answer {regen + t_capture:.2f} s (regeneration {regen:.2f}, its prompt "
            f"{t_prompt:.2f}; + features {t_capture:.2f})"
        )
        if layouts:
            words.append(f"prepare's layout choice about {layouts / 60:.1f} min, once")
    if need_step:
        t_step = TRAIN_RATIO * s["train"]
        words.append(f"one training step {t_step:.2f} s")
    # the served evaluation's decode table, measured once per machine where the rule must measure
    table = must_measure_layout(decode_dtype)
    table = table and not machine.is_cached(cost.decode_key(decoder, sizes))
    count = len(machine.layouts_here(decode_dtype, torch.device("cpu"))) if table else 0
    served_fixed, served_token = served_costs(
        s["plain"], s["verify"], s["prefill"], count, len(sizes)
    )
    words.append(
        f"a served token {1000 * s['plain']:.0f} ms plain, {1000 * s['verify']:.0f} ms a verify"
    )
    spent = time.perf_counter() - t0
    line = f"{machine.describe('cpu')}; measured in {spent:.0f} s: " + ", ".join(words)
    c = Costs(
        spent,
        t_step,
        t_batch64,
        t_batch16,
        t_capture,
        served_fixed,
        served_token,
        layouts,
        have,
        eval_have,
        answer_lengths(args.eval_data) if eval_have else (),
        ANSWER_TOKENS.get(args.domain),
        t_prompt,
    )
    return c, line


def plan_lines(p: Plan, budget_min: float, domain: str, served_token: float) -> tuple:
    """The plan in words (stderr) and the KEY=value lines run.sh reads (stdout), among them
    the served token's price, which the plan before training compares with its own reading."""
    total = sum(p.seconds.values())
    parts = ", ".join(f"{k} {v / 60:.1f}" for k, v in p.seconds.items() if v)
    if "answers" not in p.seconds:
        parts += "; the data not measured"
    tau = f"{p.tau:.2f}" if domain == "math" else ""
    said = [
        f"[plan] this machine: {p.n} answers ({p.why}) x {p.epochs} epoch"
        f"{'s' if p.epochs > 1 else ''} = {p.n * p.epochs} "
        f"steps, about {total / 60:.0f} min of {budget_min:g} ({parts})",
        f"[plan] expected held-out tau about {tau} (the learning curve in tools/plan.py, +-0.05)"
        if tau
        else "[plan] expected tau: no learning curve measured for this domain",
        "[plan] fixed costs at full size"
        if not p.fixed.shrunk
        else "[plan] sized to the budget: " + "; ".join(p.fixed.shrunk),
    ]
    if "training" in p.seconds and total > 60 * budget_min:
        said.append(
            f"[plan] warning: {p.n} answers take about {total / 60:.0f} min here, over the "
            f"budget of {budget_min:g}"
        )
    f = p.fixed
    out = [
        f"N_TRAIN={p.n}",
        f"EPOCHS={p.epochs}",
        f"N_EVAL={f.n_eval}",
        f"SERVED_SAMPLES={f.served_samples}",
        f"SERVED_TOKENS={f.served_tokens}",
        f"EVAL_INTERVAL={f.eval_interval}",
        f"EXPECTED_TAU={tau}",
        f"PLANNED_MIN={total / 60:.1f}",
        f"SERVED_TOKEN_S={served_token:.5f}",
    ]
    return said, out


def training_lines(c: Costs, args) -> list:
    """The plan again before training: MAX_STEPS, TRAIN_S (train.py's --max-seconds: the time its
    steps and evaluations were priced at, which it then fits its steps to; empty where the steps
    are given or are one epoch whatever the time) and the expected tau, for run.sh (stdout); its
    line to stderr."""
    n, budget_s, seconds = args.num_samples, 60 * args.budget_min, ""
    if args.epochs:  # given: kept
        steps = n * args.epochs
    else:
        f = size_fixed(c, budget_s, args.n_eval, (args.served_samples, args.served_tokens))
        left = AIM * budget_s - args.elapsed_s
        steps = steps_that_fit(c, n, f, left)
        fitted = steps >= n  # else one epoch all the same, whatever its time
        if not fitted:
            print(
                f"[plan] warning: {left / 60:.1f} min are left of the budget's {100 * AIM:.0f}%,"
                f" {steps} steps; training one epoch ({n} steps) all the same",
                file=sys.stderr,
            )
            steps = n
        priced = job_seconds(c, n, steps / n, f)
        minutes = (priced["training"] + priced["evaluations"]) / 60
        seconds = f"{60 * minutes:.0f}" if fitted else ""
        print(
            f"[plan] again before training, {args.elapsed_s / 60:.1f} min into the job: {steps} "
            f"steps ({steps / n:.2f} epochs over {n} answers), about {minutes:.1f} min of training"
            f" and {priced['served'] / 60:.1f} min served",
            file=sys.stderr,
        )
    tau = f"{expected_tau(n, steps / n, args.dflash):.2f}" if args.domain == "math" else ""
    return [f"MAX_STEPS={steps}", f"TRAIN_S={seconds}", f"EXPECTED_TAU={tau}"]


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--budget-min",
        type=bounded(float, above=0.0),
        default=45.0,
        help="the whole job, in minutes",
    )
    p.add_argument(
        "--num-samples", type=bounded(int, low=1), default=None, help="N_TRAIN given: keep it"
    )
    p.add_argument(
        "--max-samples",
        type=bounded(int, low=1),
        default=2400,
        help="the recipe's answers, at most",
    )
    p.add_argument(
        "--epochs", type=bounded(int, low=1), default=None, help="given: keep it; else chosen"
    )
    p.add_argument("--n-eval", type=bounded(int, low=1), default=None, help="N_EVAL given")
    p.add_argument("--served-samples", type=bounded(int, low=0), default=None)
    p.add_argument("--served-tokens", type=bounded(int, low=1), default=None)
    p.add_argument(
        "--data", default=None, help="the training data folder (answers already there are free)"
    )
    p.add_argument("--eval-data", default=None, help="the held-out data folder (likewise)")
    p.add_argument("--draft-config", default="configs/smollm2-135m-dflash2.json")
    p.add_argument(
        "--dflash", action="store_true", help="plan the plain DFlash baseline's (cheaper) steps"
    )
    p.add_argument("--domain", choices=["math", "general"], default="math")
    p.add_argument(
        "--elapsed-s",
        type=bounded(float, low=0.0),
        default=None,
        help="plan again before training (--num-samples made): the job has run this long",
    )
    p.add_argument(
        "--served-token-s",
        type=bounded(float, above=0.0),
        default=None,
        help="with --elapsed-s: the first plan's SERVED_TOKEN_S; the lower reading prices served",
    )
    args = p.parse_args(argv)
    if args.elapsed_s is not None and args.num_samples is None:
        raise ValueError("--elapsed-s plans the training of answers made: give --num-samples")

    c, line = measure(args)
    print(f"[plan] {line}", file=sys.stderr)
    if args.elapsed_s is not None:
        # a shared VM runs slow in bursts that outlast a measurement: of the two readings of a
        # served token, minutes apart, the lower is the nearer to its speed. Job 14's replan read
        # a verify 86 ms where its first plan read 74; the served path then ran 88 ms a cycle,
        # the draft and bookkeeping inside (docs/cpu.md)
        c = c._replace(served_token=min(c.served_token, args.served_token_s or c.served_token))
        print("\n".join(training_lines(c, args)))
        return
    plan = choose(
        c,
        args.budget_min,
        args.max_samples,
        args.num_samples,
        args.epochs,
        args.n_eval,
        (args.served_samples, args.served_tokens),
        args.dflash,
    )
    said, out = plan_lines(plan, args.budget_min, args.domain, c.served_token)
    print("\n".join(said), file=sys.stderr)
    print("\n".join(out))


if __name__ == "__main__":
    run(main)
