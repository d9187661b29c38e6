"""train.py --fsdp: FSDP2's fully_shard for the draft and the online target, and a whole
checkpoint that any number of ranks reads back (docs/training-at-scale.md, "Sharded training").
"""

import contextlib
import warnings

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method


def shard(objective, layers, target, bf16: bool):
    """Shard the online target (None offline), then the draft, before the optimizer is built."""
    if target is not None:
        shard_target(target)
    shard_draft(objective, layers, bf16)


def shard_draft(objective, layers, bf16: bool):
    """Shard the draft in place: one unit a layer (context_kv, run before the layers, gathers its
    weights too), then the root `objective` for the rest. bf16: bf16 compute copies of the fp32
    slices, fp32 gradient reduction; inputs left to autocast, as under DDP."""
    half = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    mp = MixedPrecisionPolicy(**(half if bf16 else {}))
    # context_kv returns transposed views; FSDP warns that an in-place write into one would skip its
    # hook, but nothing writes into them (model.Attention.forward concatenates them)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
        register_fsdp_forward_method(layer, "context_kv")
    fully_shard(objective, mp_policy=mp)


@contextlib.contextmanager
def no_sync(objective):
    """DDP's no_sync under --fsdp: a step's gradients are reduce-scattered once, by its last
    micro-batch's backward."""
    objective.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        objective.set_requires_gradient_sync(True)


def shard_target(target):
    """Shard the frozen target: one unit a decoder layer, then the root (embedding, norm, head), so
    that no rank ever holds the whole target on its GPU."""
    for layer in target.model.layers:  # its decoder layers, as model.capture_features reads them
        fully_shard(layer)
    fully_shard(target, reshard_after_forward=True)
    return target


# ----------------------------------------------------------------------------- checkpoints
def full_state(draft, opt) -> tuple:
    """(draft, optimizer) state dicts, whole on rank 0's CPU, the optimizer's keyed by parameter
    name. Every rank must call it: it gathers the slices."""
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(draft, options=whole), get_optimizer_state_dict(
        draft, opt, options=whole
    )


def load_full_state(draft, opt, model_state: dict, opt_state: dict):
    """A whole checkpoint -> this rank's slices of the draft and optimizer (whose state is keyed by
    name, or by position as a one-process run writes it)."""
    if any(isinstance(p, int) for g in opt_state["param_groups"] for p in g["params"]):
        opt_state = keyed_by_name(draft, opt, opt_state)
    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(draft, model_state, options=whole)
    set_optimizer_state_dict(draft, opt, opt_state, options=whole)


def keyed_by_name(draft, opt, opt_state: dict) -> dict:
    """opt.state_dict()'s form keyed by parameter name, as set_optimizer_state_dict reads it."""
    names = {p: name for name, p in draft.named_parameters()}
    order = [names[p] for g in opt.param_groups for p in g["params"]]
    return {
        "state": {order[i]: state for i, state in opt_state["state"].items()},
        "param_groups": [
            dict(g, params=[order[i] for i in g["params"]]) for g in opt_state["param_groups"]
        ],
    }
