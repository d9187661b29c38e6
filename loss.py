"""The training objective (docs/semantics.md, section 4).

For every sampled anchor a (a position whose token and next token are both supervised:
anchor_positions, drawn by sample_anchors) the draft fills the block [x[a], MASK, ...]; slot j
(1..B-1) is labelled with the sequence token x[a+j]. Per labelled slot:

    w0  = valid_anchor * [a+j < S] * [j > 0] * loss_mask[a+j]           which slots count
    w   = w0 * exp(-(j-1)/gamma)                                        early slots matter more
    loss = (sum w * ce  +  alpha_t * sum w * covered * selector_ce) / sum w

ce trains the unary logits u = transform(lm_head(h)); the selector term is a K-way cross-entropy
over the unary top-K with the previous *sequence* token as predecessor (teacher forcing), counted
only where the label is among the K ("covered"). `reference_objective` computes exactly this in
one piece: read it first.

What train.py runs is `objective`: the same sums (a test holds the two equal), returned as
numerator and denominator so that train.py can add them over micro-batches and ranks and divide
once, with everything vocabulary-sized (anchors x B x V logits) computed in chunks of blocks under
activation checkpointing, so that peak memory is one chunk's. It also runs the variants the public
trainers offer, each under the last banner with its source. The metrics that come with the loss
(accuracies, accepted lengths) are support/metrics.py's, measured from the same chunks' tensors
(objective's observe).
"""

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model import autocast_dtype
from selector import TOP_K, top_k_candidates


# -------------------------------------------------------------------------- the objective, plainly
def reference_objective(
    draft, lm_head_weight, h, input_ids, loss_mask, anchors, anchor_valid, gamma, alpha
):
    """The default objective by its definition, unchunked: ce on the unary logits, exp position
    weights, the strict selector CE. h [N, A, B, H] (model.forward_training) -> (numerator,
    denominator); the loss is their ratio. `objective` computes the same sums in chunks."""
    labels, prev, w0 = block_labels(input_ids, loss_mask, anchors, anchor_valid, h.shape[2])
    w = exp_weights(w0, gamma)  # [N, A, B-1]
    h = h[:, :, 1:]  # slot 0 holds the anchor: it proposes nothing
    u = draft.unary_logits(h, lambda x: x @ lm_head_weight.t()).float()  # [N, A, B-1, V]
    ce = -F.log_softmax(u, -1).gather(-1, labels[..., None]).squeeze(-1)  # -log q(label)
    numerator = (w * ce).sum()
    if draft.candidate_selector is not None:  # DFlash2
        _, cand_ids = top_k_candidates(u.detach(), top_k(draft.config))  # [N, A, B-1, K]
        hit = cand_ids == labels[..., None]
        covered = hit.any(-1) & (w0 > 0)  # strict: a label outside the top-K adds nothing
        # the K candidates' scores after the true previous token: [N, A, B-1, K]
        sigma = draft.candidate_selector.teacher_forced_scores(
            h, prev, cand_ids, u.gather(-1, cand_ids)
        ).float()
        sel_ce = -F.log_softmax(sigma, -1).gather(-1, hit.float().argmax(-1, keepdim=True))
        numerator = numerator + alpha * (w * covered * sel_ce.squeeze(-1)).sum()
    return numerator, w.sum()


# ----------------------------------------------------------------------------- anchors
def anchor_positions(loss_mask):
    """Where a training block may start (docs/semantics.md, section 4): positions p with
    loss_mask[p] = loss_mask[p+1] = 1, so both the anchor and the first label are supervised.
    loss_mask [S] -> positions [n] long."""
    return ((loss_mask[:-1] > 0) & (loss_mask[1:] > 0)).nonzero().squeeze(-1)


def sample_anchors(loss_mask, num_anchors: int, generator, docs=None, per_document=False):
    """Up to num_anchors of the anchor positions (anchor_positions), drawn uniformly without
    replacement, sorted (docs/semantics.md, section 4). docs [S]: an anchor and its first label
    share a document. per_document: each document of the row draws up to num_anchors of its own
    (the public trainers' contract: one conversation, num_anchors), so a long document cannot take
    the anchors of the short ones beside it; else the row draws num_anchors among all of them."""
    cand = anchor_positions(loss_mask)
    if docs is not None:
        cand = cand[docs[cand] == docs[cand + 1]]
    groups = [cand]
    if per_document and docs is not None:
        groups = [cand[docs[cand] == d] for d in docs[cand].unique()]
    picks = [g[torch.randperm(len(g), generator=generator)[:num_anchors]] for g in groups]
    return torch.cat(picks).sort().values if picks else cand


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


