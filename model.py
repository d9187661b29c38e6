"""The DFlash / DFlash2 draft: its config, the training and inference paths, and the backbone they
share (docs/semantics.md, sections 1-3).

The draft proposes B-1 tokens in one forward pass. Its input is the block [anchor, MASK x (B-1)],
embedded with the target's (frozen) embedding; it reads the target through `ctx`, the target's
hidden states at `target_layer_ids`, which enter every layer only as extra keys and values:

    ctx = hidden_norm(fc([h_l1 ; ... ; h_lk]))                     # [N, C, H], once per sequence
    K   = k_norm(k_proj([ctx ; x])),  V = v_proj([ctx ; x])          # context rows first
    Q   = q_norm(q_proj(x))                                         # queries: block slots only

The block's final hidden states go through the target's lm_head (also frozen, never saved).
With `conv_kernel_size` etc. set (DFlash2) every sublayer runs inside conv.py's convolution and a
selector.py head reranks the unary top-K; without them the same code is the plain DFlash baseline.
"""

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from attention import attention_keys, block_attention_mask
from conv import GroupedDynamicCausalConv
from selector import CandidateSelector, unary_transform

# ----------------------------------------------------------------------------- the draft's config
# set together (DFlash2) or not at all (plain DFlash)
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list
    mask_token_id: int
    num_target_layers: int = None  # the target's layer count; None when the format does not say
    block_size: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    # scaled RoPE: {"rope_type": "yarn" | "llama3" | "linear", ...}; None: plain (rope_frequencies)
    rope_scaling: dict = None
    max_position_embeddings: int = 40960
    layer_types: list = None  # per layer "full_attention" | "sliding_attention"
    sliding_window: int = None
    is_causal: bool = None  # True / False: causal / bidirectional in the block; None: unset
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # DFlash2 only; all None means plain DFlash
    conv_kernel_size: int = None
    conv_group_size: int = None
    selector_rank: int = None
    selector_top_k: int = None
    output_multiplier: float = None
    final_logit_softcapping: float = None
    input_embedding_scale: float = None  # the block's embeddings are multiplied by it (Z Lab, vLLM)
    comment: str = field(default=None, compare=False)  # free text kept in config.json

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        # the one rule the model itself needs; every other rule of docs/semantics.md, section 3
        # is checked by whoever reads a config.json (compat/config_checks.py, validate)
        present = [f for f in DFLASH2_FIELDS if getattr(self, f) is not None]
        if present and len(present) != len(DFLASH2_FIELDS):
            missing = [f for f in DFLASH2_FIELDS if getattr(self, f) is None]
            raise ValueError(f"a DFlash2 config needs all of {DFLASH2_FIELDS}; missing {missing}")

    @property
    def dflash2(self) -> bool:
        return self.conv_kernel_size is not None

    def causal_in_block(self, sliding: bool) -> bool:
        """Whether a layer attends causally inside its block. An explicit is_causal decides for
        every layer. Unset (absent from config.json), sliding layers are causal and full layers
        bidirectional: that is how Z Lab, SGLang and vLLM load a published draft that omits it."""
        return sliding if self.is_causal is None else self.is_causal


def plain_dflash(c: DraftConfig) -> DraftConfig:
    """The same backbone without convolution and selector: the DFlash baseline."""
    return dataclasses.replace(c, **{f: None for f in DFLASH2_FIELDS})


# ------------------------------------------------------------- the draft's input: target features
# The draft never sees the target's weights, only its hidden states (and, for its own use, the
# target's frozen input embedding and lm_head):
#
#     features = [h_l1 ; ... ; h_lk]                                 # [N, S, k*H]
@torch.no_grad()
def capture_features(target, layer_ids, final_hidden=False, **forward_kwargs):
    """Run the target once -> (its outputs, features [N, S, n_t*H]): the outputs of decoder layers
    layer_ids (HF hidden_states[id + 1]) in list order, kept by forward hooks rather than keeping
    every layer. final_hidden: also the final normed hidden state [N, S, H], which kl needs."""
    layers, grabbed = target.model.layers, {}  # a Hugging Face causal LM's decoder layers

    def hook(key):
        def fn(module, args, out):
            grabbed[key] = out[0] if isinstance(out, tuple) else out

        return fn

    handles = [layers[i].register_forward_hook(hook(i)) for i in layer_ids]
    if final_hidden:
        handles.append(target.model.norm.register_forward_hook(hook("final")))
    try:
        out = target(**forward_kwargs)
    finally:
        for h in handles:
            h.remove()
    features = torch.cat([grabbed[i] for i in layer_ids], dim=-1)
    return (out, features, grabbed["final"]) if final_hidden else (out, features)


