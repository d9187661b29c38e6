"""What compiles in train.py, and the guard around it: batches padded to loader.static_shapes
compile once a bucket; past the limit dynamo would silently run flex eager and dense (tens of GB),
so that ends the run instead.
"""

import contextlib

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch._dynamo.utils import counters

from support import kernels
from support.common import UsageError

COMPILE = dict(automatic_dynamic_shapes=False, recompile_limit=64, fail_on_recompile_limit_hit=True)


def choose_attention(attention: str, device) -> str:
    """--attention auto: support/kernels.py's choice; flex only where torch can train with it."""
    attention = kernels.choose(attention, device)
    if attention == "flex" and torch.device(device).type == "cpu":
        raise UsageError(
            "--attention flex: torch runs FlexAttention on CPU forward only (no backward in 2.13); "
            "train on CPU with --attention sdpa"
        )
    return attention


def anything_compiles(args) -> bool:
    """Whether batches are padded to loader.static_shapes: where anything compiles (see COMPILE)."""
    return args.compile or args.attention == "flex"


def graphs() -> int:
    """The graphs dynamo has compiled so far: a step after which there are more compiled."""
    return counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def guard(on: bool):
    """COMPILE's dynamo settings while on; past the recompile limit a ValueError (a bug)."""
    try:
        with torch._dynamo.config.patch(**COMPILE) if on else contextlib.nullcontext():
            yield
    except FailOnRecompileLimitHit as e:
        raise ValueError(
            f"a compiled function met more than {COMPILE['recompile_limit']} shapes (batches are "
            "padded to loader.static_shapes, so this is a bug to report); train without --compile "
            f"and with --attention sdpa meanwhile ({str(e).splitlines()[0]})"
        ) from e  # a bug: dynamo's own traceback stays beside ours