def exp_weights(w0, gamma: float):
    """Fixed exponential decay over slots j = 1..B-1: w = w0 * exp(-(j-1)/gamma)."""
    j = torch.arange(w0.shape[-1], device=w0.device, dtype=w0.dtype)
    return w0 * torch.exp(-j / gamma)


def selector_alpha(step: int, total_steps: int, alpha: float, warmup: float, ramp: float) -> float:
    """Selector weight at optimizer step t: 0 during warmup, a linear ramp, then alpha."""
    W, R = math.floor(total_steps * warmup), math.floor(total_steps * ramp)
    if step < W:
        return 0.0
    return alpha if R == 0 else alpha * min((step - W + 1) / R, 1.0)


# ------------------------------------------------------ what train.py runs: the same sums, chunked
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # exp decay gamma by block size, when --gamma is unset


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The objective's settings: train.py builds one from its flags (docs/training.md)."""

    loss: str = "ce"  # the base loss: ce, tv, kl or lk (base_sums)
    weighting: str = "exp"  # position weights: exp (exp_weights) or dpace (dpace_weights)
    gamma: float = None  # exp's decay; None: DEFAULT_GAMMA of the block size
    dpace_alpha: float = 0.5
    selector_miss: str = "strict"  # a label outside the top-K: strict or replace
    selector_weighting: str = "exp"  # the selector term's weights: exp (w, D) or uniform
    stop_gradient: bool = False  # the selector's CE trains the selector only, not the backbone
    chunk_blocks: int = None  # anchors per chunk of logits; None: all at once

    def __post_init__(self):
        if self.loss not in ("ce", "kl", "tv", "lk"):
            raise ValueError(f"loss must be ce, kl, tv or lk, got {self.loss!r}")

    def decay(self, block_size: int) -> float:
        """exp's gamma: the one set, or DEFAULT_GAMMA of the block size."""
        if self.gamma is None and block_size not in DEFAULT_GAMMA:
            raise ValueError(f"no default gamma for block size {block_size}; set --gamma")
        return DEFAULT_GAMMA[block_size] if self.gamma is None else self.gamma


def objective(
    draft,
    lm_head_weight,
    h,
    input_ids,
    loss_mask,
    anchors,
    anchor_valid,
    cfg=LossConfig(),
    *,
    target_hidden=None,
    alpha_t=None,
    sel_scale=None,
    docs=None,
    observe=None,
):
    """The loss's sums for one micro-batch: {"numerator", "denominator", "base" and, with a
    selector, "selector"}; the loss is numerator / denominator, numerator = base + alpha_t *
    selector (with uniform selector weights, "selector_denominator" D_sel too, and numerator =
    base + alpha_t * selector * D / D_sel: the selector's mean over its own slots).

    h [N, A, B, H] draft hidden states (model.forward_training); input_ids, loss_mask [N, S];
    anchors, anchor_valid [N, A]; cfg: the loss's settings. target_hidden [N, S, H]: the target's
    final normed hidden states (needed by `kl`, read by `tv` / `lk`, unread by `ce`). alpha_t:
    selector weight this step, or None when the selector is frozen (alpha == 0). sel_scale: with
    --selector-weighting uniform, D / D_sel of the whole step (train.py), None: this micro-batch's.
    docs [N, S]: the documents of packed rows, or None. observe: called once per chunk with the
    chunk's tensors, observe(h, u, logq, logp, labels, prev, w0, cand_scores, cand_ids), outside
    the checkpoint: support/metrics.py measures the metrics from the tensors the loss made.
    """
    _, A, B, _ = h.shape
    if cfg.loss == "kl" and target_hidden is None:
        raise ValueError(
            "loss 'kl' needs the target's hidden states (prepare.py --save-target-hidden, or "
            "--online)"
        )
    if cfg.weighting == "exp":
        cfg = dataclasses.replace(cfg, gamma=cfg.decay(B))
    # [N, A, B-1]
    labels, prev, w0 = block_labels(input_ids, loss_mask, anchors, anchor_valid, B, docs)
    # ce reads only the labels: the target's [blocks x (B-1), V] distribution would feed metrics
    # alone, at about a third of a CPU step, so ce never makes it
    target_at_slots = None  # [N, A, B-1, H]
    if target_hidden is not None and cfg.loss != "ce":
        target_at_slots = at_slots(target_hidden, anchors, B - 1)

    # The frozen head [V, H] in the dtype its matmuls run in, cast here once: autocast would cast
    # it in every chunk and again in every chunk's recompute (it keeps casts only of leaves that
    # need grad), 1.24 GB each for Qwen3-8B. Autocast casts the same way, so the sums are the same.
    dtype = autocast_dtype(h.device.type)
    lm_head_weight = lm_head_weight if dtype is None else lm_head_weight.to(dtype)
    # chunk over the anchor axis; checkpoint recomputes each chunk's logits during backward
    chunk = A if not cfg.chunk_blocks else min(cfg.chunk_blocks, A)
    sums = {}
    for s in range(0, A, chunk):
        part = [
            None if t is None else t[:, s : s + chunk].flatten(0, 1)
            for t in (h[:, :, 1:], labels, prev, w0, target_at_slots)
        ]
        args = (draft, lm_head_weight, cfg, *part)
        if chunk < A and torch.is_grad_enabled():
            chunk_loss, made = checkpoint(chunk_sums, *args, use_reentrant=False)
        else:
            chunk_loss, made = chunk_sums(*args)
        add_sums(sums, chunk_loss)
        if observe is not None:  # (u, logq, logp), then (cand_scores, cand_ids)
            observe(part[0], *made[:3], *part[1:4], *made[3:])
        del made  # vocabulary-sized: held for one chunk at a time

    base = base_numerator(cfg.loss, sums)
    numerator = base
    D = sums["D"].detach()
    out = {"denominator": D, "base": base}
    if "N_sel" in sums:
        out["selector"] = sel = sums["N_sel"]
        if "D_sel" in sums:  # uniform: alpha * N_sel / D_sel, written over the shared D
            out["selector_denominator"] = D_sel = sums["D_sel"].detach()
            sel = sel * (D / D_sel.clamp(min=1) if sel_scale is None else sel_scale)
        if alpha_t is not None:  # alpha_t = 0 keeps the selector in the graph
            numerator = numerator + alpha_t * sel
    out["numerator"] = numerator
    return out


