"""The training objective (docs/semantics.md, section 4).

For every sampled anchor a (a position whose token and next token are both supervised:
anchor_positions, drawn by sample_anchors) the draft fills the block [x[a], MASK, ...]; slot j
(1..B-1) is labelled with the sequence token x[a+j]. Per labelled slot:

    w0  = valid_anchor * [a+j < S] * [j > 0] * loss_mask[a+j]           which slots count
    w   = w0 * exp(-(j-1)/gamma)                                        early slots matter more
    loss = (sum w * ce  +  alpha_t * sum w * covered * selector_ce) / sum w

ce trains the unary logits u = transform(lm_head(h)); the selector term is a K-way cross-entropy
over the unary top-K with the previous *sequence* token as predecessor (teacher forcing), counted
only where the label is among the K ("covered").

`objective` computes exactly this, top to bottom. The vocabulary-sized logits are made a chunk of
anchors at a time by `head_at_slots`, which keeps a few numbers per slot (`Slots`). The public
trainers' variants are under the last banner, each one function that its flag picks.
"""

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model import autocast_dtype
from selector import TOP_K, top_k_candidates


# ----------------------------------------------------------------------------- anchors
def anchor_positions(loss_mask):
    """loss_mask [S] -> positions p [n] where a block may start: the anchor p and its first label
    p+1 are both supervised."""
    return ((loss_mask[:-1] > 0) & (loss_mask[1:] > 0)).nonzero().squeeze(-1)


def sample_anchors(loss_mask, num_anchors: int, generator, docs=None, per_document=False):
    """Up to num_anchors of anchor_positions, drawn uniformly without replacement, sorted. docs [S]:
    an anchor and its first label share a document. per_document: each document draws its own
    num_anchors (the public trainers' contract), so a long one cannot take its neighbours'."""
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
    """input_ids, loss_mask [N, S]; anchors, anchor_valid [N, A] -> labels x[a+j], prev x[a+j-1]
    (the teacher-forced predecessor), w0, each [N, A, B-1] for slots 1..B-1. docs [N, S]: a
    block's labels end where its anchor's document ends."""
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


# ----------------------------------------------------------------------------- the objective
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # exp decay gamma by block size, when --gamma is unset


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The objective's settings; train.py builds one from its flags. The defaults are the objective
    above; each other value names a variant under the last banner."""

    loss: str = "ce"  # the base loss: a name in BASE_LOSSES
    weighting: str = "exp"  # the position weights: a name in POSITION_WEIGHTS
    gamma: float = None  # exp's decay; None: DEFAULT_GAMMA of the block size
    dpace_alpha: float = 0.5  # D-PACE's smoothing
    selector_miss: str = "strict"  # a label outside the top-K: strict (adds nothing) or replace
    selector_weighting: str = "exp"  # the selector term's weights: exp (w) or uniform
    stop_gradient: bool = False  # the selector's CE trains the selector only, not the backbone
    chunk_blocks: int = None  # anchors per chunk of logits; None: all at once

    def __post_init__(self):
        if self.loss not in BASE_LOSSES:
            raise ValueError(f"loss must be one of {sorted(BASE_LOSSES)}, got {self.loss!r}")
        if self.weighting not in POSITION_WEIGHTS:
            raise ValueError(f"weighting must be one of {sorted(POSITION_WEIGHTS)}")

    def decay(self, block_size: int) -> float:
        """exp's gamma: the one set, or DEFAULT_GAMMA of the block size."""
        if self.gamma is None and block_size not in DEFAULT_GAMMA:
            raise ValueError(f"no default gamma for block size {block_size}; set --gamma")
        return DEFAULT_GAMMA[block_size] if self.gamma is None else self.gamma


@dataclasses.dataclass
class Objective:
    """What `objective` made for one micro-batch. The loss is numerator / denominator; train.py adds
    both over micro-batches and ranks before it divides, and calls numerator.backward()."""

    numerator: torch.Tensor  # base + alpha_t * selector
    denominator: torch.Tensor  # sum w (no gradient)
    base: torch.Tensor  # sum w * base loss
    selector: torch.Tensor  # sum w * covered * selector CE; None for a plain DFlash draft
    selector_denominator: torch.Tensor  # the uniform variant's own denominator, else None
    slots: "Slots"  # what the head said at every labelled slot
    h: torch.Tensor  # [N, A, L, H] the draft's hidden states at the labelled slots
    labels: torch.Tensor  # [N, A, L] x[a+j]
    prev: torch.Tensor  # [N, A, L] x[a+j-1], the teacher-forced predecessor
    w0: torch.Tensor  # [N, A, L] which slots count


