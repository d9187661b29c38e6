"""From conversations to the batch a training step reads: packing into rows, anchors, padding.

A row is one conversation, or with `train.py --pack` several of them (documents) filled greedily up
to --max-length tokens, so that a batch of conversations of mixed lengths is not mostly padding. A
packed row trains exactly as its documents would one per row (a test checks hidden states, loss,
metrics and gradients):

    positions   restart at 0 in every document (RoPE sees each conversation as it was)
    anchors     a block starts at p only if p and p+1 are supervised and in the same document
    labels      a block's labels end at its document's end (loss.block_labels, docs)
    attention   a block reads the context of its own document only (attention.attention_rule)
    target      online, the target reads each conversation on its own (per_document)
"""
import torch

import prepare


def plan_rows(lengths, max_length: int) -> list:
    """Sample indices per row, filled next-fit in the given order: a sample joins the open row if the
    row stays within max_length tokens, else it opens the next row. A sample longer than max_length
    gets a row of its own. Deterministic and independent of the seed and of the rank layout."""
    rows, used = [], 0
    for i, n in enumerate(lengths):
        if not rows or used + n > max_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def lengths(samples) -> list:
    """Token counts of samples; of a streamed feature directory (features.FeatureSamples) only the
    input_ids are read, not the features."""
    read = samples.read if hasattr(samples, "read") else lambda i, keys: samples[i]
    return [len(read(i, ["input_ids"])["input_ids"]) for i in range(len(samples))]


def join(docs) -> dict:
    """One row from a list of samples: their tensors concatenated, plus positions (restarting per
    document) and docs (the document's number), each [S]."""
    row = {k: torch.cat([d[k] for d in docs]) for k in docs[0]}
    row["positions"] = torch.cat([torch.arange(len(d["input_ids"])) for d in docs])
    row["docs"] = torch.cat([torch.full((len(d["input_ids"]),), i) for i, d in enumerate(docs)])
    return row


def sample_anchors(loss_mask, num_anchors: int, generator, docs=None):
    """Up to num_anchors of the anchor positions (prepare.anchor_positions), drawn uniformly without
    replacement, sorted (SPEC section 4). docs [S]: an anchor and its first label share a document."""
    cand = prepare.anchor_positions(loss_mask)
    if docs is not None:
        cand = cand[docs[cand] == docs[cand + 1]]
    pick = torch.randperm(len(cand), generator=generator)[:num_anchors]
    return cand[pick].sort().values


def collate(rows, keys, num_anchors, seed, device):
    """Right-pad rows (each a list of samples, its documents) into a batch on device; anchors are seeded
    per (seed, key) so that every rank / accumulation layout draws the same anchors for the same row.
    Padding has position 0 and document -1, no anchor and no label."""
    rows = [join(docs) for docs in rows]
    N, S = len(rows), max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": torch.zeros(N, S, dtype=torch.long), "loss_mask": torch.zeros(N, S, dtype=torch.long),
             "attention_mask": torch.zeros(N, S, dtype=torch.long), "positions": torch.zeros(N, S, dtype=torch.long),
             "docs": torch.full((N, S), -1, dtype=torch.long)}
    for name in ("features", "target_hidden"):
        if name in rows[0]:
            batch[name] = torch.zeros(N, S, rows[0][name].shape[-1])
    anchors = []
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["attention_mask"][i, :n] = 1
        for name in ("input_ids", "loss_mask", "positions", "docs", "features", "target_hidden"):
            if name in batch:
                batch[name][i, :n] = r[name]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + keys[i])
        anchors.append(sample_anchors(r["loss_mask"], num_anchors, gen, r["docs"]))
    A = max(len(a) for a in anchors)
    batch["anchors"] = torch.zeros(N, A, dtype=torch.long)
    batch["anchor_valid"] = torch.zeros(N, A, dtype=torch.bool)
    for i, a in enumerate(anchors):
        batch["anchors"][i, :len(a)], batch["anchor_valid"][i, :len(a)] = a, True
    return {k: v.to(device) for k, v in batch.items()}


# ----------------------------------------------------------------------------- online: the target per document
def per_document(batch):
    """The documents of packed rows as rows of their own, for the target, whose causal attention would
    cross documents in a packed row: -> input_ids, attention_mask [D, L] (right-padded), and back(),
    which puts the target's outputs [D, L, F] where their tokens sit in the rows: [N, S, F], padding 0."""
    spans = []                                                   # (row, start, length) per document
    for row, docs in enumerate(batch["docs"].tolist()):
        spans += [(row, docs.index(d), docs.count(d)) for d in range(max(docs) + 1)]
    ids = torch.zeros(len(spans), max(n for _, _, n in spans), dtype=torch.long, device=batch["input_ids"].device)
    mask = torch.zeros_like(ids)
    for d, (row, start, n) in enumerate(spans):
        ids[d, :n], mask[d, :n] = batch["input_ids"][row, start:start + n], 1

    def back(values):
        out = values.new_zeros(*batch["input_ids"].shape, values.shape[-1])
        for d, (row, start, n) in enumerate(spans):
            out[row, start:start + n] = values[d, :n]
        return out
    return ids, mask, back
