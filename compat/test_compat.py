"""The tests of compat/: machinery a learner can skip. Shared helpers come from test_all.py;
python -m pytest -q runs these with the rest (pyproject.toml's testpaths).

The map: each "# ====" banner and, indented under it, its "# ----" subsections (a test
holds it equal to the banners):
    helpers                         the published config layouts, the block written out by hand
    compat/config_json.py           validation rules, save / load, the shipped configs
    checkpoint formats              the published config layouts and the speculators format
        the zlab and SpecForge layouts
        scaled RoPE
        fields refused or read
        the speculators format
"""

import dataclasses
import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, rotate_half

import export
import model
from compat import config_json as config
from compat import speculators
from model import DraftConfig, DraftModel
from support.common import UsageError
from test_all import (
    HERE,
    block_hidden,
    conv_loop,
    randomize,
    run,
    shard_by_hand,
    tiny_config,
    tiny_draft,
    tiny_target,
    write_ckpt,
)

# ============================================================================ helpers
# Fixture configs are written here in the published field layouts (Z Lab's
# tests/fixtures/dflash2-config.json, SpecForge's configs/qwen3.6-27b-dflash2.json, what
# speculators 0.9.0's save_pretrained writes), at tiny sizes.
SLIDING, FULL = "sliding_attention", "full_attention"


def zlab_fixture(dflash=None, **kw) -> dict:
    """A Z Lab / SpecForge style config.json: sliding and full layers, no is_causal."""
    d = {
        "architectures": ["DFlash2DraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dflash_config": {
            "block_size": 4,
            "conv_group_size": 8,
            "conv_kernel_size": 2,
            "mask_token_id": 63,
            "selector_rank": 8,
            "selector_top_k": 5,
            "target_layer_ids": [0, 2],
            **(dflash or {}),
        },
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 48,
        "layer_types": [SLIDING, FULL],
        "max_position_embeddings": 256,
        "max_window_layers": 2,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_target_layers": 4,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": 5,
        "tie_word_embeddings": False,
        "transformers_version": "5.15.0",
        "use_cache": False,
        "use_sliding_window": True,
        "vocab_size": 64,
    }
    d.update(kw)
    return d


def rms(x, norm):
    return norm.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))


def qwen3_config(d: dict) -> Qwen3Config:
    """The Qwen3Config that Z Lab's and speculators' drafts build from config.json d."""
    return Qwen3Config(**{k: v for k, v in d.items() if k != "dflash_config"})


def hf_rotate(layer_config: dict):
    """RoPE as transformers' Qwen3RotaryEmbedding applies it: x [L, heads, hd] at positions pos ->
    rotated."""
    emb = Qwen3RotaryEmbedding(qwen3_config(layer_config))

    def rotate(x, pos):
        cos, sin = emb(x, torch.tensor([pos]))  # [1, L, hd]
        return x * cos[0, :, None] + rotate_half(x) * sin[0, :, None]

    return rotate