def objective(
    draft,
    lm_head_weight,
    h,
    input_ids,
    loss_mask,
    anchors,
    anchor_valid,
    cfg=None,
    *,
    alpha_t=None,
    target_hidden=None,
    docs=None,
    sel_scale=None,
) -> Objective:
    """The objective of one micro-batch, as the module docstring writes it. h [N, A, B, H] the
    draft's hidden states; alpha_t: the selector's weight, None while it is frozen; target_hidden
    [N, S, H]: the target's final normed states (kl, tv, lk); sel_scale: uniform's (below)."""
    cfg = cfg or LossConfig()
    B = h.shape[2]
    if cfg.weighting == "exp":
        cfg = dataclasses.replace(cfg, gamma=cfg.decay(B))
    labels, prev, w0 = block_labels(input_ids, loss_mask, anchors, anchor_valid, B, docs)
    h = h[:, :, 1:]  # [N, A, L, H], L = B-1: slot 0 holds the anchor, it proposes nothing
    read = target_hidden is not None and cfg.loss != "ce"  # ce reads only the labels
    target_hidden = at_slots(target_hidden, anchors, B - 1) if read else None  # [N, A, L, H]
    s = head_at_slots(draft, lm_head_weight, h, labels, target_hidden, cfg.chunk_blocks)

    # the base loss: ce = -log q(label) by default
    w = POSITION_WEIGHTS[cfg.weighting](w0, s, cfg)  # [N, A, L]: exp(-(j-1)/gamma) by default
    base = (w * BASE_LOSSES[cfg.loss](s, w0)).sum()
    D = w.sum().detach()
    out = Objective(base, D, base, None, None, s, h, labels, prev, w0)
    if draft.candidate_selector is None:  # plain DFlash
        return out

    # the selector: a K-way CE over the unary top-K, the previous sequence token as predecessor
    hidden, cand_ids, cand_scores = h, s.cand_ids, s.cand_scores  # [N, A, L, K] the candidates
    if cfg.stop_gradient:  # variant: the selector's CE reaches neither the backbone nor the head
        hidden, cand_scores = h.detach(), cand_scores.detach()
    hit = cand_ids == labels[..., None]  # [N, A, L, K]
    label_at = hit.float().argmax(-1)  # the label's place among the K, where covered
    counted = hit.any(-1) & (w0 > 0)  # strict: a label outside the top-K adds nothing
    if cfg.selector_miss == "replace":  # variant: the label takes the weakest candidate's place
        label_score = s.label_score.detach() if cfg.stop_gradient else s.label_score
        cand_ids, cand_scores, label_at, counted = replace_weakest(
            cand_ids, cand_scores, labels, label_score, hit, label_at, w0 > 0
        )
    sigma = draft.candidate_selector.teacher_forced_scores(hidden, prev, cand_ids, cand_scores)
    sel_ce = F.cross_entropy(sigma.float().flatten(0, -2), label_at.flatten(), reduction="none")
    w_sel = w if cfg.selector_weighting == "exp" else (w0 > 0).float()  # uniform: a variant
    out.selector = (w_sel * counted.float() * sel_ce.view_as(w)).sum()
    scale = 1.0
    if cfg.selector_weighting == "uniform":  # variant: the selector's mean over its own slots
        out.selector_denominator = D_sel = w_sel.sum().detach()
        # the selector's sum over D_sel, written over the shared denominator D: times D / D_sel.
        # train.py passes the ratio of the whole step's sums (uniform_denominators), since the
        # loss divides by the step's D; called alone, the ratio is this micro-batch's
        scale = D / D_sel.clamp(min=1) if sel_scale is None else sel_scale
    if alpha_t is not None:  # alpha_t = 0 keeps the selector in the graph
        out.numerator = base + alpha_t * (out.selector * scale)
    return out


