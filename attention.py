"""Which keys a block query may read: one rule, and the masks that apply it (docs/semantics.md,
section 1; model.Attention).

Training flattens A blocks of B slots into Q = A * B queries over keys [C context rows ; Q block
rows]. A query reads only the context before its anchor and the slots of its own block:

    attention_rule        may a query read a key? (elementwise: one rule for every path)
    attention_keys        the keys' (position, block id, document): context rows, then block rows
    block_attention_mask  the rule on every (query, key) pair: a dense [N, 1, Q, C + Q] boolean
                          mask for F.scaled_dot_product_attention, the readable reference and the
                          CPU path

support/kernels.py applies the same rule faster (flex_block_mask: a FlexAttention BlockMask that
skips the tiles of scores no query may read) and runs the masks on each device: speed and memory,
never which key a query reads.

Packed rows (train.py --pack, data.py) add documents: a query reads context of its own document
only.
"""

import torch


def attention_rule(
    q_anchor, q_pos, q_block, q_doc, k_pos, k_block, k_doc, causal: bool, window=None
):
    """May a block query read a key? Elementwise, so the same rule serves broadcast tensors (the
    dense mask) and single indices (flex_attention's mask_mod).

    A query has an anchor position, a position, a block id and a document; a key has a position, a
    block id (-1 for a context row) and a document. A query reads context of its own document
    strictly before its anchor (the target has not verified the anchor yet at inference) and its own
    block only: all of it, or its causal part. A sliding window counts the query itself: q_pos -
    k_pos < window.
    """
    ctx = (k_block < 0) & (k_doc == q_doc) & (k_pos < q_anchor)
    blk = k_block == q_block
    if causal:
        blk = blk & (k_pos <= q_pos)
    see = ctx | blk
    if window is not None:
        # q_pos - k_pos < window, written so that the dense mask compares [N, Q, 1] with [N, 1, K]
        # directly: the difference would be an int64 [N, Q, K] tensor, 8x the boolean mask
        see = see & (k_pos > q_pos - window)
    return see


def attention_keys(q_pos, q_block, q_doc, ctx_pos, ctx_doc):
    """The keys' (position, block id, document), each [N, C + Q]: the C context rows, then the Q
    block rows."""
    return (
        torch.cat([ctx_pos, q_pos], 1),
        torch.cat([torch.full_like(ctx_pos, -1), q_block], 1),
        torch.cat([ctx_doc, q_doc], 1),
    )


def block_attention_mask(queries, keys, causal: bool, window=None):
    """queries (anchor, pos, block, doc) each [N, Q], keys (pos, block, doc) each [N, K]
    -> [N, 1, Q, K] booleans for SDPA: the rule on every (query, key) pair."""
    return attention_rule(
        *(t[:, :, None] for t in queries), *(t[:, None, :] for t in keys), causal, window
    )[:, None]