# ------------------------------------------------------------ training: all anchored blocks at once
def anchored_blocks(input_ids, anchors, block_size: int, mask_token_id: int, positions, docs):
    """input_ids [N, S], sorted anchors [N, A] -> block_ids, q_pos, q_anchor, q_block, q_doc, each
    [N, A*B]: block a is [x[a], MASK x (B-1)] at positions p..p+B-1, p = positions[a].
    positions, docs [N, S]: each token's position in its document and the document's number."""
    N, A = anchors.shape
    j = torch.arange(block_size, device=anchors.device)  # [B]
    anchor_pos = positions.gather(1, anchors)  # [N, A]
    q_pos = (anchor_pos[:, :, None] + j).reshape(N, A * block_size)
    q_anchor = anchor_pos.repeat_interleave(block_size, dim=1)
    q_block = (
        torch.arange(A, device=anchors.device).repeat_interleave(block_size)[None].expand(N, -1)
    )
    q_doc = docs.gather(1, anchors).repeat_interleave(block_size, dim=1)
    block_ids = torch.full_like(q_pos, mask_token_id)
    block_ids[:, ::block_size] = input_ids.gather(1, anchors)
    return block_ids, q_pos, q_anchor, q_block, q_doc


def forward_training(
    draft, embed, input_ids, features, anchors, positions=None, docs=None, attention=None
):
    """All anchored blocks of each sequence in one pass -> hidden states [N, A, B, H].
    positions, docs [N, S]: packed rows (train.py --pack); None for one conversation a row."""
    c = draft.config
    N, S = input_ids.shape
    if positions is None:
        positions = torch.arange(S, device=input_ids.device)[None].expand(N, -1)
        docs = torch.zeros_like(positions)
    block_ids, q_pos, q_anchor, q_block, q_doc = anchored_blocks(
        input_ids, anchors, c.block_size, c.mask_token_id, positions, docs
    )
    h = draft(
        embed(block_ids),
        q_pos=q_pos,
        q_anchor=q_anchor,
        q_block=q_block,
        ctx_kv=draft.context_kv(features, positions),
        ctx_pos=positions,
        q_doc=q_doc,
        ctx_doc=docs,
        attention=attention,
    )
    return h.view(N, anchors.shape[1], c.block_size, -1)


# ------------------------------------------------------------- inference: one block, cached context
class ContextCache:
    """The projected K/V of every context row seen so far, and their positions. Only context is
    cached: the block's MASK rows change meaning once tokens are verified (docs/semantics.md, 5)."""

    def __init__(self):
        self.kv, self.pos = None, None

    def append(self, draft, features, pos):
        """features [N, C, n_t*H] of newly verified tokens at positions pos [N, C]."""
        new = draft.context_kv(features, pos)
        if self.kv is None:
            self.kv, self.pos = new, pos
        else:
            self.kv = [
                (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                for (k0, v0), (k1, v1) in zip(self.kv, new)
            ]
            self.pos = torch.cat([self.pos, pos], dim=1)


def forward_inference(draft, embed, cache: ContextCache, anchor_ids, anchor_pos, attention=None):
    """One block from the last verified token: anchor_ids, anchor_pos [N] -> hidden [N, B, H]."""
    c = draft.config
    N, B = anchor_ids.shape[0], c.block_size
    block_ids = torch.full((N, B), c.mask_token_id, dtype=torch.long, device=anchor_ids.device)
    block_ids[:, 0] = anchor_ids
    q_pos = anchor_pos[:, None] + torch.arange(B, device=anchor_ids.device)
    q_anchor = anchor_pos[:, None].expand(N, B)
    q_block = torch.zeros_like(q_pos)
    return draft(
        embed(block_ids),
        q_pos=q_pos,
        q_anchor=q_anchor,
        q_block=q_block,
        ctx_kv=cache.kv,
        ctx_pos=cache.pos,
        attention=attention,
    )


# ----------------------------------------------------------------------------- backbone
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_frequencies(c: DraftConfig) -> tuple:
    """The draft's RoPE: (inverse frequencies [head_dim / 2] fp32, factor on cos and sin). A scaled
    RoPE is transformers' own, bit for bit (compat/test_compat.py), as Z Lab and vLLM load it."""
    D, s = c.head_dim, c.rope_scaling or {"rope_type": "default"}
    # on the CPU: the same bits wherever the draft is built (`with torch.device("meta")`, a GPU)
    with torch.device("cpu"):
        # [D/2] theta^(2i/D): the wavelength of dimension pair i, over 2 pi
        wavelength = c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)
        kind = s["rope_type"]
        if kind == "default":
            return 1.0 / wavelength, 1.0
        if kind == "linear":  # positions slowed by the factor
            return 1.0 / wavelength / s["factor"], 1.0
        if kind == "llama3":
            return llama3_frequencies(1.0 / wavelength, s, c.max_position_embeddings), 1.0
        if kind == "yarn":
            return yarn_frequencies(wavelength, s, c.max_position_embeddings, c.rope_theta, D)
    raise ValueError(f"rope_scaling rope_type {kind!r} is not implemented")


