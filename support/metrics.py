"""What the objective's logits say besides the loss, its reduction over ranks, and acceptance.json.

Every metric is a (numerator, denominator) pair: `measure` reads one micro-batch's from the record
loss.objective returns (loss.Objective and its loss.Slots); train.py adds them over micro-batches
(add_into), sums them over ranks and divides once (reduce_metrics), so a metric is a ratio of global
sums whatever the rank / accumulation split. The metrics are measured teacher-forced, as the loss
is: how often the unary argmax, the top-K, the selector and the selector's own greedy path get the
label, and the accepted lengths those imply (tau = 1 + the leading run of right labels). At the
final held-out evaluation the per-slot statistics go to acceptance.json (tools/plot.py draws them).
"""

import os

import torch
import torch.distributed as dist

import loss
from support.common import UsageError, read_json, write_json

# train.py's held-out acceptance statistics, beside ckpt.pt and copied beside the export
# (tools/plot.py draws them). A file of its own, so config.json stays the public contract.
ACCEPTANCE = "acceptance.json"


# ----------------------------------------------------------------------------- one micro-batch
@torch.no_grad()
def measure(selector, out: loss.Objective, loss_mask, anchors, anchor_valid, acceptance=False):
    """A micro-batch's metrics {name: (numerator, denominator)}, detached, from what the objective
    made (out): its base and selector losses, how often the unary argmax, the top-K, the selector
    (teacher-forced) and the selector's own greedy path get the label, and the accepted lengths
    those imply, counting the bonus token (1 + the leading run, per valid block). loss_mask [N, S],
    anchors and anchor_valid [N, A]; acceptance: the per-slot runs of acceptance.json too."""
    s, flat = out.slots, lambda t: t.flatten(0, 1)  # blocks [N, A, ...] -> [M, ...]
    labels, w0, cand_ids = flat(out.labels), flat(out.w0), flat(s.cand_ids)
    valid = w0 > 0
    n, blocks, D = valid.float(), anchor_valid.float().sum(), out.denominator
    hit = cand_ids == labels[..., None]  # [M, L, K]: where the label is among the top-K
    covered = hit.any(-1) & valid
    greedy_ok = (flat(s.argmax) == labels) & valid
    m = {
        "base_loss": (out.base.detach(), D),
        "unary_acc": (greedy_ok.float().sum(), n.sum()),
        "topk_recall": (covered.float().sum(), n.sum()),
        "accept_unary": (leading_run(greedy_ok).sum() + blocks, blocks),
        "accept_oracle": (leading_run(covered).sum() + blocks, blocks),
        "coverage": coverage(loss_mask, anchors, out.w0),
    }
    if s.target_mass is not None:  # only where the target's distribution was given
        m["topk_target_mass"] = ((n * flat(s.target_mass)).sum(), n.sum())
    runs = {"unary": greedy_ok}
    if out.selector is not None:
        h, prev, cand_scores = flat(out.h), flat(out.prev), flat(s.cand_scores)
        strict = selector.teacher_forced_scores(h, prev, cand_ids, cand_scores).float()
        right = (strict.argmax(-1) == hit.float().argmax(-1)).float()
        # the greedy self-conditioned path: walk from the anchor, fed its own choices
        path, _ = selector.walk(selector.lattice(h, prev[:, 0], cand_ids, cand_scores), cand_ids)
        ok = runs["selector"] = (path == labels) & valid
        m.update(
            sel_loss=(
                out.selector.detach(),
                D if out.selector_denominator is None else out.selector_denominator,
            ),
            sel_acc=((covered.float() * right).sum(), covered.float().sum()),
            accept_selector=(leading_run(ok).sum() + blocks, blocks),
            path_acc=(ok.float().sum(0), n.sum(0)),  # [L] accuracy per position
        )
    for mode, ok in runs.items() if acceptance else ():  # r_j: blocks right up to slot j
        m[f"accepted_at_{mode}"] = (ok.float().cumprod(-1).sum(0), blocks.expand(ok.shape[-1]))
    return m


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
    """Add the served evaluation of tools/served.py (served tau beside teacher-forced tau) to
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
