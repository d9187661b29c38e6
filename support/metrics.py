"""What the objective's logits say besides the loss, its reduction over ranks, and acceptance.json.

Every metric is a (numerator, denominator) pair: objective_with_metrics runs loss.objective and
measures one micro-batch's pairs from the tensors of its chunks; train.py adds them over
micro-batches (add_into), sums them over ranks and divides once (reduce_metrics), so a metric is a
ratio of global sums whatever the rank / accumulation split. The metrics are measured
teacher-forced, as the loss is: how often the unary argmax, the top-K, the selector and the
selector's own greedy path get the label, and the accepted lengths those imply (tau = 1 + the
leading run of right labels). At the final held-out evaluation the per-slot statistics go to
acceptance.json (tools/plot.py draws them).
"""

import os

import torch
import torch.distributed as dist

import loss
from support.common import UsageError, read_json, write_json

# train.py's held-out acceptance statistics, beside ckpt.pt and copied beside the export
# (tools/plot.py draws them). A file of its own, so config.json stays the public contract.
ACCEPTANCE = "acceptance.json"


# ----------------------------------------------------------------------------- the loss, measured
def objective_with_metrics(
    draft,
    lm_head_weight,
    h,
    input_ids,
    loss_mask,
    anchors,
    anchor_valid,
    cfg=loss.LossConfig(),
    *,
    acceptance=False,
    **kw,
):
    """loss.objective (its arguments, kw: target_hidden, alpha_t, docs), and the metrics of the
    same chunks: {"numerator", "denominator", "metrics"}, where metrics maps a name to a
    (numerator, denominator) pair of detached tensors. acceptance: add the per-slot statistics of
    acceptance.json (held-out evaluation). loss.objective's own check of target_hidden guards its
    callers; here a --loss kl run on features without them is the user's to fix."""
    if cfg.loss == "kl" and kw.get("target_hidden") is None:
        raise UsageError(
            "--loss kl needs the target's hidden states: features made with prepare.py "
            "--save-target-hidden, or --online"
        )
    terms, selector = {}, draft.candidate_selector

    def observe(*chunk):  # h, u, logq, logp, labels, prev, w0, cand_scores, cand_ids
        loss.add_sums(terms, metric_terms(selector, *chunk, acceptance))

    out = loss.objective(
        draft,
        lm_head_weight,
        h,
        input_ids,
        loss_mask,
        anchors,
        anchor_valid,
        cfg,
        observe=observe,
        **kw,
    )
    D = out["denominator"]
    own = {"loss": (out["numerator"].detach(), D), "base_loss": (out["base"].detach(), D)}
    if "selector" in out:
        own["sel_loss"] = (out["selector"].detach(), out.get("selector_denominator", D))
    _, _, w0 = loss.block_labels(
        input_ids, loss_mask, anchors, anchor_valid, h.shape[2], kw.get("docs")
    )
    metrics = pairs(terms, own, anchor_valid, coverage(loss_mask, anchors, w0), acceptance)
    return {"numerator": out["numerator"], "denominator": D, "metrics": metrics}


# ----------------------------------------------------------------------------- one chunk's sums
def coverage(loss_mask, anchors, w0):
    """(supervised tokens that some anchored block labels, supervised tokens): the share of the data
    a step trains on. loss_mask [N, S], anchors [N, A], w0 [N, A, B-1] (loss.block_labels) -> two
    scalars. Token a+j is labelled by the block at anchor a where w0 > 0 (j = 1..B-1)."""
    S = loss_mask.shape[1]
    pos = anchors[..., None] + torch.arange(1, w0.shape[-1] + 1, device=anchors.device)
    labelled = torch.zeros(loss_mask.shape, device=w0.device).scatter_reduce(
        1, pos.clamp(max=S - 1).flatten(1), (w0 > 0).float().flatten(1), "amax"
    )  # [N, S]: 1 where some block's valid slot is
    return labelled.sum(), loss_mask.float().sum()


def leading_run(ok):
    """Length of the leading run of True along the last dim: [..., L] bool -> [...] float."""
    return ok.float().cumprod(-1).sum(-1)


@torch.no_grad()
def metric_terms(
    selector, h, u, logq, logp, labels, prev, w0, cand_scores, cand_ids, acceptance=False
):
    """Metric sums of a chunk of M blocks, no gradient: how often the unary argmax, the top-K, the
    selector (teacher-forced) and the selector's own greedy path get the label, and the accepted
    lengths those imply. h [M, L, H], u / logq / logp [M, L, V] (logq unread: the chunk comes
    whole; logp None without the target), labels / prev / w0 [M, L], cand_scores / cand_ids
    [M, L, K] the unary top-K. With acceptance, per slot [L] too: what acceptance.json holds."""
    valid = w0 > 0
    n = valid.float()
    hit = cand_ids == labels[..., None]  # [M, L, K]
    covered = hit.any(-1) & valid
    greedy_ok = (u.argmax(-1) == labels) & valid
    out = dict(
        unary_acc=greedy_ok.float().sum(),
        tokens=n.sum(),
        topk_recall=covered.float().sum(),
        accept_unary=leading_run(greedy_ok).sum(),
        accept_oracle=leading_run(covered).sum(),
    )
    # the target's mass in the top-K
    if logp is not None:
        out["topk_target_mass"] = (n * logp.gather(-1, cand_ids).exp().sum(-1)).sum()
    if acceptance:  # blocks whose path is right up to slot j
        out["run_unary"] = greedy_ok.float().cumprod(-1).sum(0)
    if selector is None:
        return out
    label_idx = hit.float().argmax(-1)
    strict = selector.teacher_forced_scores(h, prev, cand_ids, cand_scores).float()  # [M, L, K]
    cov = covered.float()
    out.update(
        sel_acc=(cov * (strict.argmax(-1) == label_idx).float()).sum(),
        sel_covered=cov.sum(),
    )
    # greedy self-conditioned path: walk from the anchor, feeding back its own choices
    path, _ = selector.walk(selector.lattice(h, prev[:, 0], cand_ids, cand_scores), cand_ids)
    ok = (path == labels) & valid
    out["path_num"], out["path_den"] = ok.float().sum(0), n.sum(0)  # [L] accuracy per position
    out["accept_selector"] = leading_run(ok).sum()
    if acceptance:
        out["run_selector"] = ok.float().cumprod(-1).sum(0)
    return out


