"""Fully sharded training (train.py --fsdp): FSDP2's fully_shard for the draft and, online, for the
frozen target; and the gathering that makes train.py --fsdp's checkpoint whole, which any number
of ranks reads back (full_state, load_full_state). What a rank keeps, why the step is unchanged,
why one whole ckpt.pt and not a torch.distributed.checkpoint directory, and the memory per GPU:
docs/training-at-scale.md, "Sharded training for 27B-class drafts".
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
    """train.py --fsdp over more than one rank, before the optimizer is built (its parameters
    become this rank's slices): the online target (None offline), then the draft."""
    if target is not None:
        shard_target(target)
    shard_draft(objective, layers, bf16)


def shard_draft(objective, layers, bf16: bool):
    """Shard the draft in place: one unit per layer, then the root `objective`
    (train.DraftObjective), whose own unit takes the rest of the draft (fc, norms, selector), all
    used inside its forward. A layer also computes the context's keys and values before the layers
    run (model.Layer.context_kv): registered as a forward method, it gathers the layer's weights
    too. bf16: the layers compute with bf16 copies of the fp32 master slices and reduce gradients in
    fp32; inputs are not cast, autocast chooses, as under DDP."""
    mp = (
        MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        if bf16
        else MixedPrecisionPolicy()
    )
    # context_kv returns transposed views; FSDP warns that an in-place write into one would skip its
    # hook, but nothing writes into them (model.Attention.forward concatenates them into new
    # tensors)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
        register_fsdp_forward_method(layer, "context_kv")
    fully_shard(objective, mp_policy=mp)


@contextlib.contextmanager
def no_sync(objective):
    """train.py's no_sync under --fsdp, as DDP's: the backwards of a step's micro-batches but its
    last keep adding into unsharded gradients (fp32 when the reduce dtype is) without a
    reduce-scatter; the last one reduce-scatters their sum once, instead of once a micro-batch."""
    objective.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        objective.set_requires_gradient_sync(True)


def shard_target(target):
    """Shard the frozen target (no gradients, no optimizer): one unit per decoder layer, then the
    root (embedding, final norm, head), which frees its gathered weights after each forward too. On
    a GPU each unit moves there as it is sharded, so no rank ever holds the whole target on its
    device."""
    for layer in target.model.layers:  # its decoder layers, as model.capture_features reads them
        fully_shard(layer)
    fully_shard(target, reshard_after_forward=True)
    return target


# ----------------------------------------------------------------------------- checkpoints
def full_state(draft, opt) -> tuple:
    """(draft state dict, optimizer state dict), whole and on the CPU, on rank 0 ({} on the other
    ranks). Every rank must call it: it gathers the slices. The optimizer's state is keyed by
    parameter name, so that any rank layout can read it back."""
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(draft, options=whole), get_optimizer_state_dict(
        draft, opt, options=whole
    )


def load_full_state(draft, opt, model_state: dict, opt_state: dict):
    """A whole checkpoint's two dicts -> the sharded draft and optimizer: each rank keeps its own
    slices. AdamW's state keyed by parameter name (full_state's), or by position (opt.state_dict(),
    as a one-process run writes it)."""
    if any(isinstance(p, int) for g in opt_state["param_groups"] for p in g["params"]):
        opt_state = keyed_by_name(draft, opt, opt_state)
    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(draft, model_state, options=whole)
    set_optimizer_state_dict(draft, opt, opt_state, options=whole)


def keyed_by_name(draft, opt, opt_state: dict) -> dict:
    """opt.state_dict()'s form, whose position i is the optimizer's i-th parameter, keyed by
    parameter name instead, the form set_optimizer_state_dict reads."""
    names = {p: name for name, p in draft.named_parameters()}
    order = [names[p] for g in opt.param_groups for p in g["params"]]
    return {
        "state": {order[i]: state for i, state in opt_state["state"].items()},
        "param_groups": [
            dict(g, params=[order[i] for i in g["params"]]) for g in opt_state["param_groups"]
        ],
    }