def reference_block(draft, layer_config, embed_w, feats, ids, a, causal, scale=1.0):
    """The block at anchor a written out: each query's visible keys listed by the rule (context
    rows, all before the anchor; its own block, all of it or up to itself when causal[layer]; the
    sliding window counted from the query), a softmax over them, the convolutions as loops
    (conv_loop), RMSNorms and MLPs by hand. Context: the target features of positions 0..a-1. ->
    final hidden states [B, H]."""
    c, B = draft.config, draft.config.block_size
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    rotate, pos = hf_rotate(layer_config), list(range(a + B))
    ctx = rms(feats[:a] @ draft.fc.weight.T, draft.hidden_norm)  # [a, H]
    h = embed_w[[int(ids[a])] + [c.mask_token_id] * (B - 1)] * scale  # [B, H]
    for layer, kind, cz in zip(draft.layers, c.layer_types, causal):
        W, sa = (c.sliding_window if kind == SLIDING else None), layer.self_attn

        def attention(x, sa=sa, W=W, cz=cz):
            rows = torch.cat([ctx, x])
            q = rotate(rms(sa.q_proj(x).view(B, nh, hd), sa.q_norm), pos[a:])
            k = rotate(rms(sa.k_proj(rows).view(-1, nkv, hd), sa.k_norm), pos)
            v = sa.v_proj(rows).view(-1, nkv, hd)
            out = torch.zeros(B, nh, hd)
            for j in range(B):
                qp = a + j
                see = [i for i in pos if (W is None or qp - i < W) and not (cz and i > qp)]
                for n in range(nh):
                    g = n // (nh // nkv)
                    w = torch.softmax(
                        torch.stack([q[j, n] @ k[i, g] for i in see]) / math.sqrt(hd), 0
                    )
                    out[j, n] = sum(wi * v[i, g] for wi, i in zip(w, see))
            return sa.o_proj(out.reshape(B, nh * hd))

        def mlp(x, m=layer.mlp):
            return m.down_proj(torch.nn.functional.silu(m.gate_proj(x)) * m.up_proj(x))

        def wrapped(conv, f, x):
            return f(x) if conv is None else conv_loop(conv, x[None], lambda y: f(y[0])[None])[0]

        h = h + wrapped(layer.attention_conv, attention, rms(h, layer.input_layernorm))
        h = h + wrapped(layer.mlp_conv, mlp, rms(h, layer.post_attention_layernorm))
    return rms(h, draft.norm)


def both_paths(draft, embed_w, feats, ids, a):
    """The draft's own block at anchor a: (inference path, training path), each [B, H]."""
    embed = torch.nn.Embedding.from_pretrained(embed_w)
    cache = model.ContextCache()
    cache.append(draft, feats[None, :a], torch.arange(a)[None])
    h_inf = model.forward_inference(draft, embed, cache, ids[a].view(1), torch.tensor([a]))[0]
    anchors = torch.tensor([[2, a]])  # the block at a, beside another
    h_train = model.forward_training(draft, embed, ids[None], feats[None], anchors)[0, 1]
    return h_inf, h_train


def fixture_inputs(c, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(c.vocab_size, c.hidden_size, generator=g),
        torch.randn(16, len(c.target_layer_ids) * c.hidden_size, generator=g),
        torch.randint(0, c.vocab_size - 1, (16,), generator=g),
    )


def block_follows_the_rule(d, causal, scale=1.0, draft=None):
    """Both paths of a draft of config.json d (random unless given) give the block at anchor 9
    written out by the rule. -> (draft, its inputs, that block)."""
    draft = draft or randomize(DraftModel(config.config_from_dict(d)), std=0.1)
    embed_w, feats, ids = inputs = fixture_inputs(draft.config)
    with torch.no_grad():
        ref = reference_block(draft, d, embed_w, feats, ids, 9, causal, scale)
        for h in both_paths(draft, embed_w, feats, ids, 9):
            assert (h - ref).abs().max() <= 1e-5
    return draft, inputs, ref


def rope(**p) -> dict:
    return {"rope_theta": 1e4, **p}


YARN = rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
YARN_SCALING = {k: v for k, v in YARN.items() if k != "rope_theta"}


DELETE = object()


def broken(d: dict, key: str, value) -> dict:
    """d with d[key] set to value, or deleted for DELETE; "a.b" reaches into d["a"]."""
    *outer, k = key.split(".")
    target = d[outer[0]] if outer else d
    if value is DELETE:
        del target[k]
    else:
        target[k] = value
    return d