# ----------------------------------------------------------------------------- one micro-batch
def pairs(t, own, anchor_valid, coverage, acceptance=False):
    """A micro-batch's metrics {name: (numerator, denominator)}: the objective's own pairs (own:
    loss, base_loss and, with a selector, sel_loss), then the ratios of metric_terms' sums t (added
    over the chunks, detached). anchor_valid [N, A]; coverage: coverage()'s pair. An accepted
    length counts the bonus token: 1 + the leading run, per valid block."""
    blocks = (anchor_valid.float().sum()).detach()
    out = {
        "loss": own["loss"],
        "base_loss": own["base_loss"],
        "unary_acc": (t["unary_acc"], t["tokens"]),
        "topk_recall": (t["topk_recall"], t["tokens"]),
        "accept_unary": (t["accept_unary"] + blocks, blocks),
        "accept_oracle": (t["accept_oracle"] + blocks, blocks),
        "coverage": coverage,
    }
    if "topk_target_mass" in t:  # only where the target's distribution was given
        out["topk_target_mass"] = (t["topk_target_mass"], t["tokens"])
    if "sel_loss" in own:
        out.update(
            sel_loss=own["sel_loss"],
            sel_acc=(t["sel_acc"], t["sel_covered"]),
            accept_selector=(t["accept_selector"] + blocks, blocks),
            path_acc=(t["path_num"], t["path_den"]),
        )
    for mode in ("unary", "selector") if acceptance else ():  # r_j per slot j
        if f"run_{mode}" in t:
            out[f"accepted_at_{mode}"] = (t[f"run_{mode}"], blocks.expand_as(t[f"run_{mode}"]))
    return out


# --------------------------------------------------------------------- over micro-batches and ranks
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


# ----------------------------------------------------------------------------- acceptance.json
def acceptance_file(path: str) -> str:
    """Where a draft's acceptance statistics live: in its directory (an export or a run), or beside
    ckpt.pt."""
    return os.path.join(
        path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)), ACCEPTANCE
    )


def save_acceptance(out_dir, metrics: dict, cfg, step):
    """OUT_DIR/acceptance.json from the final held-out metrics (popped from them): per mode
    (selector, unary) the share of blocks whose greedy path was right up to each slot. export.py
    copies it beside the export."""
    out = {"block_size": cfg.block_size, "step": step}
    for mode in ("selector", "unary"):
        if f"accepted_at_{mode}" in metrics:
            accepted = metrics.pop(f"accepted_at_{mode}")  # a 1-element metric is a number
            out[mode] = {"accepted": accepted if isinstance(accepted, list) else [accepted]}
    write_json(os.path.join(out_dir, ACCEPTANCE), out)


def record_served(out_dir, served: dict):
    """Add train.py's served evaluation (served tau beside teacher-forced tau) to
    OUT_DIR/acceptance.json, under "served"."""
    path = os.path.join(out_dir, ACCEPTANCE)
    write_json(path, dict(read_json(path), served=served))


def read_acceptance(path: str, block_size: int):
    """The held-out acceptance statistics recorded with the draft at path, or None if it has none:
    {mode: {"accepted": [B-1 rates]}} for mode selector and / or unary (their meaning:
    save_acceptance)."""
    file = acceptance_file(path)
    if not os.path.isfile(file):
        return None
    d, L = read_json(file), block_size - 1
    if not isinstance(d, dict):
        raise UsageError(f"{file}: not a JSON object")
    unknown = sorted(set(d) - {"block_size", "step", "selector", "unary", "served"})
    if unknown or d.get("block_size") != block_size:
        raise UsageError(
            f"{file}: block_size {d.get('block_size')!r} (the draft's: {block_size}), "
            f"unknown keys {unknown}"
        )
    shares = lambda v, n: (
        isinstance(v, list)
        and len(v) == n
        and all(isinstance(x, (int, float)) and 0 <= x <= 1 for x in v)
    )
    for mode in {"selector", "unary"} & set(d):
        m = d[mode] if isinstance(d[mode], dict) else {}
        if not (set(m) <= {"accepted"} and shares(m.get("accepted"), L)):
            raise UsageError(
                f"{file}: {mode} must hold accepted: {L} rates in [0, 1], nothing else"
            )
    return {mode: d[mode] for mode in ("selector", "unary") if mode in d}