def llama3_frequencies(inv_freq, s: dict, max_positions: int):
    """Llama 3.1's: frequencies of long wavelengths divided by the factor, of short ones kept, and
    between the two bands a smooth mix of both."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s.get("original_max_position_embeddings", max_positions)
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    mixed = (1 - smooth) * slowed / factor + smooth * slowed
    return torch.where(~(wavelen < old / high) * ~(wavelen > old / low), mixed, slowed)


def yarn_frequencies(wavelength, s: dict, max_positions: int, theta: float, D: int) -> tuple:
    """YaRN's: dimensions turning more than beta_fast times over the original context keep their
    frequency, those turning fewer than beta_slow times are divided by the factor, a linear ramp
    between; and cos, sin scaled by the attention factor."""
    factor, old = s["factor"], s.get("original_max_position_embeddings", max_positions)
    mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    scale = s.get("attention_factor")
    if scale is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        scale = mscale(m) / mscale(m_all) if m and m_all else mscale(1)
    # the dimension whose frequency turns `turns` times over the original context
    dim = lambda turns: D * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim(s.get("beta_fast") or 32), dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001  # a ramp of some width
    kept = 1 - ((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = 1.0 / (factor * wavelength) * (1 - kept) + 1.0 / wavelength * kept
    return inv_freq, float(scale)


def rope(x, pos, inv_freq, scale=1.0):
    """Rotary embedding over the full head dim: x [N, heads, L, D], positions pos [N, L]."""
    # [N, 1, L, D/2]; inv_freq on x's device already (a buffer of Attention), so no copy here
    ang = pos[:, None, :, None].float() * inv_freq
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def sdpa(q, k, v, mask, gqa: bool):
    """The reference kernel: torch's SDPA over attention.py's dense boolean mask [N, 1, Q, K]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)
        inv_freq, self.rope_scale = rope_frequencies(c)
        # a buffer: draft.to(device) moves it; not persistent: the exports hold only the contract's
        self.register_buffer("inv_freq", inv_freq.to(self.q_proj.weight.device), persistent=False)

    def kv(self, x, pos):
        """Keys (normed, rotated) and values of rows x [N, L, H] -> 2 x [N, kv_heads, L, hd]."""
        N, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(N, L, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(N, L, self.nkv, self.hd).transpose(1, 2)
        return rope(k, pos, self.inv_freq, self.rope_scale), v

    def forward(self, x, pos, ctx_kv, mask, attend):
        """x [N, Q, H] block rows; ctx_kv: this layer's context (k, v) [N, kv_heads, C, hd]."""
        N, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(N, Q, self.nh, self.hd)).transpose(1, 2)
        q = rope(q, pos, self.inv_freq, self.rope_scale)  # [N, heads, Q, hd]
        k, v = self.kv(x, pos)
        k = torch.cat([ctx_kv[0], k], dim=2)  # [N, kv_heads, C + Q, hd]
        v = torch.cat([ctx_kv[1], v], dim=2)
        y = attend(q, k, v, mask, self.nh != self.nkv)
        return self.o_proj(y.transpose(1, 2).reshape(N, Q, self.nh * self.hd))

    def _apply(self, fn, recurse=True):
        # draft.to(bf16) casts every floating tensor, but rope() computes in fp32: inv_freq follows
        # the module's device and keeps its fp32 values
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PassThrough(nn.Module):
    """Plain DFlash's stand-in for the convolution: f(a, ...), no parameters, no extra tensors."""

    def forward(self, a, sublayer, *args):
        return sublayer(a, *args)


def conv_around_sublayer(c: DraftConfig) -> nn.Module:
    """What runs around a sublayer f: conv.py's post(f(pre(a), ...)) or plain f(a, ...)."""
    if not c.dflash2:
        return PassThrough()
    return GroupedDynamicCausalConv(
        c.hidden_size, c.conv_kernel_size, c.conv_group_size, c.block_size
    )


