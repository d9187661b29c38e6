"""Served acceptance: held-out prompts decoded by the real loop (decoding.py), greedily, so that
train.py reports the tau a user will see beside the teacher-forced one (docs/semantics.md,
section 4, "Served acceptance").

Teacher-forced tau (loss.py) is measured at anchors drawn uniformly from the supervised tokens. A
served cycle's anchor is wherever the previous cycle stopped: serving visits

    s_0 = P                    the first answer token, committed by the prefill (P: prompt length)
    s_{i+1} = s_i + tau_i      tau_i = accepted drafts + 1 (the bonus token)

When the held-out answer is the target's own greedy answer, the draft at s_i reads the same context
(the target's features of tokens 0..s_i-1) and the same block as it does in training at anchor s_i,
so teacher-forced acceptance at the served anchors equals served acceptance cycle for cycle
(test_all.py checks it). The gap between random and served anchors is then a matter of where the
anchors fall, not of the draft.
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import loss
import model
from speed import tune
from target import stop_token_ids
from tree import label, speculate


def prompt_length(loss_mask) -> int:
    """A held-out sequence's prompt: the tokens before its first supervised one. loss_mask [S]."""
    return int(loss_mask.nonzero()[0, 0])


def served_anchors(P: int, taus: list) -> list:
    """The anchors a decoding visited: s_0 = P, s_{i+1} = s_i + tau_i (one per cycle)."""
    anchors = [P]
    for t in taus[:-1]:
        anchors.append(anchors[-1] + t)
    return anchors


@torch.no_grad()
def serve(target, draft, samples, shape, use_selector=True, stop_ids=()) -> dict:
    """Decode each sample's prompt greedily for as many tokens as its answer has, verifying shape,
    ("path", k) or ("tree", n) -> {"tau": accepted drafts + 1 per cycle, over all cycles of all
    prompts; "cycles"; "tokens": committed; "anchors": [the anchors of each sample]}."""
    device = next(target.parameters()).device
    taus, anchors, tokens = [], [], 0
    for s in samples:
        P = prompt_length(s["loss_mask"])
        prompt = s["input_ids"][None, :P].to(device)  # [1, P]
        n = len(s["input_ids"]) - P  # the answer's length
        _, stats = speculate(
            target, draft, prompt, n, shape, use_selector=use_selector, stop_ids=stop_ids
        )
        taus += stats.taus
        tokens += stats.new_tokens
        anchors.append(served_anchors(P, stats.taus))
    tau = sum(taus) / len(taus) if taus else float("nan")
    return {"tau": tau, "cycles": len(taus), "tokens": tokens, "anchors": anchors}


@torch.no_grad()
def teacher_forced_taus(draft, embed_w, head_w, sample, anchors) -> list:
    """The identity's other side: the block at each anchor of one sequence, teacher-forced as
    training scores it (model.forward_training, loss.objective), one block at a time -> its
    accepted length, 1 + the leading run of labels the draft's greedy path (the selector's walk, or
    the unary argmax) gets right. embed_w, head_w [V, H]: the target's embedding and head."""
    ids, mask = sample["input_ids"][None], sample["loss_mask"][None]  # [1, S]
    feats = sample["features"][None].float()  # [1, S, k*H]
    embed = lambda x: F.embedding(x, embed_w)  # noqa: E731
    mode = "accept_selector" if draft.candidate_selector is not None else "accept_unary"
    cfg = loss.LossConfig(gamma=1.0)  # gamma weighs the loss only, not the metrics
    taus = []
    for a in anchors:
        A = torch.tensor([[a]], device=ids.device)
        h = model.forward_training(draft, embed, ids, feats, A)
        metrics = loss.objective(draft, head_w, h, ids, mask, A, A >= 0, cfg)["metrics"]
        num, den = metrics[mode]
        taus.append(float(num / den))
    return taus


def served_tau(target, draft, tokenizer, samples, draft_path: str) -> dict:
    """train.py's served evaluation: the draft as generate.py would run it here (speed/tune.py:
    its precision, its head, the target's GEMM layout) decodes the samples' prompts with the path
    of B-1 drafts and with the shape `auto` chooses from draft_path's acceptance.json.
    -> {"path": serve(...), "auto": serve(...) with its "shape"}. The draft is changed in place
    (precision): pass a copy."""
    options = argparse.Namespace(draft_dtype="auto", target_gemm="auto")
    draft, layouts, line = tune.decoding(target, draft, options)
    print(line, file=sys.stderr)
    use_selector = draft.candidate_selector is not None
    mode = "selector" if use_selector else "unary"
    asked = argparse.Namespace(verify_tokens=None, tree_budget=["auto"], draft=draft_path)
    auto_shape = tune.verify_shapes(asked, draft, mode, layouts)[0]
    path_shape = ("path", draft.config.block_size - 1)
    stop = stop_token_ids(target, tokenizer)
    out = {"path": serve(target, draft, samples, path_shape, use_selector, stop)}
    out["auto"] = (
        out["path"]
        if auto_shape == path_shape
        else serve(target, draft, samples, auto_shape, use_selector, stop)
    )
    out["auto"] = dict(out["auto"], shape=label(auto_shape))
    return out
