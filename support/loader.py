"""The machinery that feeds data.py's batches to train.py: static shapes for compiled steps, and
the micro-batches made ahead by DataLoader workers into pinned memory. Nothing here changes what a
step trains on.
"""

import torch

# ----------------------------------------------------------------------------- static shapes
# A compiled step compiles again for each new shape: rows padded to LENGTH_UNIT tokens times a power
# of two, anchors to --num-anchors times one, meet a handful of shapes instead of one a step.
LENGTH_UNIT = 64


def static_size(n: int, unit: int) -> int:
    """The smallest unit * 2^k >= n (k >= 0)."""
    return unit * (1 << (-(-n // unit) - 1).bit_length())


def pad_batch(batch, length: int, num_anchors: int) -> dict:
    """A batch right-padded to `length` tokens and `num_anchors` anchors, as collate pads (invalid
    anchors weigh 0): the loss, its gradients and the metrics are the unpadded batch's."""
    N, S = batch["input_ids"].shape
    A = batch["anchors"].shape[1]
    if length < S or num_anchors < A:
        raise ValueError(f"cannot pad {S} tokens, {A} anchors to {length}, {num_anchors}")
    out = {}
    for k, v in batch.items():
        size = num_anchors if k in ("anchors", "anchor_valid") else length
        out[k] = v.new_full((N, size, *v.shape[2:]), -1 if k == "docs" else 0)
        out[k][:, : v.shape[1]] = v
    return out


def static_shapes(batch, num_anchors: int) -> dict:
    """pad_batch to static_size: S to LENGTH_UNIT * 2^k tokens, the anchors to num_anchors * 2^k."""
    S, A = batch["input_ids"].shape[1], batch["anchors"].shape[1]
    return pad_batch(batch, static_size(S, LENGTH_UNIT), static_size(A, num_anchors))


# ---------------------------------------------------------------------------- the order, made ahead
class MicroBatches(torch.utils.data.Dataset):
    """A run's micro-batches, made in the DataLoader's workers: item (epoch, row numbers) ->
    collate's batch on the CPU (collate: data.collate, passed in so that imports flow one way)."""

    def __init__(self, collate, samples, rows, num_anchors, seed, per_document=False, static=False):
        self.collate, self.samples, self.rows = collate, samples, rows
        self.num_anchors, self.seed = num_anchors, seed
        self.per_document, self.static = per_document, static

    def __getitem__(self, item):
        epoch, batch_rows = item
        keys = [epoch * len(self.rows) + r for r in batch_rows]
        docs = [[self.samples[j] for j in self.rows[r]] for r in batch_rows]
        batch = self.collate(docs, keys, self.num_anchors, self.seed, "cpu", self.per_document)
        return static_shapes(batch, self.num_anchors) if self.static else batch


def data_loader(dataset, schedule, workers: int, pin: bool):
    """The items of `schedule` made ahead by `workers` processes (0: here, when asked), in order,
    pinned where pin; its own generator leaves the global RNG untouched."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,  # an item is a whole micro-batch
        sampler=schedule,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=2 if workers else None,
        generator=torch.Generator(),
    )


def batches(collate, plan, samples, rows, args, static: bool, pin: bool):
    """train.py's micro-batches in plan's order (data.micro_batch_plan), made ahead on the host."""
    per_doc = args.anchors_per == "document"
    made = MicroBatches(collate, samples, rows, args.num_anchors, args.seed, per_doc, static)
    return iter(data_loader(made, plan, args.data_workers, pin))


def to_device(batch, device) -> dict:
    """Copy a batch to device; from pinned memory without waiting for the GPU (non_blocking)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