class Layer(nn.Module):
    def __init__(self, c: DraftConfig, sliding: bool):
        super().__init__()
        self.sliding = sliding
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)
        self.attention_conv, self.mlp_conv = conv_around_sublayer(c), conv_around_sublayer(c)

    def context_kv(self, ctx, pos):
        """The context rows' K/V: the layer's, so --fsdp gathers its shard (support/fsdp.py)."""
        return self.self_attn.kv(ctx, pos)

    def forward(self, h, pos, ctx_kv, mask, attend):
        # each sublayer f runs inside its convolution: h + conv(norm(h), f, f's other inputs)
        a = self.input_layernorm(h)
        h = h + self.attention_conv(a, self.self_attn, pos, ctx_kv, mask, attend)
        return h + self.mlp_conv(self.post_attention_layernorm(h), self.mlp)


class DraftModel(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.config = c
        # train.py --gradient-checkpointing: keep only each layer's input h [N, Q, H] through the
        # forward and recompute the layer's activations in backward (about a third more compute)
        self.gradient_checkpointing = False
        H = c.hidden_size
        self.fc = nn.Linear(len(c.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(c, t == "sliding_attention") for t in c.layer_types)
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.candidate_selector = None
        if c.dflash2:
            self.candidate_selector = CandidateSelector(
                H, c.vocab_size, c.selector_rank, c.selector_top_k, c.initializer_range
            )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        # Linear ~ N(0, initializer_range), norms = 1; then the DFlash2 modules restore their own
        # exact-identity / zero inits, which a generic init pass must never overwrite.
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.config.initializer_range)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
        for m in self.modules():
            if isinstance(m, (GroupedDynamicCausalConv, CandidateSelector)):
                m.reset_parameters()

    def context_kv(self, features, pos):
        """Target features [N, C, n_t*H] at positions pos [N, C] -> per-layer context (k, v). They
        come in their stored dtype and are cast once, here: to autocast's dtype or the draft's."""
        dtype = autocast_dtype(features.device.type) or self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(features.to(dtype)))  # [N, C, H]
        return [layer.context_kv(ctx, pos) for layer in self.layers]

    def forward(
        self,
        x,
        *,
        q_pos,
        q_anchor,
        q_block,
        ctx_kv,
        ctx_pos,
        q_doc=None,
        ctx_doc=None,
        attention=None,
    ):
        """Block rows x [N, Q, H] (embedded) -> final normed hidden states [N, Q, H].

        One path for training (many blocks flattened, q_block telling them apart) and inference
        (one block, context K/V from the cache): only the inputs differ. Queries: positions q_pos,
        their anchors' positions q_anchor, block numbers q_block, documents q_doc, each [N, Q].
        Context: ctx_kv, one (k, v) per layer, at ctx_pos, of documents ctx_doc [N, C]. attention:
        (mask builder, kernel); None: attention.py's dense mask and sdpa, the reference
        (support/kernels.py has train.py's others)."""
        c = self.config
        make_mask, attend = attention or (block_attention_mask, sdpa)
        if q_doc is None:
            q_doc, ctx_doc = torch.zeros_like(q_pos), torch.zeros_like(ctx_pos)
        queries = (q_anchor, q_pos, q_block, q_doc)
        keys = attention_keys(q_pos, q_block, q_doc, ctx_pos, ctx_doc)
        # only the kinds of layer the draft has (both shipped 8B configs are all sliding)
        full = slide = None
        if "full_attention" in c.layer_types:
            full = make_mask(queries, keys, c.causal_in_block(sliding=False))
        if "sliding_attention" in c.layer_types:
            slide = make_mask(queries, keys, c.causal_in_block(sliding=True), c.sliding_window)
        # dflash_config.input_embedding_scale (Z Lab, vLLM) scales the embedded block, in both paths
        h = x if c.input_embedding_scale is None else x * c.input_embedding_scale
        for layer, kv in zip(self.layers, ctx_kv):
            args = (h, q_pos, kv, slide if layer.sliding else full, attend)
            if self.gradient_checkpointing and torch.is_grad_enabled():
                # non-reentrant: composes with DDP, FSDP2's per-layer gathers and torch.compile
                h = checkpoint(layer, *args, use_reentrant=False)
            else:
                h = layer(*args)
        return self.norm(h)

    def unary_logits(self, h, head):
        """The draft's unary scores u = transform(head(h)), head(h) = h @ W_lm^T the target's frozen
        head (a function: generate.py may hold W_lm in int8, speed/int8.py)."""
        c = self.config
        return unary_transform(head(h), c.output_multiplier, c.final_logit_softcapping)


# ---------------------------------------------------------------------------- dtype plumbing
def autocast_dtype(device_type: str):
    """The dtype autocast computes in on this device type, or None where autocast is off."""
    on = torch.is_autocast_enabled(device_type)
    return torch.get_autocast_dtype(device_type) if on else None
