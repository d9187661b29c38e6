"""Sizing the main job to this machine: measure it for about a minute, then choose how many answers
to make and train on, so that `bash run.sh` ends within its budget on a fast CPU and on a slow one.

    python tools/plan.py --budget-min 45      # prints the plan, then N_TRAIN=... for run.sh to read

The same job costs 16x more on a CPU without native bf16 (README, "Your machine"). Its time is

    T(N) = spent + LOAD_S + (N - have) * t_answer + held_out + N * epochs * t_step + evaluations
           + served

    t_answer     one on-policy answer and its features: regeneration decodes batches of 64 rows,
                 and every batch of the maths set ran all 160 steps (some answer in each is cut
                 there), so 160 / 64 batch steps per answer, plus prepare.py's feature step for one
                 conversation, run as prepare runs it (tokenize, forward with hooks, cast, check,
                 write the shard) on 8 conversations of about 200 tokens: the forward alone missed
                 a third of it where bf16 is fast
    held_out     the 48 held-out answers: one batch of 160 steps and 48 feature steps (unless made)
    t_step       one training step (one answer, 32 anchors), in the precision train.py picks here
    evaluations  one every 600 steps and one at the end, 48 answers each, forward only
                 (~ t_step / 3 each)
    served       the final evaluation's served tau (train.py --served-samples, served.py): 16
                 held-out prompts decoded for up to 160 tokens each, twice (the path of B-1 drafts
                 and auto's shape), at about one plain decoding step of the fp32 target per token
                 (speculation here is within 0.9-1.2x of plain), plus SERVED_FIXED for loading the
                 target and timing the draft
    have         answers already made in the data folder (a rerun only trains)
    spent        this measurement itself (one to two minutes: part of the job)

all measured with the project's own code, in the phases' own precisions and layouts
(speed/machine.py). N is the largest whose T(N) is at most 95% of the budget (a native job planned
to 44 of 45 minutes took 44.8: its training steps ran 12% slower than measured), at most
--max-samples (the recipe's 2,400); epochs stay at 2 (a second pass over the data cost nothing in
the recipe study). An explicit N_TRAIN (--num-samples) or --epochs wins.
"""

import argparse
import contextlib
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

import data  # noqa: E402
import model  # noqa: E402
import prepare  # noqa: E402
import train  # noqa: E402
from common import bounded, run  # noqa: E402
from config import load_config  # noqa: E402
from speed import cost, machine, tune  # noqa: E402
from target import load_target  # noqa: E402

# decoding steps of a 64-row batch; its mean context (prompt + half an answer)
REGEN_STEPS, REGEN_CONTEXT = 160, 160
# ~200 tokens, as the maths answers measured (183 and 200 tokens on average, prompt included)
CAPTURE_CONVERSATION = [
    {"role": "user", "content": "How many apples are left at the end? " * 6},
    {"role": "assistant", "content": "She has 12 apples and gives 5 away, so 7 are left. " * 10},
]
LOAD_S = 40  # loading the target four times, the draft's export
SERVED_PROMPTS, SERVED_SHAPES, SERVED_FIXED = 16, 2, 30  # train.py's served evaluation
# below this the draft learns too little to be worth the budget: say so instead
MIN_SAMPLES = 200
# of the budget: a shared VM's speed drifts by a tenth within one job (README, Your machine)
AIM = 0.95


