"""config.json <-> DraftConfig: a DFlash / DFlash2 draft's config.json (docs/semantics.md,
section 3) read into model.py's DraftConfig and written from it: the DFlash fields under
`dflash_config`, the rest Qwen3-style at the top level. Every config read or changed here is held
to compat/config_checks.py's rules (model.py does not call them).
"""

import dataclasses
import os

from compat.config_checks import SCALARS, read_rope, refuse_incomplete, refuse_unread, validate
from model import DFLASH2_FIELDS, DraftConfig
from support.common import UsageError, read_json

# ---------------------------------------------------------------------- config.json <-> DraftConfig
FIELDS = {f.name for f in dataclasses.fields(DraftConfig)}
REQUIRED = [f.name for f in dataclasses.fields(DraftConfig) if f.default is dataclasses.MISSING]
# the fields config.json holds under dflash_config
NESTED = ("block_size", "target_layer_ids", "mask_token_id") + DFLASH2_FIELDS + SCALARS


def config_from_dict(d: dict, source: str = "config") -> DraftConfig:
    """A DraftConfig from a config.json dict; never from a target's config."""
    refuse_unread(d, source, FIELDS, NESTED)
    flat = {k: v for k, v in d.items() if k in FIELDS}
    flat.update(d.get("dflash_config") or {})  # nested values win over legacy top-level ones
    # the current names (rope_parameters) or the older ones (rope_theta, rope_scaling)
    flat["rope_theta"], flat["rope_scaling"] = read_rope(d, source)
    refuse_incomplete(flat, d.get("architectures") or [], source, REQUIRED, DFLASH2_FIELDS)
    c = DraftConfig(**flat)
    validate(c)  # every rule of docs/semantics.md, section 3
    return c


def load_config(path: str) -> DraftConfig:
    """From a JSON file, or a directory holding config.json."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise UsageError(f"no draft config at {file}")
    return config_from_dict(read_json(file), source=file)


def replace_config(c: DraftConfig, **changes) -> DraftConfig:
    """c with some fields changed (train.py's overrides), held to the rules a config.json is."""
    c = dataclasses.replace(c, **changes)
    validate(c)
    return c


def config_to_dict(c: DraftConfig) -> dict:
    """The public config.json, in transformers' current names; an unset is_causal stays absent, so
    a re-export never states a value its source did not have."""
    d = {
        "architectures": ["DFlash2DraftModel" if c.dflash2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "max_window_layers": c.num_hidden_layers,
        "hidden_act": "silu",
        # Slot 0 of a block is the anchor, never a proposal (docs/semantics.md, section 1). Said
        # explicitly: readers of the key assume true where it is absent (llama.cpp b11434:
        # src/models/dflash.cpp:317-318).
        "sample_from_anchor": False,
    }
    # without it transformers' Qwen3Config drops sliding_window
    if "sliding_attention" in c.layer_types:
        d["use_sliding_window"] = True
    for f in dataclasses.fields(DraftConfig):
        v = getattr(c, f.name)
        if f.name not in NESTED + ("rope_theta", "rope_scaling") and v is not None:
            d[f.name] = v
    d["rope_parameters"] = {
        "rope_theta": c.rope_theta,
        **(c.rope_scaling or {"rope_type": "default"}),
    }
    d["dflash_config"] = {k: getattr(c, k) for k in NESTED if getattr(c, k) is not None}
    return d