# ============================================================================ compat/config_json.py
@pytest.mark.parametrize(
    "key,value,named",
    [
        # never derived from a target's config
        ("architectures", ["LlamaForCausalLM"], "DFlash2DraftModel"),
        ("dflash_config.selector_rank", DELETE, "selector_rank"),
        ("dflash_config.conv_kernel_size", 0, "conv_kernel_size"),
        ("dflash_config.conv_kernel_size", 5, "conv_kernel_size"),  # > block_size 4
        ("dflash_config.conv_kernel_size", 2.0, "conv_kernel_size"),  # a float is not an integer
        ("dflash_config.conv_group_size", 0, "conv_group_size"),
        ("dflash_config.conv_group_size", 5, "conv_group_size"),  # does not divide 32
        ("dflash_config.selector_rank", 0, "selector_rank"),
        ("dflash_config.selector_rank", True, "selector_rank"),  # nor is a bool
        ("dflash_config.selector_top_k", 0, "selector_top_k"),
        ("dflash_config.selector_top_k", 65, "selector_top_k"),  # > vocab 64
        ("dflash_config.block_size", 1, "block_size"),
        ("dflash_config.target_layer_ids", [], "target_layer_ids"),
        ("dflash_config.target_layer_ids", [0, 4], "target_layer_ids"),  # the target has 4 layers
        ("dflash_config.target_layer_ids", [-1], "target_layer_ids"),
        ("dflash_config.mask_token_id", 64, "mask_token_id"),
        ("dflash_config.mask_token_id", -1, "mask_token_id"),
        ("dflash_config.final_logit_softcapping", 0.0, "final_logit_softcapping"),
        ("dflash_config.input_embedding_scale", "2", "input_embedding_scale"),
        ("hidden_size", "32", "hidden_size"),
        ("num_key_value_heads", 3, "num_key_value_heads"),
        ("layer_types", [FULL], "layer_types"),
        ("layer_types", DELETE, "layer_types"),  # derived from max_window_layers
        ("sliding_window", None, "sliding_window"),  # beside a sliding layer
        ("sliding_window", 3, "sliding_window"),  # narrower than the block
        ("is_causal", "yes", "is_causal"),
        # the one value implemented
        ("attention_bias", True, "attention_bias"),
        ("hidden_act", "gelu", "hidden_act"),
        ("model_type", "llama", "model_type"),
        ("attention_dropout", 0.1, "attention_dropout"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
        # fields the code does not know; vLLM reads dflash_config.causal, Z Lab does not
        ("mlp_bias", False, "mlp_bias"),
        ("dflash_config.causal", False, "dflash_config.causal"),
        ("dflash_config.use_swa", True, "dflash_config.use_swa"),
        ("rope_parameters", rope(rope_type="dynamic", factor=2.0), "dynamic"),
        ("rope_parameters", rope(rope_type="longrope", long_factor=[2.0]), "longrope"),
        ("rope_parameters", dict(YARN, beta_fastest=3), "beta_fastest"),
        ("rope_parameters", rope(rope_type="llama3", factor=8.0), "high_freq_factor"),
        ("rope_parameters", rope(partial_rotary_factor=0.5), "partial_rotary_factor"),
        ("rope_parameters", {FULL: rope(), SLIDING: rope()}, "per layer type"),
        ("rope_parameters", DELETE, "rope_theta"),  # loaders default it differently
        ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling"),  # beside the new name
        ("rope_theta", 5e5, "rope_theta"),  # disagrees with rope_parameters
        ("use_sliding_window", False, "use_sliding_window"),  # transformers drops the window
    ],
)
def test_each_validation_rule_raises(key, value, named):
    """Each rule of docs/semantics.md, section 3, broken in Z Lab's layout, is refused by name."""
    with pytest.raises(UsageError, match=named):
        config.config_from_dict(broken(zlab_fixture(), key, value), source="draft/config.json")


def spec_tensor_shapes(c: DraftConfig):
    """docs/semantics.md, section 3: the tensor list in state_dict order, written out independently
    of model.py."""
    H, FF, nt = c.hidden_size, c.intermediate_size, len(c.target_layer_ids)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    T, G, V, r = c.conv_kernel_size, c.conv_group_size, c.vocab_size, c.selector_rank
    s = {"fc.weight": (H, nt * H), "hidden_norm.weight": (H,)}
    for i in range(c.num_hidden_layers):
        p, n = f"layers.{i}.", (c.head_dim,)
        attn = dict(
            q_proj=(q, H), k_proj=(kv, H), v_proj=(kv, H), o_proj=(H, q), q_norm=n, k_norm=n
        )
        mlp = dict(gate_proj=(FF, H), up_proj=(FF, H), down_proj=(H, FF))
        s[p + "input_layernorm.weight"] = (H,)
        s.update({f"{p}self_attn.{k}.weight": v for k, v in attn.items()})
        s[p + "post_attention_layernorm.weight"] = (H,)
        s.update({f"{p}mlp.{k}.weight": v for k, v in mlp.items()})
        for conv in ("attention_conv", "mlp_conv"):
            s[p + conv + ".base_kernel"] = (2, T, H)
            s[p + conv + ".kernel_projection.weight"] = (2 * T * H // G, H)
    s["norm.weight"] = (H,)
    s["candidate_selector.predecessor_codebook"] = (V, r)
    s["candidate_selector.successor_codebook"] = (V, r)
    s["candidate_selector.hidden_projection.weight"] = (r, H)
    return s


def test_save_load_round_trip_and_contract(tmp_path):
    c = tiny_config(output_multiplier=0.5, final_logit_softcapping=20.0)
    draft = randomize(DraftModel(c))
    export.save_draft(draft, str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == spec_tensor_shapes(c)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    scalars = dict(output_multiplier=0.5, final_logit_softcapping=20.0)
    assert cfg["dflash_config"] == dict(zlab_fixture()["dflash_config"], **scalars)
    back = export.load_draft(str(tmp_path))
    assert back.config == c
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in draft.state_dict().items())


def test_load_refuses_mismatched_tensors(tmp_path):
    export.save_draft(DraftModel(tiny_config()), str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["dflash_config"]["selector_rank"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="predecessor_codebook"):
        export.load_draft(str(tmp_path))
    # a config.json that is not JSON: refused naming the line
    (tmp_path / "config.json").write_text('{"architectures": ["DFlash2DraftModel"],\n "x": 1,,}')
    with pytest.raises(UsageError, match="line 2"):
        export.load_draft(str(tmp_path))


def test_shipped_configs_load_with_the_published_tensors():
    for name in os.listdir(os.path.join(HERE, "configs")):
        if name.endswith(".json"):  # *.flags: recipes, not drafts
            c = config.load_config(os.path.join(HERE, "configs", name))
            with torch.device("meta"):
                m = DraftModel(c)
            assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == spec_tensor_shapes(c)
            if name == "qwen3.8-27b-dflash2.json":  # the published model's size
                assert sum(p.numel() for p in m.parameters()) == 1_924_404_480


# ============================================================================ checkpoint formats
# ------------------------------------------------------------------- the zlab and SpecForge layouts
@pytest.mark.parametrize(
    "is_causal,causal", [("absent", [True, False]), (False, [False, False]), (True, [True, True])]
)
def test_zlab_layout_causality_matches_the_public_loaders(is_causal, causal):
    """Unset: sliding layers causal in the block, full layers bidirectional (Z Lab, SGLang, vLLM);
    an explicit value applies to every layer."""
    d = zlab_fixture() if is_causal == "absent" else zlab_fixture(is_causal=is_causal)
    assert config.config_from_dict(d).is_causal == (None if is_causal == "absent" else is_causal)
    draft, (embed_w, feats, ids), ref = block_follows_the_rule(d, causal)
    with torch.no_grad():
        other = reference_block(draft, d, embed_w, feats, ids, 9, [not x for x in causal])
    assert (ref - other).abs().max() > 1e-3  # the check can tell them apart


@pytest.mark.parametrize(
    "kw,scale",
    [(dict(dflash={"input_embedding_scale": 0.5}), 0.5), (dict(rope_parameters=YARN), 1.0)],
)
def test_input_embedding_scale_and_yarn_in_both_paths(kw, scale):
    d = zlab_fixture(**kw)
    draft, (embed_w, feats, ids), ref = block_follows_the_rule(d, [True, False], scale)
    with torch.no_grad():
        plain = reference_block(draft, zlab_fixture(), embed_w, feats, ids, 9, [True, False])
    assert (ref - plain).abs().max() > 1e-3  # the check can tell them apart


# ---------------------------------------------------------------------------- scaled RoPE


@pytest.mark.parametrize(
    "rope_parameters",
    [
        YARN,
        dict(YARN, beta_fast=16, beta_slow=2, mscale=1.0, mscale_all_dim=0.8, truncate=False),
        # wavelengths 6.3, 63, 628, 6283 against 16 and 64: kept, smoothed, scaled
        dict(YARN, rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0),
        rope(rope_type="linear", factor=2.0),
    ],
)
def test_scaled_rope_equals_transformers_rotary_embedding(rope_parameters):
    """model.rope_frequencies equals transformers' init functions bit for bit, so the rotation is
    Qwen3RotaryEmbedding's."""
    d = zlab_fixture(rope_parameters=dict(rope_parameters))
    c = config.config_from_dict(d)
    inv_freq, scale = model.rope_frequencies(c)
    kind = rope_parameters["rope_type"]
    want, want_scale = ROPE_INIT_FUNCTIONS[kind](qwen3_config(d), torch.device("cpu"))
    assert torch.equal(inv_freq, want) and scale == want_scale
    x, pos = torch.randn(1, 3, 7, 8), torch.tensor([[0, 5, 31, 40, 100, 200, 255]])
    ours = model.rope(x, pos, inv_freq, scale)  # [1, heads, L, hd]
    theirs = hf_rotate(d)(x[0].transpose(0, 1), pos[0].tolist()).transpose(0, 1)
    assert (ours[0] - theirs).abs().max() <= 1e-5
    plain = model.rope(x, pos, *model.rope_frequencies(config.config_from_dict(zlab_fixture())))
    assert (ours - plain).abs().max() > 1e-2


def test_rope_frequencies_follow_the_draft_and_stay_fp32():
    """inv_freq: a non-persistent buffer that follows replace() and .to(device), stays fp32 under
    .to(bf16) (rope() computes in fp32), and is in no export."""
    c = tiny_config(rope_scaling=YARN_SCALING)
    fp32 = model.rope_frequencies(c)[0]
    for change in ({"rope_scaling": dict(YARN_SCALING, factor=8.0)}, {"rope_theta": 1e6}):
        changed = dataclasses.replace(c, **change)
        want = model.rope_frequencies(changed)[0]
        assert not torch.equal(want, fp32), change
        assert torch.equal(DraftModel(changed).layers[0].self_attn.inv_freq, want), change
    plain = DraftModel(dataclasses.replace(c, rope_scaling=None)).layers[1].self_attn.inv_freq
    assert plain.tolist() == pytest.approx([1e4 ** -(i / 8) for i in range(0, 8, 2)], rel=1e-6)
    keys = list(spec_tensor_shapes(c))
    draft = DraftModel(c)
    attns = [layer.self_attn for layer in draft.layers]
    assert list(draft.state_dict()) == keys
    assert all(torch.equal(a.inv_freq, fp32) and a.inv_freq.dtype == torch.float32 for a in attns)
    draft.to(torch.bfloat16)
    assert all(a.q_proj.weight.dtype == torch.bfloat16 for a in attns)
    assert all(torch.equal(a.inv_freq, fp32) and a.inv_freq.dtype == torch.float32 for a in attns)
    draft.to("meta")
    assert all(a.inv_freq.is_meta and a.inv_freq.dtype == torch.float32 for a in attns)
    assert list(draft.state_dict()) == keys
    with torch.device("meta"):  # built where it runs: the frequencies start beside the weights
        assert all(layer.self_attn.inv_freq.is_meta for layer in DraftModel(c).layers)


# --------------------------------------------------------------------------- fields refused or read
def test_harmless_fields_accepted_and_old_names_read():
    base = config.config_from_dict(zlab_fixture())
    quiet = zlab_fixture(
        bos_token_id=None,
        eos_token_id=[5, 6],
        pad_token_id=None,
        transformers_version="4.57.0",
        use_cache=True,
        dtype="float32",
        auto_map={"AutoModel": "dflash.DFlashDraftModel"},
        _name_or_path="x",
        max_window_layers=28,
        tie_word_embeddings=True,
    )
    assert config.config_from_dict(quiet) == dataclasses.replace(base, tie_word_embeddings=True)
    # SpecForge writes an integer rope_theta
    integer = zlab_fixture(rope_parameters={"rope_theta": 10000, "rope_type": "default"})
    assert config.config_from_dict(integer) == base
    # the shipped configs' names; with sliding layers an absent use_sliding_window reads as true
    old = zlab_fixture(torch_dtype="bfloat16", rope_theta=10000.0)
    del old["dtype"], old["rope_parameters"], old["use_sliding_window"]
    assert config.config_from_dict(old) == base
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    legacy = broken(zlab_fixture(rope_theta=1e4, rope_scaling=scaling), "rope_parameters", DELETE)
    yarn = config.config_from_dict(zlab_fixture(rope_parameters=YARN))
    assert config.config_from_dict(legacy) == yarn
    # the shipped configs use the old names; what this code writes uses the current ones
    c = config.load_config(os.path.join(HERE, "configs", "qwen3-8b-dflash2.json"))
    written = config.config_to_dict(c)
    assert written["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}
    assert "rope_theta" not in written and written["is_causal"] is False
    assert config.config_from_dict(written) == c


@pytest.mark.parametrize("is_causal", [None, False])
def test_unset_is_causal_survives_training_and_export(setup, tmp_path, is_causal):
    d = zlab_fixture() if is_causal is None else zlab_fixture(is_causal=is_causal)
    (tmp_path / "draft.json").write_text(json.dumps(d))
    ck = run(
        setup, tmp_path / "ck", "--max-steps", "1", "--draft-config", str(tmp_path / "draft.json")
    )
    export.export(str(tmp_path / "ck"), str(tmp_path / "out"), torch.float32)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert export.load_any(str(tmp_path / "out")).config.is_causal is is_causal
    # an unset is_causal stays absent in the checkpoint and the export
    assert ck["config"].get("is_causal", "absent") == written.get("is_causal", "absent")
    assert ("is_causal" in written) is (is_causal is not None)
    assert "dtype" in written and "torch_dtype" not in written and "rope_parameters" in written


# --------------------------------------------------------------------------- the speculators format
def speculators_fixture(non_causal=False, **kw) -> dict:
    """A config.json as speculators 0.9.0's DFlash2DraftModel.save_pretrained writes it."""
    drop = ("architectures", "dflash_config", "dtype", "num_target_layers", "transformers_version")
    layer = {k: v for k, v in zlab_fixture().items() if k not in drop}
    # block_size, mask_token_id and the DFlash2 fields sit at the top level
    dflash = {k: v for k, v in zlab_fixture()["dflash_config"].items() if k != "target_layer_ids"}
    d = {
        "architectures": ["DFlash2DraftModel"],
        "auto_map": {"": "config.DFlash2SpeculatorConfig"},
        "aux_hidden_state_layer_ids": [1, 3],
        **dflash,
        "draft_vocab_size": 64,
        "dtype": "float32",
        "sample_from_anchor": False,
        "sliding_window_non_causal": non_causal,
        "speculators_config": {
            "algorithm": "dflash2",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "some/verifier"},
        },
        "speculators_model_type": "dflash2",
        "speculators_version": "0.9.0",
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": layer,
        "transformers_version": "5.19.0",
    }
    d.update(kw)
    return d


@pytest.mark.parametrize(
    "is_causal,layer_types,non_causal",
    [(None, [SLIDING, SLIDING], False), (False, [SLIDING, FULL], True), (None, [FULL, FULL], True)],
)
@pytest.mark.parametrize("sharded", [False, True])
def test_speculators_export_round_trip(tmp_path, is_causal, layer_types, non_causal, sharded):
    draft = tiny_draft(
        4, is_causal=is_causal, layer_types=layer_types, sliding_window=6, num_target_layers=None
    )
    write_ckpt(tmp_path / "ckpt.pt", draft)
    argv = [str(tmp_path / "ckpt.pt"), "--out-dir", str(tmp_path / "spec"), "--dtype", "fp32"]
    export.main(argv + "--format speculators --verifier Org/Target-4L".split())
    if sharded:  # as a public sharded checkpoint: shards + index
        shard_by_hand(tmp_path / "spec")
    d = json.loads((tmp_path / "spec" / "config.json").read_text())
    c = draft.config
    # the layout speculators writes; aux ids: target_layer_ids [0, 2, 3] + 1
    want = speculators_fixture(non_causal, aux_hidden_state_layer_ids=[1, 3, 4])
    want["speculators_config"]["verifier"] = {"name_or_path": "Org/Target-4L", "architectures": []}
    for k in ("auto_map", "transformers_version", "transformer_layer_config"):
        del want[k]
    layer = d.pop("transformer_layer_config")
    assert d == want
    named = dict(model_type="qwen3", hidden_size=32, num_hidden_layers=2, layer_types=layer_types)
    assert {k: layer[k] for k in named} == named and "is_causal" not in layer
    assert layer["rope_parameters"] == rope(rope_type="default")
    assert layer.get("use_sliding_window", False) is (SLIDING in layer_types)
    back = export.load_any(str(tmp_path / "spec"))
    assert back.config == c
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in draft.state_dict().items())
    assert torch.equal(block_hidden(back), block_hidden(draft))
    # and back to the Z Lab form
    export.export(str(tmp_path / "spec"), str(tmp_path / "zlab"), torch.float32)
    assert config.load_config(str(tmp_path / "zlab")) == c


@pytest.mark.parametrize("non_causal,causal", [(False, [True, False]), (True, [False, False])])
def test_speculators_checkpoint_with_verifier_copies(tmp_path, non_causal, causal):
    d = speculators_fixture(non_causal)
    (tmp_path / "config.json").write_text(json.dumps(d))
    zl = config.config_from_dict(zlab_fixture(num_target_layers=None))
    draft = randomize(DraftModel(zl), std=0.1)
    names = ["embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm"]
    copies = {f"{k}.weight": torch.randn(64, 32) for k in names}
    save_file({**draft.state_dict(), **copies}, str(tmp_path / "model.safetensors"))
    back = export.load_any(str(tmp_path))
    assert back.config.is_causal is (False if non_causal else None)
    # the verifier copies dropped
    assert set(back.state_dict()) == set(draft.state_dict())
    block_follows_the_rule(d["transformer_layer_config"], causal, draft=back)
    # not misread as the Z Lab form
    with pytest.raises(UsageError, match="speculators-format"):
        config.load_config(str(tmp_path))


@pytest.mark.parametrize(
    "key,value,named",
    [
        ("sample_from_anchor", True, "sample_from_anchor"),
        ("draft_vocab_size", 32, "draft_vocab_size"),
        ("target_hidden_size", 64, "target_hidden_size"),
        ("aux_hidden_state_layer_ids", [0, 3], "aux_hidden_state_layer_ids"),
        ("speculators_model_type", "dflash", "speculators_model_type"),
        ("markov_rank", 256, "markov_rank"),
        ("sliding_window_non_causal", DELETE, "sliding_window_non_causal"),
        ("block_size", 8, "speculative_tokens"),
        ("transformer_layer_config.attention_bias", True, "attention_bias"),
        ("transformer_layer_config.is_causal", False, "is_causal"),
    ],
)
def test_speculators_fields_refused_by_name(key, value, named):
    with pytest.raises(UsageError, match=named):
        speculators.config_from_speculators(broken(speculators_fixture(), key, value), "spec")


@pytest.mark.parametrize(
    "kw,named",
    [
        (dict(output_multiplier=0.5), "output_multiplier"),
        (dict(input_embedding_scale=2.0), "input_embedding_scale"),
        # unset + mixed: vLLM reads it otherwise
        (dict(layer_types=[SLIDING, FULL], sliding_window=6), "is_causal"),
        # full layers are bidirectional there
        (dict(is_causal=True), "is_causal"),
        (dict(plain=True), "DFlash2"),
    ],
)
def test_speculators_export_refuses_what_it_cannot_say(tmp_path, kw, named):
    write_ckpt(tmp_path / "ckpt.pt", tiny_draft(4, **kw))
    with pytest.raises(UsageError, match=named):
        export.export(
            str(tmp_path / "ckpt.pt"), str(tmp_path / "out"), fmt="speculators", verifier="t"
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "layout,differs",
    [
        (dict(layer_types=[SLIDING, FULL], sliding_window=64, is_causal=False), False),
        (dict(layer_types=[SLIDING, SLIDING], sliding_window=64), False),  # is_causal unset
        (dict(layer_types=[FULL, FULL], rope_scaling=YARN_SCALING), False),
        # a window shorter than the context: speculators counts it from the anchor, this project
        # from each query (docs/training-at-scale.md)
        (dict(layer_types=[SLIDING, SLIDING], sliding_window=8), True),
    ],
)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # CPU: unfused
def test_speculators_library_computes_the_same_block(tmp_path, layout, differs):
    """speculators 0.9.0's training forward of the fp32 export gives both paths' block (anchor 13 of
    24 tokens) and unary logits. It needs transformers<=5.19, so a venv of its own:

        python3 -m venv .venv-spec && . .venv-spec/bin/activate
        grep -v '^transformers' requirements.txt > .venv-spec/requirements.txt
        pip install -r .venv-spec/requirements.txt speculators==0.9.0
        pip uninstall -y torchvision torchaudio  # their operator registration breaks transformers
        python -m pytest -q compat/test_compat.py -k speculators_library
    """
    pytest.importorskip("speculators")
    from speculators.models.dflash2 import DFlash2DraftModel

    S, a = 24, 13
    target = tiny_target("qwen3", initializer_range=0.2)
    target.save_pretrained(tmp_path / "target")
    ids = torch.randint(0, 63, (1, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    c = tiny_config(block_size=8, target_layer_ids=[0, 2, 3], **layout)
    draft = randomize(DraftModel(c), seed=1).eval()  # tiny_draft(8, seed=1), its RoPE computed
    feats = torch.cat([hidden[i + 1] for i in draft.config.target_layer_ids], -1)
    write_ckpt(tmp_path / "ckpt.pt", draft)
    out, verifier = str(tmp_path / "spec"), str(tmp_path / "target")
    export.export(
        str(tmp_path / "ckpt.pt"), out, torch.float32, fmt="speculators", verifier=verifier
    )
    spec = DFlash2DraftModel.from_pretrained(out).eval()
    loss_mask = torch.zeros(1, S, dtype=torch.long)
    loss_mask[0, a] = 1
    # verifier_last_hidden_states feeds only its loss's targets, which are not compared
    kw = dict(verifier_last_hidden_states=torch.zeros(1, S, c.hidden_size), max_anchors=1)
    with torch.no_grad():
        h_spec, u_spec, *_ = spec._backbone_forward(
            feats, ids, loss_mask, **kw, document_ids=0 * ids
        )
        embed_w = target.get_input_embeddings().weight
        paths = both_paths(draft, embed_w, feats[0], ids[0], a)
        u = draft.unary_logits(paths[0], target.lm_head)
    diffs = [(h - h_spec[0]).abs().max() for h in paths] + [(u - u_spec[0]).abs().max()]
    assert all(d > 0.1 for d in diffs) if differs else all(d <= 1e-4 for d in diffs)
