"""config.json <-> DraftConfig: what config.json of a DFlash / DFlash2 draft holds
(docs/semantics.md, section 3), read into model.py's DraftConfig and written from it.

A draft config must declare DFlash2DraftModel (or DFlashDraftModel for the plain baseline): it is
never derived from a target model's config. The DFlash fields sit under `dflash_config`; the rest
are Qwen3-style fields at the top level.

Nothing in a config.json is skipped unread, and every rule raises UsageError naming the field and
value. Those rules, and the refusals of fields this code does not implement, are the contract with
the public implementations: they live in compat/config_checks.py, which this file calls on every
config it reads or changes (model.py does not).
"""

import dataclasses
import os

from compat.config_checks import read_rope, refuse_incomplete, refuse_unread, validate
from model import DFLASH2_FIELDS, DraftConfig
from support.common import UsageError, read_json

# ---------------------------------------------------------------------- config.json <-> DraftConfig
FIELDS = {f.name for f in dataclasses.fields(DraftConfig)}
REQUIRED = [f.name for f in dataclasses.fields(DraftConfig) if f.default is dataclasses.MISSING]
# the fields config.json holds under dflash_config
NESTED = (
    ("block_size", "target_layer_ids", "mask_token_id")
    + DFLASH2_FIELDS
    + ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")
)


def config_from_dict(d: dict, source: str = "config") -> DraftConfig:
    """A DraftConfig from a config.json dict. Never derives DFlash2 from a target's config: a dict
    that is not a draft's, or holds a field this code does not implement, is refused by name."""
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
    """The public config.json contract (docs/semantics.md, section 3), in transformers' current
    names. An unset is_causal stays absent, so a re-export never states a value its source did not
    have."""
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
