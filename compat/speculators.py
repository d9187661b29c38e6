"""The speculators checkpoint format, which vllm-project/speculators trains and writes and vLLM
serves (`export.py --format speculators`): the zlab format's tensors, the draft's Qwen3 layer config
nested under `transformer_layer_config`, the DFlash fields at the top level. Read with the meaning
speculators' DFlash2DraftModel gives it; what the format cannot say, or speculators would read
otherwise, is refused naming the field.
"""

import os

from compat.config_checks import SCALARS
from compat.config_json import config_from_dict, config_to_dict
from compat.shards import load_tensors
from model import DFLASH2_FIELDS
from support.common import UsageError, read_json

# Frozen copies of the verifier's tensors, which a speculators checkpoint may carry: the draft
# uses the target's own.
VERIFIER_COPIES = (
    "embed_tokens.weight",
    "lm_head.weight",
    "verifier_lm_head.weight",
    "verifier_norm.weight",
)
# the keys of a speculators config.json this code needs, and every key it reads
REQUIRED = {
    "transformer_layer_config",
    "aux_hidden_state_layer_ids",
    "draft_vocab_size",
    "block_size",
    "mask_token_id",
    "sliding_window_non_causal",
    "speculators_config",
    *DFLASH2_FIELDS,
}
SPECULATORS_KEYS = REQUIRED | {
    "architectures",
    "auto_map",
    "speculators_model_type",
    "speculators_version",
    "target_hidden_size",
    "sample_from_anchor",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "tie_word_embeddings",
}


def config_from_speculators(d: dict, source: str):
    """A speculators config.json -> DraftConfig. aux_hidden_state_layer_ids count HF hidden_states
    (0 = the embeddings), so target_layer_ids are one less. Full-attention layers are always
    bidirectional there, sliding ones iff sliding_window_non_causal: so true is an explicit
    is_causal false, false an unset is_causal."""
    if d.get("speculators_model_type") != "dflash2":
        raise UsageError(
            f"{source}: speculators_model_type {d.get('speculators_model_type')!r}; only dflash2 "
            "is read"
        )
    missing = sorted(REQUIRED - set(d))
    unknown = sorted(set(d) - SPECULATORS_KEYS)
    if missing or unknown:
        raise UsageError(
            f"{source}: speculators config: missing {missing}, not implemented {unknown}"
        )
    if not isinstance(d["transformer_layer_config"], dict):
        raise UsageError(f"{source}: transformer_layer_config must be an object")
    layer = dict(d["transformer_layer_config"])
    if "is_causal" in layer or "dflash_config" in layer:
        raise UsageError(
            f"{source}: transformer_layer_config.is_causal / dflash_config are not read by "
            "speculators; sliding_window_non_causal decides"
        )
    methods = (d["speculators_config"] or {}).get("proposal_methods") or [{}]
    hidden = layer.get("hidden_size")
    checks = {
        # slot 0 never proposes (docs/semantics.md, section 1)
        "sample_from_anchor": (d.get("sample_from_anchor", False), False),
        # DFlash2 needs the full vocab
        "draft_vocab_size": (d["draft_vocab_size"], layer.get("vocab_size")),
        "target_hidden_size": (d.get("target_hidden_size") or hidden, hidden),
        "speculative_tokens": (methods[0].get("speculative_tokens"), d["block_size"] - 1),
    }
    for name, (value, implemented) in checks.items():
        if value != implemented:
            raise UsageError(
                f"{source}: {name} = {value!r} is not implemented (only {implemented!r})"
            )
    aux = d["aux_hidden_state_layer_ids"]
    if not isinstance(aux, list) or not all(isinstance(i, int) and i >= 1 for i in aux):
        raise UsageError(
            f"{source}: aux_hidden_state_layer_ids must be layer outputs (integers >= 1), got "
            f"{aux!r}"
        )
    layer.update(
        architectures=["DFlash2DraftModel"],
        dflash_config={
            "block_size": d["block_size"],
            "target_layer_ids": [i - 1 for i in aux],
            "mask_token_id": d["mask_token_id"],
            **{k: d[k] for k in DFLASH2_FIELDS},
        },
    )
    if d["sliding_window_non_causal"] and "sliding_attention" in (layer.get("layer_types") or []):
        # with no sliding layer the flag says nothing: stays unset
        layer["is_causal"] = False
    return config_from_dict(layer, f"{source} (transformer_layer_config)")


def read_speculators(path: str, d: dict) -> tuple:
    """A speculators draft directory, its config.json read as d -> (DraftConfig, the draft's own
    tensors, without the verifier's copies)."""
    sd = {k: v for k, v in load_tensors(path).items() if k not in VERIFIER_COPIES}
    return config_from_speculators(d, os.path.join(path, "config.json")), sd


def speculators_config(c, verifier: str) -> dict:
    """The speculators config.json for config c; refuses what speculators 0.9.0 cannot say or would
    read otherwise."""
    if not c.dflash2:
        raise UsageError("--format speculators writes DFlash2 drafts (its dflash2 model type) only")
    for name in SCALARS:
        if getattr(c, name) is not None:
            raise UsageError(
                f"{name} is set, but speculators' DFlash2 has no such field and would drop it; "
                "export in the zlab format"
            )
    causal = {c.causal_in_block(t == "sliding_attention") for t in c.layer_types}
    # speculators makes full layers bidirectional, and vLLM's translator applies one causal flag
    # to every layer
    if len(causal) > 1 or (True in causal and "full_attention" in c.layer_types):
        raise UsageError(
            f"is_causal {c.is_causal!r} with layer_types {sorted(set(c.layer_types))}: the "
            "speculators format cannot say this so that speculators and vLLM both read it; export "
            "in the zlab format"
        )
    layer = config_to_dict(c)
    # the speculators format says sample_from_anchor at its top level only
    drop = ("architectures", "dflash_config", "is_causal", "num_target_layers", "comment")
    for k in (*drop, "sample_from_anchor"):
        layer.pop(k, None)
    local = os.path.join(verifier, "config.json")  # a local verifier names its architectures
    arch = read_json(local).get("architectures") or [] if os.path.isfile(local) else []
    return {
        "architectures": ["DFlash2DraftModel"],
        "speculators_model_type": "dflash2",
        # the release this layout was checked against
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": c.vocab_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "mask_token_id": c.mask_token_id,
        "block_size": c.block_size,
        "sliding_window_non_causal": not causal.pop(),
        "sample_from_anchor": False,
        **{k: getattr(c, k) for k in DFLASH2_FIELDS},
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "dflash2",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": c.block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": verifier, "architectures": arch},
        },
    }
