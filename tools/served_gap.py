"""Why served tau differs from teacher-forced tau at random anchors, measured on held-out data.

    python tools/served_gap.py --draft out/smollm2-math-dflash2 --data data/smollm2-math/eval \
        --num-prompts 16

For each held-out sequence the teacher-forced accepted length tau(p) of the block at EVERY anchor
position p (the draft's greedy path: the selector's walk, or the unary argmax for plain DFlash),
then four means over blocks:

    all anchors      tau(p) over every anchor position: what random anchors estimate
    harmonic         1 / mean(1 / tau(p)): where tau(p) stays constant over long stretches, a walk
                     spends 1/tau(p) cycles per token at p and its tau (tokens / cycles) is this;
                     where tau(p) is independent from one position to the next, the walk samples it
                     fairly and its tau is the arithmetic mean. A real walk lies between the two
    walked           the anchors a decoding would visit if the answer were the target's greedy one:
                     s_0 = P, s_{i+1} = s_i + tau(s_i) (served.py's identity), tau over them
    served           the real loop (served.py, the draft in fp32 beside the target in fp32)
    after a miss     tau(p) at the positions just after a block that missed before slot B-1
                     (every walked anchor but the first is one)

and how often the served anchors are the walked ones (all of them when the held-out answers are the
fp32 target's greedy answers). all - walked is the anchors' share of the gap; walked - served the
data's (answers made in another precision or batch than the one that serves).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

import data  # noqa: E402
from export import load_any  # noqa: E402
from support.common import run  # noqa: E402
from support.target import load_target, stop_token_ids  # noqa: E402
from tools import served  # noqa: E402


def walk(P: int, tau: dict) -> list:
    """The anchors s_0 = P, s_{i+1} = s_i + tau(s_i), while the block has its labels."""
    anchors = []
    s = P
    while s in tau:
        anchors.append(s)
        s += tau[s]
    return anchors


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft", required=True, help="a run directory, ckpt.pt or an export")
    p.add_argument("--data", required=True, help="held-out feature directory (prepare.py)")
    p.add_argument("--target", default=None)
    p.add_argument("--num-prompts", type=int, default=16)
    args = p.parse_args(argv)
    draft = load_any(args.draft)
    target, tok = load_target(args.target, torch.float32)
    embed_w = target.get_input_embeddings().weight.detach().float()
    head_w = target.get_output_embeddings().weight.detach().float()
    samples = data.load_samples(args.data, False, tok, 10**9)
    chosen = [samples[i] for i in range(min(args.num_prompts, len(samples)))]
    B, stop = draft.config.block_size, stop_token_ids(target, tok)
    use_selector = draft.candidate_selector is not None
    result = served.serve(target, draft, chosen, ("path", B - 1), use_selector, stop)
    every, walked, after_miss, same, cycles = [], [], [], 0, 0
    for s, visited in zip(chosen, result["anchors"]):
        positions = data.anchor_positions(s["loss_mask"]).tolist()
        taus = served.teacher_forced_taus(draft, embed_w, head_w, s, positions)
        tau = dict(zip(positions, map(round, taus)))  # {p: tau(p)}
        P = served.prompt_length(s["loss_mask"])
        path = walk(P, tau)
        every += tau.values()
        walked += [tau[a] for a in path]
        after_miss += [tau[a + tau[a]] for a in tau if tau[a] < B and a + tau[a] in tau]
        same += sum(a == b for a, b in zip(path, visited))
        cycles += len(visited)
    print(f"{len(chosen)} held-out prompts, block size {B}, {len(every)} anchor positions")
    print(f"  tau, all anchors (teacher-forced)      {mean(every):.3f}  ({len(every)} blocks)")
    harmonic = 1 / mean(1 / t for t in every)  # the walk spends 1/tau(p) cycles per token at p
    print(f"  harmonic mean over all anchors         {harmonic:.3f}")
    print(f"  tau, walked anchors (teacher-forced)   {mean(walked):.3f}  ({len(walked)} blocks)")
    print(f"  tau, served (the real loop)            {result['tau']:.3f}  ({cycles} cycles)")
    print(f"  tau, anchors just after a miss         {mean(after_miss):.3f}  ({len(after_miss)})")
    print(f"  served anchors that are walked ones    {same} of {cycles}")


if __name__ == "__main__":
    run(main)
