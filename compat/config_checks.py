"""The contract a draft's config.json keeps (docs/semantics.md, section 3): every validation rule,
the refusals of fields this code does not implement, and the RoPE rules, each a UsageError naming
the field. Every key is read into DraftConfig, or known not to change the computation (HARMLESS),
or must hold the one value implemented (FIXED); any other is refused by name.
"""

import math

from support.common import UsageError

# The scaled RoPE types implemented (model.rope_frequencies, as transformers' own init functions
# compute them), each with the rope_parameters keys it reads: (required, optional).
# dynamic and longrope are left out: their frequencies depend on the longest position seen so far,
# which the public loaders handle differently.
ROPE_KEYS = {
    "linear": ({"factor"}, set()),
    "llama3": (
        {"factor", "low_freq_factor", "high_freq_factor"},
        {"original_max_position_embeddings"},
    ),
    "yarn": (
        {"factor"},
        {
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        },
    ),
}
# The optional scalars a draft's dflash_config may set.
SCALARS = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")


# ----------------------------------------------------------------------------- a DraftConfig
def _check_int(name, value, low=None, high=None):
    # bool is a subclass of int in Python; a config that says `true` for a size is a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise UsageError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise UsageError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise UsageError(f"{name} must be <= {high}, got {value}")


def _check_number(name, value, positive=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise UsageError(f"{name} must be > 0, got {value}")


def _check_rope_scaling(s):
    if not isinstance(s, dict) or s.get("rope_type") not in ROPE_KEYS:
        kind = s.get("rope_type") if isinstance(s, dict) else s
        raise UsageError(
            f"rope_parameters.rope_type {kind!r} is not implemented (only default, "
            f"{', '.join(ROPE_KEYS)}); refused rather than run as plain RoPE"
        )
    required, optional = ROPE_KEYS[s["rope_type"]]
    missing, unknown = (
        sorted(required - set(s)),
        sorted(set(s) - required - optional - {"rope_type"}),
    )
    if missing or unknown:
        raise UsageError(
            f"rope_parameters for rope_type {s['rope_type']!r}: missing {missing}, "
            f"not implemented {unknown}"
        )
    for k, v in s.items():
        if k not in ("rope_type", "truncate"):
            _check_number(f"rope_parameters.{k}", v)
    if not isinstance(s.get("truncate", True), bool):
        raise UsageError(f"rope_parameters.truncate must be true or false, got {s['truncate']!r}")


def validate(c):
    """Every rule of docs/semantics.md, section 3, on a DraftConfig c."""
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
    ):
        _check_int(name, getattr(c, name), low=1)
    _check_int("block_size", c.block_size, low=2)
    if c.num_attention_heads % c.num_key_value_heads:
        raise UsageError(
            f"num_attention_heads ({c.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({c.num_key_value_heads})"
        )
    if not isinstance(c.target_layer_ids, (list, tuple)) or not c.target_layer_ids:
        raise UsageError(f"target_layer_ids must be a non-empty list, got {c.target_layer_ids!r}")
    if c.num_target_layers is not None:
        _check_int("num_target_layers", c.num_target_layers, low=1)
    top = None if c.num_target_layers is None else c.num_target_layers - 1
    for i in c.target_layer_ids:
        _check_int("target_layer_ids", i, low=0, high=top)
    _check_int("mask_token_id", c.mask_token_id, low=0, high=c.vocab_size - 1)
    _check_number("rope_theta", c.rope_theta, positive=True)
    if c.rope_scaling is not None:
        _check_rope_scaling(c.rope_scaling)
    if len(c.layer_types) != c.num_hidden_layers:
        raise UsageError(
            f"layer_types has {len(c.layer_types)} entries, num_hidden_layers is "
            f"{c.num_hidden_layers}"
        )
    for t in c.layer_types:
        if t not in ("full_attention", "sliding_attention"):
            raise UsageError(
                f"layer_types entries must be full_attention or sliding_attention, got {t!r}"
            )
    if "sliding_attention" in c.layer_types:
        # a window narrower than the block would also cut the block, where the public loaders differ
        _check_int("sliding_window", c.sliding_window, low=c.block_size)
    if c.is_causal is not None and not isinstance(c.is_causal, bool):
        raise UsageError(f"is_causal must be true, false or absent, got {c.is_causal!r}")
    if c.dflash2:
        _check_int("conv_kernel_size", c.conv_kernel_size, low=1, high=c.block_size)
        _check_int("conv_group_size", c.conv_group_size, low=1)
        if c.hidden_size % c.conv_group_size:
            raise UsageError(
                f"conv_group_size ({c.conv_group_size}) must divide hidden_size ({c.hidden_size})"
            )
        _check_int("selector_rank", c.selector_rank, low=1)
        _check_int("selector_top_k", c.selector_top_k, low=1, high=c.vocab_size)
    for name in SCALARS:
        if getattr(c, name) is not None:
            _check_number(name, getattr(c, name), positive=name == "final_logit_softcapping")