def train_step_s(cfg_args: list, target, repeats: int = 3) -> float:
    """Median seconds of one training step of the main recipe (train.py's objective, backward and
    fused AdamW) on one random 200-token conversation with 120 supervised tokens and 32 anchors."""
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
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-3, fused=True)
    n = 200
    sample = {
        "input_ids": torch.randint(0, cfg.vocab_size, (n,)),
        "loss_mask": (torch.arange(n) >= 80).long(),
        "features": torch.randn(n, len(cfg.target_layer_ids) * cfg.hidden_size),
    }
    batch = data.collate([[sample]], [0], args.num_anchors, 0, "cpu")
    bf16 = machine.resolve_dtype("auto", "cpu", "train") == torch.bfloat16

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = objective(batch, 0.5 if cfg.dflash2 else None)
            (out["numerator"] / out["denominator"]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return cost.median_ms(step, repeats) / 1000


def capture_s(target, tokenizer, layer_ids, n: int = 8) -> float:
    """Seconds of prepare.py's feature step per conversation (CAPTURE_CONVERSATION, n of them, one
    shard, written to a temporary folder after one of warm-up; its progress bars are not shown)."""
    with (
        tempfile.TemporaryDirectory() as tmp,
        open(os.devnull, "w") as quiet,
        contextlib.redirect_stderr(quiet),
    ):
        for name, count in (("warm", 1), ("timed", n)):
            folder = os.path.join(tmp, name)
            os.makedirs(folder)
            t0 = time.perf_counter()
            prepare.write_features(
                target,
                tokenizer,
                [CAPTURE_CONVERSATION] * count,
                folder,
                layer_ids,
                save_target_hidden=True,
            )
            seconds = time.perf_counter() - t0
    return seconds / n


def answers_made(data_dir: str) -> int:
    """Answers already made (regenerated, then captured) in the data folder of an earlier run."""
    try:
        with open(os.path.join(data_dir, "conversations.jsonl"), encoding="utf-8") as f:
            return (
                sum(1 for _ in f) if os.path.isfile(os.path.join(data_dir, "manifest.json")) else 0
            )
    except OSError:
        return 0


def job_minutes(
    n: int,
    have: int,
    epochs: int,
    t_answer: float,
    t_step: float,
    held_out: float,
    spent: float = 0.0,
    served: float = 0.0,
) -> float:
    """T(N) above, in minutes."""
    steps = n * epochs
    evaluations = (steps // 600 + 1) * 48 * t_step / 3
    fixed = spent + LOAD_S + held_out + served
    return (fixed + max(0, n - have) * t_answer + steps * t_step + evaluations) / 60


def choose_samples(minutes, budget: float, most: int, have: int, given=None) -> tuple:
    """(N, why): N_TRAIN if given; else the answers already made if they fit; else the most answers,
    in steps of 100 down to MIN_SAMPLES, whose job fits AIM of the budget (the rest is the
    estimate's margin)."""
    if given:
        return given, "N_TRAIN given"
    if have and minutes(have) <= AIM * budget:
        return have, f"the {have} answers already made"
    n = most
    while n > MIN_SAMPLES and minutes(n) > AIM * budget:
        n = max(MIN_SAMPLES, n - 100)
    return (
        n,
        f"the recipe's {n}"
        if n == most
        else f"fits {budget:g} min with {100 - 100 * AIM:.0f}% to spare",
    )


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
    p.add_argument("--epochs", type=bounded(int, low=1), default=2)
    p.add_argument(
        "--data", default=None, help="the training data folder (answers already there are free)"
    )
    p.add_argument("--draft-config", default="configs/smollm2-135m-dflash2.json")
    p.add_argument(
        "--dflash", action="store_true", help="plan the plain DFlash baseline's (cheaper) steps"
    )
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    dtype = machine.resolve_dtype("auto", "cpu", "data")
    target, tokenizer = load_target(None, dtype)
    # the layout prepare.py will use, measured if it must
    tune.data_target(target, dtype, "auto")
    t_batch = cost.target_ms(target, REGEN_CONTEXT, 1, 3, rows=64) / 1000
    t_capture = capture_s(target, tokenizer, load_config(args.draft_config).target_layer_ids)
    t_answer = REGEN_STEPS / 64 * t_batch + t_capture
    cfg_args = ["--draft-config", args.draft_config] + (["--dflash"] if args.dflash else [])
    t_step = train_step_s(cfg_args, target)
    have = answers_made(args.data) if args.data else 0
    held_out = 0 if have else REGEN_STEPS * t_batch + 48 * t_capture
    serving, _ = load_target(None, machine.resolve_dtype("auto", "cpu", "decode"))
    t_token = cost.target_ms(serving, REGEN_CONTEXT, 1, 3) / 1000
    served = SERVED_PROMPTS * SERVED_SHAPES * REGEN_STEPS * t_token + SERVED_FIXED
    spent = time.perf_counter() - t0
    minutes = lambda n: job_minutes(n, have, args.epochs, t_answer, t_step, held_out, spent, served)
    n, why = choose_samples(minutes, args.budget_min, args.max_samples, have, args.num_samples)
    print(
        f"[plan] {machine.describe('cpu')}; measured in {spent:.0f} s: one answer {t_answer:.2f} s "
        f"(regeneration {t_answer - t_capture:.2f} + features {t_capture:.2f}), one training step "
        f"{t_step:.2f} s, the served evaluation {served / 60:.1f} min",
        file=sys.stderr,
    )
    print(
        f"[plan] this machine: {n} answers ({why}), {args.epochs} epochs = {n * args.epochs} "
        f"steps, about {minutes(n):.0f} min",
        file=sys.stderr,
    )
    if minutes(n) > args.budget_min:
        print(
            f"[plan] warning: even {n} answers take about {minutes(n):.0f} min here, over the "
            f"budget of {args.budget_min:g}",
            file=sys.stderr,
        )
    print(f"N_TRAIN={n}")


if __name__ == "__main__":
    run(main)