# ----------------------------------------------------------------------------- the head, in chunks
@dataclasses.dataclass
class Slots:
    """What the head says at every labelled slot: [N, A, L] each, [N, A, L, K] for the candidates.
    `grad` marks the tensors the objective trains through; the rest feed the metrics."""

    logq_label: torch.Tensor  # log q(label), q = softmax(u) the draft's distribution       grad
    accepted: torch.Tensor  # sum_v min(p_v, q_v) with the target's p, else q(label)       grad
    kl: torch.Tensor  # KL(p || q), None without the target's p                            grad
    label_score: torch.Tensor  # u(label), the label's unary score                         grad
    cand_scores: torch.Tensor  # [.., K] the unary top-K's scores, best first               grad
    cand_ids: torch.Tensor  # [.., K] the unary top-K
    argmax: torch.Tensor  # the unary argmax
    target_mass: torch.Tensor  # the target's p over the top-K, None without it


def head_at_slots(draft, lm_head_weight, h, labels, target_hidden=None, chunk_blocks=None):
    """Slots of h [N, A, L, H] with labels [N, A, L] (target_hidden [N, A, L, H] or None). The
    logits [N, A, L, V] are a step's largest tensors (Qwen3-8B: 4.7 GB a row), so they are made
    chunk_blocks anchors at a time, each recomputed in backward (checkpoint), not kept."""
    A = h.shape[1]
    # the frozen head [V, H] in the dtype its matmuls run in, cast once here: autocast would cast it
    # in every chunk and again in every recompute (1.24 GB each for Qwen3-8B), to the same values
    dtype = autocast_dtype(h.device.type)
    lm_head_weight = lm_head_weight if dtype is None else lm_head_weight.to(dtype)
    K = top_k(draft.config)
    chunk = A if not chunk_blocks else min(chunk_blocks, A)
    parts = []
    for s in range(0, A, chunk):
        part = [None if t is None else t[:, s : s + chunk] for t in (h, labels, target_hidden)]
        if chunk < A and torch.is_grad_enabled():
            parts.append(
                checkpoint(slot_numbers, draft, lm_head_weight, K, *part, use_reentrant=False)
            )
        else:
            parts.append(slot_numbers(draft, lm_head_weight, K, *part))
    return Slots(*(None if p[0] is None else torch.cat(p, dim=1) for p in zip(*parts)))


def slot_numbers(draft, lm_head_weight, K: int, h, labels, target_hidden) -> tuple:
    """Slots' fields, in order, for a chunk of c anchors: h [N, c, L, H], labels [N, c, L]."""
    N, c, L = labels.shape
    h, labels = h.flatten(0, 1), labels.flatten(0, 1)  # [M, L, H], [M, L]: M = N*c blocks
    head = lambda x: head_logits(x, lm_head_weight)
    u = draft.unary_logits(h, head).float()  # [M, L, V] the unary scores
    logq = F.log_softmax(u, -1)  # the draft's distribution q
    logq_label = logq.gather(-1, labels[..., None]).squeeze(-1)
    with torch.no_grad():
        _, cand_ids = top_k_candidates(u, K)  # [M, L, K]
    accepted, kl, target_mass = logq_label.exp(), None, None
    if target_hidden is not None:
        logp = F.log_softmax(head(target_hidden.flatten(0, 1)).float(), -1)  # the target's p
        p = logp.exp()
        accepted = torch.minimum(p, logq.exp()).sum(-1)
        kl = (p * (logp - logq)).sum(-1)
        target_mass = logp.gather(-1, cand_ids).exp().sum(-1).detach()
    made = (
        logq_label,
        accepted,
        kl,
        u.gather(-1, labels[..., None]).squeeze(-1),  # u(label)
        u.gather(-1, cand_ids),  # the candidates' scores, with gradient
        cand_ids,
        u.argmax(-1),
        target_mass,
    )
    return tuple(None if t is None else t.view(N, c, *t.shape[1:]) for t in made)


def top_k(c) -> int:
    """K of the unary top-K: selector_top_k, or selector.TOP_K for a plain draft's metrics."""
    return min(c.selector_top_k or TOP_K, c.vocab_size)


def head_logits(x, lm_head_weight):
    """x [..., H] -> x @ W_lm^T [..., V], as one 2-D GEMM: a strided 3-D x (h[:, :, 1:]) would go
    to a batched matmul, about 3x slower on a CPU."""
    return (x.reshape(-1, x.shape[-1]) @ lm_head_weight.t()).view(*x.shape[:-1], -1)


