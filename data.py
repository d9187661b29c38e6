"""Training data: the batch a training step reads, its anchors drawn by loss.py's rule
(docs/semantics.md, section 4).

    conversations or prepared features -> samples      load_samples, load_split
    -> rows (--pack: several a row), anchors, padding  plan_rows, schedule, collate
    -> each rank's micro-batches, in the run's order   step_micro_batches, micro_batch_plan
    online: the target's features, document by document  add_target_features

prepare.py makes the data; support/loader.py makes train.py's batches ahead in worker processes
and, for compiled steps, pads them to a few static shapes: neither changes what a step trains on.

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

import itertools
import os

import torch

import model
from loss import anchor_positions, sample_anchors
from support.common import UsageError
from support.conversations import check_template_kwargs, read_conversations, tokenize_conversation
from support.features import load_features, read_manifest


# ----------------------------------------------------------------------------- what train.py reads
def load_samples(path: str, online: bool, tokenizer, max_length: int, chat_template_kwargs=None):
    """train.py's sequences, those with an anchor: a conversations JSONL tokenised here (online),
    or prepare.py's feature directory, streamed (offline; its manifest names the kwargs)."""
    if online:
        kw = chat_template_kwargs or {}
        conversations, _ = read_conversations(path, chat_template_kwargs=kw)
        pairs = [tokenize_conversation(tokenizer, m, max_length, kw) for m in conversations]
        return [{"input_ids": i, "loss_mask": m} for i, m in pairs if len(anchor_positions(m))]
    samples = load_features(path)
    # manifests from before prepare.py recorded the kwargs: rendered without any
    made = read_manifest(path).get("chat_template_kwargs", {})
    try:
        check_template_kwargs(made, chat_template_kwargs)
    except UsageError as e:
        raise UsageError(f"{os.path.join(path, 'manifest.json')}: {e}") from None
    # no features read
    masks = (samples.read(i, ["loss_mask"])["loss_mask"] for i in range(len(samples)))
    return samples[[i for i, mask in enumerate(masks) if len(anchor_positions(mask))]]


def load_split(args, tokenizer) -> tuple:
    """train.py's sequences -> (training, held-out). The held-out ones are --eval-data's or, without
    it, the last --eval-fraction of --data's (one at least, where it has two); --num-samples keeps
    the first N of the rest."""
    kw = args.chat_template_kwargs
    load = lambda path: load_samples(path, args.online, tokenizer, args.max_length, kw)
    samples = load(args.data)
    if args.eval_data:
        return samples[: args.num_samples], load(args.eval_data)
    n_eval = max(1, int(len(samples) * args.eval_fraction)) if len(samples) > 1 else 0
    return samples[: len(samples) - n_eval][: args.num_samples], samples[len(samples) - n_eval :]


# ----------------------------------------------------------------------------- rows and batches
def plan_rows(lengths, max_length: int) -> list:
    """Sample indices per row, filled next-fit in the given order: a sample joins the open row if
    it stays within max_length tokens, else opens the next. Independent of the seed and ranks."""
    rows, used = [], 0
    for i, n in enumerate(lengths):
        if not rows or used + n > max_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def lengths(samples) -> list:
    """Token counts of samples; of a streamed feature directory only the input_ids are read."""
    read = samples.read if hasattr(samples, "read") else lambda i, keys: samples[i]
    return [len(read(i, ["input_ids"])["input_ids"]) for i in range(len(samples))]


def schedule(samples, args, world) -> tuple:
    """-> (rows of sample indices (--pack: plan_rows'), rows per step, steps per epoch, total)."""
    rows = [[i] for i in range(len(samples))]
    if args.pack:
        rows = plan_rows(lengths(samples), args.max_length)
    per_step = world * args.grad_accum * args.batch_size
    steps_per_epoch = len(rows) // per_step
    if steps_per_epoch == 0:
        raise UsageError(
            f"{args.data}: {len(rows)} training rows cannot fill one step of {per_step}"
        )
    return rows, per_step, steps_per_epoch, args.max_steps or (args.epochs or 1) * steps_per_epoch


def join(docs) -> dict:
    """One row from a list of samples: their tensors concatenated, plus positions (restarting per
    document) and docs (the document's number), each [S]; one document's row copies nothing."""
    row = dict(docs[0]) if len(docs) == 1 else {k: torch.cat([d[k] for d in docs]) for k in docs[0]}
    row["positions"] = torch.cat([torch.arange(len(d["input_ids"])) for d in docs])
    row["docs"] = torch.cat([torch.full((len(d["input_ids"]),), i) for i, d in enumerate(docs)])
    return row


