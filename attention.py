"""Which keys a block query may read, and the two ways to attend with that rule (docs/semantics.md,
section 1; model.Attention).

Training flattens A blocks of B slots into Q = A * B queries over keys [C context rows ; Q block
rows]. A query reads only the context before its anchor and the slots of its own block, so at S =
2048 and 512 anchors almost every score of the [Q, C + Q] matrix is masked. Two paths, one rule:

    sdpa  a dense [N, 1, Q, C + Q] boolean mask for F.scaled_dot_product_attention: the readable
          reference and the CPU default; every score is computed. On CUDA only by kernels that never
          hold the scores (memory_safe_sdpa).
    flex  a BlockMask (torch.nn.attention.flex_attention) built from the same rule: tiles of scores
          that no query may read are skipped. Compiled; on CPU torch (2.13) runs it forward only.
          The default on CUDA (choose).

Packed rows (train.py --pack, data.py) add documents: a query reads context of its own document
only.
"""

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

# SDPA's CUDA kernels that take a mask without making the [N, heads, Q, K] scores. Flash takes no
# mask; math makes them in fp32 (17 GB a layer at S = 8192, 512 anchors of 16), so it is left out.
MEMORY_SAFE_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def choose(attention: str, device) -> str:
    """--attention auto: flex on CUDA (block-sparse, compiled), sdpa on the CPU (torch has no CPU
    flex backward); sdpa or flex as asked."""
    if attention != "auto":
        return attention
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


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


def flex_block_mask(queries, keys, causal: bool, window=None):
    """The same rule as a BlockMask for flex_attention, which skips every (128 x 128) tile of scores
    that no query of the tile may read: most of them (other blocks, context after the anchors).
    Built compiled: eager, create_block_mask would evaluate the rule into dense [N, Q, K] tensors
    first."""

    def mask_mod(b, h, q, k):
        return attention_rule(*(t[b, q] for t in queries), *(t[b, k] for t in keys), causal, window)

    (N, Q), K = queries[0].shape, keys[0].shape[1]
    return compiled(create_block_mask)(mask_mod, N, None, Q, K, device=queries[0].device)


def sdpa(q, k, v, mask, gqa: bool):
    """q [N, heads, Q, hd], k, v [N, kv_heads, K, hd], mask [N, 1, Q, K] -> [N, heads, Q, hd]. On
    the CPU torch's own choice (its kernels keep no [Q, K] scores per head); on CUDA
    memory_safe_sdpa."""
    if q.device.type == "cuda":
        return memory_safe_sdpa(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def memory_safe_sdpa(q, k, v, mask):
    """SDPA by MEMORY_SAFE_BACKENDS only. Memory-efficient attention takes a mask but not grouped
    query heads (its check wants as many k/v heads as q heads), so GQA with a mask would leave torch
    the math kernel: the k/v heads are repeated instead, as enable_gqa groups them (kv head j
    serves q heads j*g .. j*g+g-1), which costs [N, heads, K, hd] per tensor, not the scores. Where
    no such kernel takes the shapes, it stops with the fix instead of running out of memory."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    try:
        with sdpa_kernel(MEMORY_SAFE_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    except RuntimeError as e:  # torch's words for "no kernel allowed here takes this" (2.11, 2.13)
        if not any(m in str(e) for m in ("No available kernel", "No viable backend")):
            raise
        raise RuntimeError(
            f"--attention sdpa: no memory-safe SDPA kernel on {q.device} takes q {tuple(q.shape)} "
            f"{q.dtype} with a mask (torch's warnings above say why); use --attention flex"
        ) from e


def flex(q, k, v, block_mask, gqa: bool):
    """flex_attention is block-sparse only compiled (eager it is torch's dense reference). q and k
    leave the fp32 norms; under autocast v is bf16, and all three go in as v's dtype, as SDPA's
    autocast casts them."""
    return compiled(flex_attention)(
        q.to(v.dtype), k.to(v.dtype), v, block_mask=block_mask, enable_gqa=gqa
    )


@functools.cache
def compiled_once(fn):
    return torch.compile(fn)


def compiled(fn):
    """fn compiled, once; itself inside a region that is being compiled already (train.py
    --compile)."""
    return fn if torch.compiler.is_compiling() else compiled_once(fn)