# ----------------------------------------------------------------------------- a config.json dict
# Keys that do not change what the draft computes: special token ids, versions, storage dtype, the
# HF auto class. max_window_layers only derives layer_types when those are absent (refused below).
HARMLESS = {
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "transformers_version",
    "use_cache",
    "dtype",
    "torch_dtype",
    "_name_or_path",
    "auto_map",
    "max_window_layers",
}
# Keys that change the computation, with the one value implemented here.
FIXED = {
    "model_type": "qwen3",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "partial_rotary_factor": 1.0,
    "sample_from_anchor": False,
}
# Keys read beside DraftConfig's own fields.
READ = {"architectures", "dflash_config", "rope_parameters", "use_sliding_window"}


def refuse_unread(d: dict, source: str, fields, nested):
    """Refuse a config.json dict d that is not a draft's, holds a key neither read (`fields`, READ;
    `nested` under dflash_config) nor HARMLESS, or a FIXED key with another value."""
    if "speculators_model_type" in d:
        raise UsageError(
            f"{source}: a speculators-format config; read the directory with export.load_any, "
            "or convert it: python export.py DIR --out-dir NEW_DIR"
        )
    arch = d.get("architectures") or []
    if "DFlash2DraftModel" not in arch and "DFlashDraftModel" not in arch:
        raise UsageError(
            f"{source}: architectures is {arch!r}; a draft config must declare DFlash2DraftModel "
            "(or DFlashDraftModel). DFlash2 is never derived from a target model's config."
        )
    unknown = sorted(set(d) - set(fields) - READ - HARMLESS - set(FIXED))
    unknown += [
        f"dflash_config.{k}" for k in sorted(set(d.get("dflash_config") or {}) - set(nested))
    ]
    if unknown:
        raise UsageError(
            f"{source}: field(s) {unknown} not implemented; refused rather than ignored"
        )
    for k, v in FIXED.items():
        if k in d and (d[k] != v or isinstance(d[k], bool) != isinstance(v, bool)):
            raise UsageError(f"{source}: {k} = {d[k]!r} is not implemented (only {v!r})")
    sliding = "sliding_attention" in (d.get("layer_types") or [])
    if d.get("use_sliding_window") is False and sliding:
        raise UsageError(
            f"{source}: use_sliding_window is false, which makes transformers drop sliding_window, "
            "but layer_types has sliding_attention layers; set it true or use full_attention"
        )
    if "layer_types" not in d and d.get("use_sliding_window"):
        raise UsageError(
            f"{source}: use_sliding_window without layer_types; write layer_types explicitly"
        )


def read_rope(d: dict, source: str) -> tuple:
    """(rope_theta, rope_scaling) from the current names (rope_parameters) or the older ones
    (rope_theta, rope_scaling), the way transformers reads them."""
    new, old = d.get("rope_parameters"), d.get("rope_scaling")
    if new and old:
        raise UsageError(
            f"{source}: both rope_parameters and rope_scaling are set; keep one (rope_parameters)"
        )
    p = new or old or {}
    if not isinstance(p, dict):
        raise UsageError(f"{source}: rope_parameters must be an object, got {p!r}")
    p = dict(p)
    if "full_attention" in p or "sliding_attention" in p:
        raise UsageError(f"{source}: rope_parameters per layer type is not implemented")
    if "type" in p:  # the oldest spelling of rope_type
        p["rope_type"] = p.pop("type")
    theta, top = p.pop("rope_theta", None), d.get("rope_theta")
    if theta is not None and top is not None and theta != top:
        raise UsageError(f"{source}: rope_parameters.rope_theta {theta} != rope_theta {top}")
    if theta is None and top is None:
        raise UsageError(
            f"{source}: no rope_theta (in rope_parameters or at the top level); transformers "
            "and vLLM default it differently, so it must be written"
        )
    if p.pop("partial_rotary_factor", 1.0) != 1.0:
        raise UsageError(
            f"{source}: rope_parameters.partial_rotary_factor other than 1.0 is not implemented"
        )
    if p.get("rope_type", "default") == "default":
        if set(p) - {"rope_type"}:
            raise UsageError(
                f"{source}: rope_parameters {sorted(set(p) - {'rope_type'})} not implemented "
                "for default RoPE"
            )
        return (top if theta is None else theta), None
    return (top if theta is None else theta), p


def refuse_incomplete(flat: dict, arch: list, source: str, required, dflash2_fields: tuple):
    """Refuse the fields read (flat) that lack a `required` one, or do not match the architecture:
    DFlash2DraftModel needs all of dflash2_fields, DFlashDraftModel sets none."""
    if "DFlash2DraftModel" in arch:
        missing = [f for f in dflash2_fields if flat.get(f) is None]
        if missing:
            raise UsageError(f"{source}: DFlash2DraftModel needs dflash_config fields {missing}")
    else:
        extra = [f for f in dflash2_fields if flat.get(f) is not None]
        if extra:
            raise UsageError(
                f"{source}: DFlashDraftModel must not set {extra} (those are DFlash2 fields)"
            )
    missing = [k for k in required if k not in flat]
    if missing:
        raise UsageError(f"{source}: missing required field(s) {missing}")
