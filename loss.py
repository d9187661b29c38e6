"""The training objective and its metrics (docs/semantics.md, section 4).

For every sampled anchor a the draft fills the block [x[a], MASK, ...]; slot j (1..B-1) is labelled
with the sequence token x[a+j]. Per labelled slot:

    w0  = valid_anchor * [a+j < S] * [j > 0] * loss_mask[a+j]           which slots count
    w   = w0 * exp(-(j-1)/gamma)      or D-PACE (below)                 early slots matter more
    loss = (sum w * base  +  alpha_t * sum w * covered * selector_ce) / sum w

The base term trains the unary logits u = transform(lm_head(h)); the selector term is a K-way
cross-entropy over the unary top-K with the previous *sequence* token as predecessor (teacher
forcing). Numerator and denominator are returned separately so train.py can add them over
micro-batches and ranks and divide once. Everything vocabulary-sized (anchors x B x V logits) is
computed in chunks of blocks under activation checkpointing, so peak memory is one chunk's.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from selector import top_k_candidates

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


# ----------------------------------------------------------------------------- labels and weights
def block_labels(input_ids, loss_mask, anchors, anchor_valid, block_size: int, docs=None):
    """Labels and base weights of slots 1..B-1 of every block.

    input_ids, loss_mask [N, S]; anchors, anchor_valid [N, A] -> labels, prev, w0, each [N, A, B-1]
    where prev is the teacher-forced predecessor x[a+j-1] (the anchor itself for slot 1).
    docs [N, S] numbers the documents of packed rows: a block's labels end where its anchor's
    document ends.
    """
    S = input_ids.shape[1]
    pos = anchors[..., None] + torch.arange(block_size, device=anchors.device)  # [N, A, B]
    inside = pos < S
    flat = pos.clamp(max=S - 1).flatten(1)
    if docs is not None:
        inside = inside & (
            docs.gather(1, flat).view(pos.shape) == docs.gather(1, anchors)[..., None]
        )
    tokens = input_ids.gather(1, flat).view(pos.shape)  # x[a+j]
    mask = loss_mask.gather(1, flat).view(pos.shape).to(torch.float32)
    w0 = anchor_valid[..., None].float() * inside.float() * mask
    return tokens[..., 1:], tokens[..., :-1], w0[..., 1:]


def coverage(loss_mask, anchors, w0):
    """(supervised tokens that some anchored block labels, supervised tokens): the share of the data
    a step trains on. loss_mask [N, S], anchors [N, A], w0 [N, A, B-1] (block_labels) -> two
    scalars. Token a+j is labelled by the block at anchor a where w0 > 0 (j = 1..B-1)."""
    S = loss_mask.shape[1]
    pos = anchors[..., None] + torch.arange(1, w0.shape[-1] + 1, device=anchors.device)
    labelled = torch.zeros(loss_mask.shape, device=w0.device).scatter_reduce(
        1, pos.clamp(max=S - 1).flatten(1), (w0 > 0).float().flatten(1), "amax"
    )  # [N, S]: 1 where some block's valid slot is
    return labelled.sum(), loss_mask.float().sum()


def exp_weights(w0, gamma: float):
    """Fixed exponential decay over slots j = 1..B-1: w = w0 * exp(-(j-1)/gamma)."""
    j = torch.arange(w0.shape[-1], device=w0.device, dtype=w0.dtype)
    return w0 * torch.exp(-j / gamma)


@torch.no_grad()
def dpace_weights(q, w0, alpha: float):
    """D-PACE: weight slot j by the expected future credit it unlocks, d_j = sum_{t>=j} P_t w0_t.

    q [..., L] draft probability of each label; s_j = (1-alpha) q_j + alpha on valid slots, else 1;
    P_j = prod_{i<=j} s_i is the chance the block survives to j. Computed without gradient.
    """
    s = torch.where(w0 > 0, (1 - alpha) * q + alpha, torch.ones_like(q))
    P = s.cumprod(-1)
    d = (P * w0).flip(-1).cumsum(-1).flip(-1)
    return w0 * d


def selector_alpha(step: int, total_steps: int, alpha: float, warmup: float, ramp: float) -> float:
    """Selector weight at optimizer step t: 0 during warmup, a linear ramp, then alpha."""
    W, R = math.floor(total_steps * warmup), math.floor(total_steps * ramp)
    if step < W:
        return 0.0
    return alpha if R == 0 else alpha * min((step - W + 1) / R, 1.0)


# ----------------------------------------------------------------------------- one chunk of blocks
def chunk_terms(draft, lm_head_weight, h, labels, prev, w0, target_hidden, opts):
    """All sums of a chunk of M blocks: h [M, L, H] (L = B-1 labelled slots), labels / prev / w0
    [M, L], target_hidden [M, L, H] or None. The vocabulary-sized tensors are made once, here, for
    both halves: the objective's sums (with gradient) and the metrics' sums (without)."""
    c = draft.config
    u = draft.unary_logits(h, lambda x: x @ lm_head_weight.t()).float()  # [M, L, V] unary scores
    logq = F.log_softmax(u, -1)  # the draft's distribution q
    logp = None  # the target's p, when known
    if target_hidden is not None:
        logp = F.log_softmax((target_hidden @ lm_head_weight.t()).float(), -1)
    with torch.no_grad():
        # [M, L, K]
        cand_scores, cand_ids = top_k_candidates(
            u, min(c.selector_top_k or opts["top_k"], c.vocab_size)
        )
    terms = objective_terms(
        draft.candidate_selector, h, u, logq, logp, labels, prev, w0, cand_ids, opts
    )
    terms.update(
        metric_terms(
            draft.candidate_selector,
            h,
            u,
            logq,
            logp,
            labels,
            prev,
            w0,
            cand_scores,
            cand_ids,
            opts["acceptance"],
        )
    )
    return terms


def objective_terms(selector, h, u, logq, logp, labels, prev, w0, cand_ids, opts):
    """Sums with gradient: the weight total D and the numerator of every base loss and of the
    selector.

    ce = -log q(label); tv = 1 - accepted mass, where the accepted mass is sum min(p, q) with the
    target's p and q(label) without it; kl = KL(p || q). acc_mass and w0 give lk its weight lambda.
    """
    logq_label = logq.gather(-1, labels[..., None]).squeeze(-1)  # [M, L]
    if opts["weighting"] == "dpace":
        w = dpace_weights(logq_label.exp().detach(), w0, opts["dpace_alpha"])
    else:
        w = exp_weights(w0, opts["gamma"])
    p = None if logp is None else logp.exp()
    accepted = logq_label.exp() if p is None else torch.minimum(p, logq.exp()).sum(-1)
    out = {
        "D": w.sum(),
        "N_ce": (w * -logq_label).sum(),
        "N_tv": (w * (1 - accepted)).sum(),
        "acc_mass": (w0 * accepted).detach().sum(),
        "w0": w0.sum(),
    }
    if p is not None:
        out["N_kl"] = (w * (p * (logp - logq)).sum(-1)).sum()
    if selector is not None:
        hidden, unary = (h.detach(), u.detach()) if opts["stop_gradient"] else (h, u)
        out["N_sel"] = selector_numerator(
            selector, hidden, unary, labels, prev, w, w0 > 0, cand_ids, opts["selector_miss"]
        )
    return out


def selector_numerator(selector, hidden, unary, labels, prev, w, valid, cand_ids, miss: str):
    """sum w * counted * CE of the selector's K-way scores, teacher-forced predecessor prev [M, L].

    strict: a slot counts only when its label is among the unary top-K candidates cand_ids
    [M, L, K]. replace: an uncovered label takes the weakest candidate's place, with its own unary
    score.
    """
    K = cand_ids.shape[-1]
    hit = cand_ids == labels[..., None]  # [M, L, K]
    # the label's candidate, if covered
    label_idx = hit.float().argmax(-1)
    cands, cand_scores = cand_ids, unary.gather(-1, cand_ids)  # scores with gradient
    counted = hit.any(-1) & valid
    if miss == "replace":
        replaced = (valid & ~hit.any(-1))[..., None] & (
            torch.arange(K, device=cand_ids.device) == K - 1
        )
        cands = torch.where(replaced, labels[..., None], cands)
        cand_scores = torch.where(replaced, unary.gather(-1, labels[..., None]), cand_scores)
        label_idx = torch.where(replaced.any(-1), K - 1, label_idx)
        counted = valid
    sigma = selector.teacher_forced_scores(hidden, prev, cands, cand_scores).float()  # [M, L, K]
    ce = F.cross_entropy(sigma.flatten(0, 1), label_idx.flatten(), reduction="none").view_as(w)
    return (w * counted.float() * ce).sum()


def leading_run(ok):
    """Length of the leading run of True along the last dim: [..., L] bool -> [...] float."""
    return ok.float().cumprod(-1).sum(-1)


@torch.no_grad()
def metric_terms(
    selector, h, u, logq, logp, labels, prev, w0, cand_scores, cand_ids, acceptance=False
):
    """Metric sums, no gradient: how often the unary argmax, the top-K, the selector
    (teacher-forced) and the selector's own greedy path get the label, and the accepted lengths
    those imply. With acceptance, per slot [L] and per slot and candidate [L, K] too: what
    acceptance.json holds (train.py)."""
    valid = w0 > 0
    n = valid.float()
    hit = cand_ids == labels[..., None]  # [M, L, K]
    covered = hit.any(-1) & valid
    greedy_ok = (u.argmax(-1) == labels) & valid
    q_label = logq.gather(-1, labels[..., None]).squeeze(-1).exp()
    out = dict(
        unary_acc=greedy_ok.float().sum(),
        target_prob=(n * q_label).sum(),
        tokens=n.sum(),
        topk_recall=covered.float().sum(),
        accept_unary=leading_run(greedy_ok).sum(),
        accept_oracle=leading_run(covered).sum(),
    )
    # the target's mass in the top-K
    if logp is not None:
        out["topk_target_mass"] = (n * logp.gather(-1, cand_ids).exp().sum(-1)).sum()
    K = cand_ids.shape[-1]
    # blocks whose path is right up to slot j; slots whose label is the draft's candidate k
    if acceptance:
        out.update(
            slots=n.sum(0),
            run_unary=greedy_ok.float().cumprod(-1).sum(0),
            rank_unary=(F.one_hot(hit.float().argmax(-1), K) * covered[..., None]).sum(0).float(),
        )
    if selector is None:
        return out
    label_idx = hit.float().argmax(-1)
    strict = selector.teacher_forced_scores(h, prev, cand_ids, cand_scores).float()  # [M, L, K]
    log_s = F.log_softmax(strict, -1).gather(-1, label_idx[..., None]).squeeze(-1)
    cov = covered.float()
    out.update(
        sel_acc=(cov * (strict.argmax(-1) == label_idx).float()).sum(),
        sel_prob=(cov * log_s.exp()).sum(),
        sel_ce=(cov * -log_s).sum(),
        sel_covered=cov.sum(),
    )
    # greedy self-conditioned path: walk from the anchor, feeding back its own choices
    path, _ = selector.walk(selector.lattice(h, prev[:, 0], cand_ids, cand_scores), cand_ids)
    ok = (path == labels) & valid
    out["path_num"], out["path_den"] = ok.float().sum(0), n.sum(0)  # [L] accuracy per position
    out["accept_selector"] = leading_run(ok).sum()
    # the label's rank among the K candidates under the selector, given its predecessor
    if acceptance:
        rank = (strict > strict.gather(-1, label_idx[..., None])).sum(-1)
        out.update(
            run_selector=ok.float().cumprod(-1).sum(0),
            rank_selector=(F.one_hot(rank, K) * covered[..., None]).sum(0).float(),
        )
    return out


# ----------------------------------------------------------------------------- the objective
def objective(
    draft,
    lm_head_weight,
    h,
    input_ids,
    loss_mask,
    anchors,
    anchor_valid,
    *,
    loss="ce",
    weighting="exp",
    gamma=None,
    dpace_alpha=0.5,
    target_hidden=None,
    alpha_t=None,
    selector_miss="strict",
    stop_gradient=False,
    chunk_blocks=None,
    top_k=16,
    docs=None,
    acceptance=False,
):
    """Numerator, denominator and metric sums for one micro-batch.

    h [N, A, B, H] draft hidden states (model.forward_training); target_hidden [N, S, H] the
    target's final normed hidden states (needed by `kl`, read by `tv` / `lk`, unread by `ce`).
    alpha_t: selector weight this step, or None when the selector is frozen (alpha == 0).
    docs [N, S]: the documents of packed rows, or None. acceptance: add the per-slot statistics of
    acceptance.json to the metrics (held-out evaluation). Returns {"numerator", "denominator",
    "metrics"} where metrics maps a name to a (numerator, denominator) pair of detached tensors.
    """
    N, A, B, H = h.shape
    if loss not in ("ce", "kl", "tv", "lk"):
        raise ValueError(f"loss must be ce, kl, tv or lk, got {loss!r}")
    if loss == "kl" and target_hidden is None:
        raise ValueError(
            "loss 'kl' needs the target's hidden states (prepare.py --save-target-hidden, or "
            "--online)"
        )
    if weighting == "exp" and gamma is None:
        if B not in DEFAULT_GAMMA:
            raise ValueError(f"no default gamma for block size {B}; set --gamma")
        gamma = DEFAULT_GAMMA[B]
    opts = dict(
        weighting=weighting,
        gamma=gamma,
        dpace_alpha=dpace_alpha,
        selector_miss=selector_miss,
        stop_gradient=stop_gradient,
        top_k=top_k,
        acceptance=acceptance,
    )
    # [N, A, B-1]
    labels, prev, w0 = block_labels(input_ids, loss_mask, anchors, anchor_valid, B, docs)
    target_at_slots = None  # [N, A, B-1, H]: the target predicts x[a+j] from position a+j-1
    # ce reads only the labels: the target's [blocks x (B-1), V] distribution would feed metrics
    # alone, at about a third of a CPU step, so ce never makes it
    if target_hidden is not None and loss != "ce":
        pos = (anchors[..., None] + torch.arange(B - 1, device=h.device)).clamp(
            max=input_ids.shape[1] - 1
        )
        target_at_slots = target_hidden.gather(1, pos.flatten(1)[..., None].expand(-1, -1, H)).view(
            N, A, B - 1, H
        )

    # chunk over the anchor axis; checkpoint recomputes each chunk's logits during backward
    chunk = A if not chunk_blocks else min(chunk_blocks, A)
    totals = {}
    for s in range(0, A, chunk):
        part = lambda t: None if t is None else t[:, s : s + chunk].flatten(0, 1)
        args = (part(h[:, :, 1:]), part(labels), part(prev), part(w0), part(target_at_slots))
        fn = lambda *a: chunk_terms(draft, lm_head_weight, *a, opts)
        terms = (
            checkpoint(fn, *args, use_reentrant=False)
            if chunk < A and torch.is_grad_enabled()
            else fn(*args)
        )
        for k, v in terms.items():
            totals[k] = totals[k] + v if k in totals else v

    base = base_numerator(loss, totals)
    numerator = base
    if alpha_t is not None and "N_sel" in totals:
        # alpha_t = 0 keeps the selector in the graph
        numerator = numerator + alpha_t * totals["N_sel"]

    t = {k: v.detach() for k, v in totals.items()}
    blocks = (anchor_valid.float().sum()).detach()
    metrics = {
        "loss": (numerator.detach(), t["D"]),
        "base_loss": (base.detach(), t["D"]),
        "unary_acc": (t["unary_acc"], t["tokens"]),
        "target_prob": (t["target_prob"], t["tokens"]),
        "topk_recall": (t["topk_recall"], t["tokens"]),
        "accept_unary": (t["accept_unary"] + blocks, blocks),
        "accept_oracle": (t["accept_oracle"] + blocks, blocks),
        "coverage": coverage(loss_mask, anchors, w0),
    }
    if "topk_target_mass" in t:  # only where the target's distribution was given
        metrics["topk_target_mass"] = (t["topk_target_mass"], t["tokens"])
    if "N_sel" in t:
        metrics.update(
            sel_loss=(t["N_sel"], t["D"]),
            sel_acc=(t["sel_acc"], t["sel_covered"]),
            sel_prob=(t["sel_prob"], t["sel_covered"]),
            sel_ce=(t["sel_ce"], t["sel_covered"]),
            accept_selector=(t["accept_selector"] + blocks, blocks),
            path_acc=(t["path_num"], t["path_den"]),
        )
    # r_j per slot j; rho_j(k) per slot and rank
    for mode in ("unary", "selector") if acceptance else ():
        if f"run_{mode}" in t:
            metrics[f"accepted_at_{mode}"] = (t[f"run_{mode}"], blocks.expand(B - 1))
            metrics[f"rank_{mode}"] = (
                t[f"rank_{mode}"],
                t["slots"][:, None].expand_as(t[f"rank_{mode}"]),
            )
    return {"numerator": numerator, "denominator": t["D"], "metrics": metrics}


def base_numerator(loss: str, totals: dict):
    """The chosen base loss's numerator. lk mixes ce and tv with lambda = exp(-mean accepted mass)
    over the whole micro-batch, detached (a number, not a path for gradients)."""
    if loss == "ce":
        return totals["N_ce"]
    if loss == "tv":
        return totals["N_tv"]
    if loss == "kl":
        return totals["N_kl"]
    lam = math.exp(-(totals["acc_mass"] / totals["w0"].clamp(min=1)).item())
    return lam * totals["N_ce"] + (1 - lam) * totals["N_tv"]


# --------------------------------------------------------------------- over micro-batches and ranks
# Every metric is a (numerator, denominator) pair: train.py adds the pairs over micro-batches, sums
# them over ranks and divides once, so a metric is a ratio of global sums whatever the rank /
# accumulation split.
def all_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def add_into(acc, metrics):
    for k, (n, d) in metrics.items():
        acc[k] = (acc[k][0] + n, acc[k][1] + d) if k in acc else (n.clone(), d.clone())


def reduce_metrics(acc):
    """{name: (num, den)}: sum numerators and denominators over ranks (all in one all_reduce), then
    divide: ratios of global sums. A scalar metric gives a number, a per-position one a list."""
    # [num ; den] each
    parts = [torch.cat([n.reshape(-1), d.reshape(-1)]).float() for n, d in acc.values()]
    flat, out, i = all_sum(torch.cat(parts)), {}, 0
    for k, (n, _) in acc.items():
        size = n.numel()
        r = (flat[i : i + size] / flat[i + size : i + 2 * size].clamp(min=1e-9)).tolist()
        i += 2 * size
        out[k] = r[0] if size == 1 else [round(v, 4) for v in r]
    return out