def collate(rows, keys, num_anchors, seed, device, per_document=False, anchors=None):
    """Right-pad rows (each a list of samples, its documents) into a batch on device. Anchors are
    seeded per (seed, key), so every rank / accumulation layout draws the same for the same row,
    or given (anchors[i]: row i's, tools/served.py). Padding: position 0, document -1, no anchor."""
    rows = [join(docs) for docs in rows]
    N, S = len(rows), max(len(r["input_ids"]) for r in rows)
    batch = {
        "input_ids": torch.zeros(N, S, dtype=torch.long),
        "loss_mask": torch.zeros(N, S, dtype=torch.long),
        "attention_mask": torch.zeros(N, S, dtype=torch.long),
        "positions": torch.zeros(N, S, dtype=torch.long),
        "docs": torch.full((N, S), -1, dtype=torch.long),
    }
    for name in ("features", "target_hidden"):
        if name in rows[0]:
            # features in their stored dtype (bf16: half the bytes to copy); target_hidden fp32
            dtype = rows[0][name].dtype if name == "features" else torch.float32
            batch[name] = torch.zeros(N, S, rows[0][name].shape[-1], dtype=dtype)
    given, anchors = anchors, []
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["attention_mask"][i, :n] = 1
        for name in ("input_ids", "loss_mask", "positions", "docs", "features", "target_hidden"):
            if name in batch:
                batch[name][i, :n] = r[name]
        if given is not None:
            anchors.append(torch.as_tensor(given[i], dtype=torch.long))
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + keys[i])
        anchors.append(sample_anchors(r["loss_mask"], num_anchors, gen, r["docs"], per_document))
    A = max(len(a) for a in anchors)
    batch["anchors"] = torch.zeros(N, A, dtype=torch.long)
    batch["anchor_valid"] = torch.zeros(N, A, dtype=torch.bool)
    for i, a in enumerate(anchors):
        batch["anchors"][i, : len(a)], batch["anchor_valid"][i, : len(a)] = a, True
    return {k: v.to(device) for k, v in batch.items()}


# --------------------------------------------------------------------------------- the run's order
def step_micro_batches(step, steps_per_epoch, num_rows, args, rank, world):
    """This rank's micro-batches of step `step`: (epoch, [row indices] per micro-batch). Micro-batch
    m of rank r takes slot m * world + r of the epoch's seeded order, so every split into ranks x
    accumulation sees the same rows."""
    epoch, within = divmod(step, steps_per_epoch)
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(args.seed + epoch))
    firsts = [
        (within * args.grad_accum * world + m * world + rank) * args.batch_size
        for m in range(args.grad_accum)
    ]
    return epoch, [order[f : f + args.batch_size].tolist() for f in firsts]


def micro_batch_plan(start, stop, steps_per_epoch, num_rows, args, rank, world):
    """(epoch, row indices) of this rank's micro-batches of steps start..stop-1, in order: what
    support/loader.py makes ahead; stop None: open-ended, as train.py --max-seconds wants."""
    for step in range(start, stop) if stop is not None else itertools.count(start):
        epoch, micro = step_micro_batches(step, steps_per_epoch, num_rows, args, rank, world)
        yield from ((epoch, rows) for rows in micro)


# ------------------------------------------------------------------ online: the target per document
def per_document(batch):
    """The documents of packed rows as rows of their own, so the target's attention stays inside
    each -> input_ids, attention_mask [D, L], and back(): outputs [D, L, F] -> rows [N, S, F]."""
    spans = []  # (row, start, length) per document
    for row, docs in enumerate(batch["docs"].tolist()):
        spans += [(row, docs.index(d), docs.count(d)) for d in range(max(docs) + 1)]
    L, device = max(n for _, _, n in spans), batch["input_ids"].device
    ids = torch.zeros(len(spans), L, dtype=torch.long, device=device)  # [D, L]
    mask = torch.zeros_like(ids)
    for d, (row, start, n) in enumerate(spans):
        ids[d, :n], mask[d, :n] = batch["input_ids"][row, start : start + n], 1

    def back(values):
        out = values.new_zeros(*batch["input_ids"].shape, values.shape[-1])
        for d, (row, start, n) in enumerate(spans):
            out[row, start : start + n] = values[d, :n]
        return out

    return ids, mask, back


def add_target_features(batch, target, cfg, need_final: bool, packed: bool):
    """Online: the live target's features of a batch (and for kl its final hidden state)."""
    whole = batch["input_ids"], batch["attention_mask"], None
    ids, mask, back = per_document(batch) if packed else whole
    kw = dict(final_hidden=need_final, use_cache=False, logits_to_keep=1)
    out = model.capture_features(
        target, cfg.target_layer_ids, **kw, input_ids=ids, attention_mask=mask
    )
    for name, value in [("features", out[1])] + ([("target_hidden", out[2])] if need_final else []):
        batch[name] = back(value.float()) if packed else value.float()