def chunk_sums(draft, lm_head_weight, cfg, h, labels, prev, w0, target_hidden):
    """The loss sums of a chunk of M blocks (loss_sums), and the vocabulary-sized tensors it made
    for them, for objective's observe: (u, logq, logp, cand_scores, cand_ids). h [M, L, H] (L = B-1
    labelled slots), labels / prev / w0 [M, L], target_hidden [M, L, H] or None."""
    c = draft.config
    head = lambda x: head_logits(x, lm_head_weight)
    u = draft.unary_logits(h, head).float()  # [M, L, V] unary scores
    logq = F.log_softmax(u, -1)  # the draft's distribution q
    logp = None  # the target's p, when known
    if target_hidden is not None:
        logp = F.log_softmax(head(target_hidden).float(), -1)
    with torch.no_grad():
        cand_scores, cand_ids = top_k_candidates(u, top_k(c))  # [M, L, K]: the unary top-K
    sums = loss_sums(cfg, draft.candidate_selector, h, u, logq, logp, labels, prev, w0, cand_ids)
    return sums, (u, logq, logp, cand_scores, cand_ids)


def top_k(c) -> int:
    """K of the unary top-K, in both objectives: the draft's selector_top_k, or selector.TOP_K for
    a plain draft (its metrics), at most the vocabulary."""
    return min(c.selector_top_k or TOP_K, c.vocab_size)


def head_logits(x, lm_head_weight):
    """x [M, L, H] -> x @ W_lm^T [M, L, V], as one [M*L, H] x [H, V] GEMM. A chunk's x is a strided
    view (h[:, :, 1:]), and a strided 3-D x goes to a batched matmul: about 3x slower on a CPU,
    forward and backward, for the same sums."""
    return (x.reshape(-1, x.shape[-1]) @ lm_head_weight.t()).view(*x.shape[:-1], -1)


def at_slots(target_hidden, anchors, L: int):
    """target_hidden [N, S, H] -> [N, A, L, H]: at slot j of the block at anchor a, the target's
    state at position a+j-1, the one that predicts the label x[a+j]."""
    N, S, H = target_hidden.shape
    pos = (anchors[..., None] + torch.arange(L, device=anchors.device)).clamp(max=S - 1)
    return target_hidden.gather(1, pos.flatten(1)[..., None].expand(-1, -1, H)).view(N, -1, L, H)


def add_sums(total: dict, new: dict):
    for k, v in new.items():
        total[k] = total[k] + v if k in total else v


