"""The draft config: what config.json of a DFlash / DFlash2 draft holds, and its rules (SPEC 3).

A draft config must declare DFlash2DraftModel (or DFlashDraftModel for the plain baseline): it is
never derived from a target model's config. Every rule raises ValueError naming the field and value.
The DFlash fields sit under `dflash_config`; the rest are Qwen3-style fields at the top level.
"""
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

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
    num_target_layers: int
    target_layer_ids: list
    mask_token_id: int
    block_size: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    layer_types: list = None            # per layer "full_attention" | "sliding_attention"
    sliding_window: int = None
    is_causal: bool = False             # True: causal inside the block; False: bidirectional
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # DFlash2 only; all None means plain DFlash
    conv_kernel_size: int = None
    conv_group_size: int = None
    selector_rank: int = None
    selector_top_k: int = None
    output_multiplier: float = None
    final_logit_softcapping: float = None
    comment: str = field(default=None, compare=False)  # free text kept in config.json

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        validate(self)

    @property
    def dflash2(self) -> bool:
        return self.conv_kernel_size is not None


def plain_dflash(c: DraftConfig) -> DraftConfig:
    """The same backbone without convolution and selector: the DFlash baseline."""
    return dataclasses.replace(c, **{f: None for f in DFLASH2_FIELDS})


def _check_int(name, value, low=None, high=None):
    # bool is a subclass of int in Python; a config that says `true` for a size is a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def validate(c: DraftConfig):
    """Every rule of SPEC section 3; each failure names the field and the bad value."""
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers", "max_position_embeddings"):
        _check_int(name, getattr(c, name), low=1)
    _check_int("block_size", c.block_size, low=2)
    if c.num_attention_heads % c.num_key_value_heads:
        raise ValueError(f"num_attention_heads ({c.num_attention_heads}) must be a multiple of "
                         f"num_key_value_heads ({c.num_key_value_heads})")
    if not isinstance(c.target_layer_ids, (list, tuple)) or not c.target_layer_ids:
        raise ValueError(f"target_layer_ids must be a non-empty list, got {c.target_layer_ids!r}")
    for i in c.target_layer_ids:
        _check_int("target_layer_ids", i, low=0, high=c.num_target_layers - 1)
    _check_int("mask_token_id", c.mask_token_id, low=0, high=c.vocab_size - 1)
    if len(c.layer_types) != c.num_hidden_layers:
        raise ValueError(f"layer_types has {len(c.layer_types)} entries, num_hidden_layers is {c.num_hidden_layers}")
    for t in c.layer_types:
        if t not in ("full_attention", "sliding_attention"):
            raise ValueError(f"layer_types entries must be full_attention or sliding_attention, got {t!r}")
    if "sliding_attention" in c.layer_types:
        _check_int("sliding_window", c.sliding_window, low=1)
    if not isinstance(c.is_causal, bool):
        raise ValueError(f"is_causal must be true or false, got {c.is_causal!r}")
    present = [f for f in DFLASH2_FIELDS if getattr(c, f) is not None]
    if present and len(present) != len(DFLASH2_FIELDS):
        missing = [f for f in DFLASH2_FIELDS if getattr(c, f) is None]
        raise ValueError(f"a DFlash2 config needs all of {DFLASH2_FIELDS}; missing {missing}")
    if present:
        _check_int("conv_kernel_size", c.conv_kernel_size, low=1, high=c.block_size)
        _check_int("conv_group_size", c.conv_group_size, low=1)
        if c.hidden_size % c.conv_group_size:
            raise ValueError(f"conv_group_size ({c.conv_group_size}) must divide hidden_size ({c.hidden_size})")
        _check_int("selector_rank", c.selector_rank, low=1)
        _check_int("selector_top_k", c.selector_top_k, low=1, high=c.vocab_size)
    for name in ("output_multiplier", "final_logit_softcapping"):
        v = getattr(c, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if c.final_logit_softcapping is not None and c.final_logit_softcapping <= 0:
        raise ValueError(f"final_logit_softcapping must be > 0, got {c.final_logit_softcapping}")


NESTED = ("block_size", "target_layer_ids", "mask_token_id") + DFLASH2_FIELDS + (
    "output_multiplier", "final_logit_softcapping")


def config_from_dict(d: dict, source: str = "config") -> DraftConfig:
    """A DraftConfig from a config.json dict. Never derives DFlash2 from a target's config."""
    arch = d.get("architectures") or []
    if "DFlash2DraftModel" not in arch and "DFlashDraftModel" not in arch:
        raise ValueError(f"{source}: architectures is {arch!r}; a draft config must declare DFlash2DraftModel "
                         "(or DFlashDraftModel). DFlash2 is never derived from a target model's config.")
    flat = {k: v for k, v in d.items() if k != "dflash_config"}
    flat.update(d.get("dflash_config") or {})  # nested values win over legacy top-level ones
    if "rope_theta" not in flat and isinstance(flat.get("rope_parameters"), dict):
        flat["rope_theta"] = flat["rope_parameters"].get("rope_theta")
    if "DFlash2DraftModel" in arch:
        missing = [f for f in DFLASH2_FIELDS if flat.get(f) is None]
        if missing:
            raise ValueError(f"{source}: DFlash2DraftModel needs dflash_config fields {missing}")
    else:
        extra = [f for f in DFLASH2_FIELDS if flat.get(f) is not None]
        if extra:
            raise ValueError(f"{source}: DFlashDraftModel must not set {extra} (those are DFlash2 fields)")
    names = {f.name for f in dataclasses.fields(DraftConfig)}
    required = [f.name for f in dataclasses.fields(DraftConfig) if f.default is dataclasses.MISSING]
    missing = [k for k in required if k not in flat]
    if missing:
        raise ValueError(f"{source}: missing required field(s) {missing}")
    return DraftConfig(**{k: v for k, v in flat.items() if k in names})


def load_config(path: str) -> DraftConfig:
    """From a JSON file, or a directory holding config.json."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no draft config at {file}")
    with open(file) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON (line {e.lineno}): {e.msg}") from None
    return config_from_dict(d, source=file)


def config_to_dict(c: DraftConfig) -> dict:
    """The public config.json contract (SPEC section 3)."""
    d = {
        "architectures": ["DFlash2DraftModel" if c.dflash2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "use_sliding_window": "sliding_attention" in c.layer_types,
        "max_window_layers": c.num_hidden_layers,
        "hidden_act": "silu",
    }
    for f in dataclasses.fields(DraftConfig):
        v = getattr(c, f.name)
        if f.name not in NESTED and v is not None:
            d[f.name] = v
    d["dflash_config"] = {k: getattr(c, k) for k in NESTED if getattr(c, k) is not None}
    return d