def at_slots(target_hidden, anchors, L: int):
    """target_hidden [N, S, H] -> [N, A, L, H]: at slot j of the block at anchor a, the target's
    state at position a+j-1, the one that predicts the label x[a+j]."""
    N, S, H = target_hidden.shape
    pos = (anchors[..., None] + torch.arange(L, device=anchors.device)).clamp(max=S - 1)
    return target_hidden.gather(1, pos.flatten(1)[..., None].expand(-1, -1, H)).view(N, -1, L, H)


# ----------------------------------------------------------------------------- the variants
# Each is a public trainer's option, off by default here (docs/semantics.md, section 4). A new base
# loss or position weighting is one function below and one entry in its table: train.py's flag
# takes the table's names (docs/training.md, "A variant of your own").
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
def ce(s: Slots, w0):
    """-log q(label), per slot [N, A, L]: the default."""
    return -s.logq_label


def tv(s: Slots, w0):
    """1 - accepted mass: 1 - sum_v min(p_v, q_v), or 1 - q(label) without the target."""
    return 1 - s.accepted


def kl(s: Slots, w0):
    """KL(p || q) to the target's distribution p at the slot."""
    if s.kl is None:
        raise ValueError("the kl loss needs the target's hidden states (target_hidden)")
    return s.kl


def lk(s: Slots, w0):
    """lambda * ce + (1 - lambda) * tv, lambda = exp(-sum w0 * accepted / sum w0) over the
    micro-batch, detached: a number, not a path for gradients."""
    lam = math.exp(-((w0 * s.accepted).detach().sum() / w0.sum().clamp(min=1)).item())
    return lam * ce(s, w0) + (1 - lam) * tv(s, w0)


BASE_LOSSES = {"ce": ce, "tv": tv, "kl": kl, "lk": lk}  # --loss


def exp_position_weights(w0, s: Slots, cfg: LossConfig):
    """The default: w0 * exp(-(j-1)/gamma) (exp_weights)."""
    return exp_weights(w0, cfg.gamma)


def dpace_position_weights(w0, s: Slots, cfg: LossConfig):
    """D-PACE, at the draft's own q(label) (dpace_weights)."""
    return dpace_weights(s.logq_label.exp().detach(), w0, cfg.dpace_alpha)


POSITION_WEIGHTS = {"exp": exp_position_weights, "dpace": dpace_position_weights}


@torch.no_grad()
def dpace_weights(q, w0, alpha: float):
    """D-PACE: weight slot j by the expected future credit it unlocks, d_j = sum_{t>=j} P_t w0_t,
    q [..., L] the draft's probability of each label; s_j = (1-alpha) q_j + alpha on valid slots,
    else 1; P_j = prod_{i<=j} s_i the chance the block survives to j."""
    s = torch.where(w0 > 0, (1 - alpha) * q + alpha, torch.ones_like(q))
    P = s.cumprod(-1)
    d = (P * w0).flip(-1).cumsum(-1).flip(-1)
    return w0 * d


def replace_weakest(cand_ids, cand_scores, labels, label_score, hit, label_at, valid):
    """replace: a supervised label outside the top-K takes the K-th (weakest) candidate's place,
    with its own unary score, so every supervised slot counts. [.., K] and [..] tensors."""
    K = cand_ids.shape[-1]
    replaced = (valid & ~hit.any(-1))[..., None] & (
        torch.arange(K, device=cand_ids.device) == K - 1
    )
    cand_ids = torch.where(replaced, labels[..., None], cand_ids)
    cand_scores = torch.where(replaced, label_score[..., None], cand_scores)
    label_at = torch.where(replaced.any(-1), K - 1, label_at)
    return cand_ids, cand_scores, label_at, valid


def uniform_denominators(cfg, block_size: int, input_ids, loss_mask, anchors, anchor_valid, docs):
    """uniform's [sum w, D_sel] of a micro-batch from its data alone (D_sel: slots with w0 > 0), so
    that train.py knows the step's D / D_sel before the first backward. exp weights only."""
    _, _, w0 = block_labels(input_ids, loss_mask, anchors, anchor_valid, block_size, docs)
    return torch.stack([exp_weights(w0, cfg.decay(block_size)).sum(), (w0 > 0).float().sum()])