def loss_sums(cfg, selector, h, u, logq, logp, labels, prev, w0, cand_ids):
    """Sums with gradient over a chunk's slots: the weight total D, the base loss's numerator
    (base_sums) and, with a selector, the selector's (selector_numerator; with uniform weights
    its own denominator D_sel too)."""
    logq_label = logq.gather(-1, labels[..., None]).squeeze(-1)  # [M, L]
    if cfg.weighting == "dpace":
        w = dpace_weights(logq_label.exp().detach(), w0, cfg.dpace_alpha)
    else:
        w = exp_weights(w0, cfg.gamma)
    out = {"D": w.sum(), **base_sums(cfg.loss, w, w0, logq, logq_label, logp)}
    if selector is not None:
        hidden, unary = (h.detach(), u.detach()) if cfg.stop_gradient else (h, u)
        valid = w0 > 0
        w_sel = w
        if cfg.selector_weighting == "uniform":
            w_sel = valid.float()
            out["D_sel"] = w_sel.sum()
        out["N_sel"] = selector_numerator(
            selector, hidden, unary, labels, prev, w_sel, valid, cand_ids, cfg.selector_miss
        )
    return out


# ----------------------------------------------------------------------------- the variants
# Each is a public trainer's option, off by default here (docs/semantics.md, section 4):
#   tv       1 - accepted mass: SpecForge's lk_loss_type "tv" (hard label, 1 - q(label))
#   kl       KL(p || q) to the target's distribution: Speculators' --loss-fn kl_div
#   lk       lambda * ce + (1 - lambda) * tv, lambda = exp(-mean accepted mass): SpecForge's
#            lk_loss_type "lambda" at kl_scale = kl_decay = 1
#   dpace    D-PACE position weights: SpecForge PR #578, Speculators' dpace_loss_decay (RFC #979)
#   replace  an uncovered label takes the weakest candidate's place (this project's; SpecForge
#            PR #772 inserts it into the candidates, Speculators PR #1006 into the loss only)
#   stop-gradient  the selector CE trains the selector only: SpecForge PR #793
#   uniform  the selector term unweighted over its own denominator, base + alpha * mean CE:
#            Model-Optimizer PR #2216 (hf_dflash2.py: "position weighting ... deliberately not
#            applied"); with replace, Model-Optimizer's selector objective
def base_sums(loss: str, w, w0, logq, logq_label, logp):
    """The sums the chosen base loss needs; w, w0, logq_label = log q(label) [M, L], logq and the
    target's logp [M, L, V] (logp None without the target):

        ce  sum w * -log q(label)
        tv  sum w * (1 - accepted)     accepted = sum_v min(p, q), or q(label) without the target
        kl  sum w * KL(p || q)
        lk  ce's and tv's sums, and sum w0 * accepted and sum w0, that give it lambda
    """
    if loss == "kl":
        p = logp.exp()
        return {"N_kl": (w * (p * (logp - logq)).sum(-1)).sum()}
    out = {}
    if loss in ("ce", "lk"):
        out["N_ce"] = (w * -logq_label).sum()
    if loss in ("tv", "lk"):
        accepted = (
            logq_label.exp() if logp is None else torch.minimum(logp.exp(), logq.exp()).sum(-1)
        )
        out["N_tv"] = (w * (1 - accepted)).sum()
    if loss == "lk":
        out.update(acc_mass=(w0 * accepted).detach().sum(), w0=w0.sum())
    return out


def base_numerator(loss: str, sums: dict):
    """The base loss's numerator over the micro-batch. lk mixes ce and tv with lambda = exp(-mean
    accepted mass) over the whole micro-batch, detached (a number, not a path for gradients)."""
    if loss == "lk":
        lam = math.exp(-(sums["acc_mass"] / sums["w0"].clamp(min=1)).item())
        return lam * sums["N_ce"] + (1 - lam) * sums["N_tv"]
    return sums[f"N_{loss}"]  # ce, tv or kl: the one numerator base_sums made


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


def uniform_denominators(cfg, block_size: int, input_ids, loss_mask, anchors, anchor_valid, docs):
    """uniform's two denominators of a micro-batch from its data alone, [sum w, D_sel]: D_sel
    counts the selector's slots (w0 > 0; under strict a miss counts with CE 0, as under exp).
    train.py sums them over the step's micro-batches and ranks before the first backward: the
    selector's gradient goes into .grad scaled by D / D_sel, so the ratio must be known then. exp
    weights only: D-PACE's sum w is known only after the forward."""
    _, _, w0 = block_labels(input_ids, loss_mask, anchors, anchor_valid, block_size, docs)
    return torch.stack([exp_weights(w0, cfg.decay(block_size)).sum(), (w0 > 0).float().sum()])
