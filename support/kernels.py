"""The attention kernels that run attention.py's rule on CUDA: they change the speed and memory of
attention, never which keys a query reads. train.py passes one of these pairs as
model.forward_training's `attention`: SDPA through kernels that never hold the [N, heads, Q, K]
scores, or FLEX, a compiled FlexAttention BlockMask that skips the tiles no query reads.
"""

import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import model
from attention import attention_rule, block_attention_mask

# SDPA's CUDA kernels that take a mask without making the [N, heads, Q, K] scores. Flash takes no
# mask; math makes them in fp32 (17 GB a layer at S = 8192, 512 anchors of 16), so it is left out.
MEMORY_SAFE_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def choose(attention: str, device) -> str:
    """--attention auto: flex on CUDA (block-sparse, compiled), sdpa on the CPU (torch has no CPU
    flex backward); sdpa or flex as asked."""
    if attention != "auto":
        return attention
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


def attention_kernel(name: str, device):
    """--attention sdpa or flex on device -> forward_training's `attention` (None: model's own)."""
    if name == "flex":
        return FLEX
    return MEMORY_SAFE_SDPA if torch.device(device).type == "cuda" else None


def memory_safe_sdpa(q, k, v, mask, gqa: bool):
    """model.sdpa by MEMORY_SAFE_BACKENDS only. They take a mask but not grouped query heads, so
    the k/v heads are repeated as enable_gqa groups them; where no such kernel takes the shapes, it
    stops with the fix instead of running out of memory."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    try:
        with sdpa_kernel(MEMORY_SAFE_BACKENDS):
            return model.sdpa(q, k, v, mask, gqa=False)
    except RuntimeError as e:  # torch's words for "no kernel allowed here takes this" (2.11, 2.13)
        if not any(m in str(e) for m in ("No available kernel", "No viable backend")):
            raise
        raise RuntimeError(
            f"--attention sdpa: no memory-safe SDPA kernel on {q.device} takes q {tuple(q.shape)} "
            f"{q.dtype} with a mask (torch's warnings above say why); use --attention flex"
        ) from e


def flex_block_mask(queries, keys, causal: bool, window=None):
    """attention.py's rule as a BlockMask, built compiled (eager would make dense [N, Q, K]):
    queries (anchor, pos, block, doc) each [N, Q], keys (pos, block, doc) each [N, K]."""

    def mask_mod(b, h, q, k):
        return attention_rule(*(t[b, q] for t in queries), *(t[b, k] for t in keys), causal, window)

    (N, Q), K = queries[0].shape, keys[0].shape[1]
    return compiled(create_block_mask)(mask_mod, N, None, Q, K, device=queries[0].device)


def flex(q, k, v, block_mask, gqa: bool):
    """flex_attention, compiled (eager it is dense); q, k cast to v's dtype as SDPA's autocast."""
    return compiled(flex_attention)(
        q.to(v.dtype), k.to(v.dtype), v, block_mask=block_mask, enable_gqa=gqa
    )


compiled_once = functools.cache(torch.compile)


def compiled(fn):
    """fn compiled, once; itself inside a region being compiled already (train.py --compile)."""
    return fn if torch.compiler.is_compiling() else compiled_once(fn)


# (how to build the mask, the kernel that reads it): model.py's on memory-safe CUDA kernels; flex
MEMORY_SAFE_SDPA = (block_attention_mask, memory_safe_sdpa)
FLEX = (flex_block_mask, flex)
