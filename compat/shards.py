"""A draft directory's tensor files, as transformers lays them out: export.py writes one
model.safetensors; reading also takes public checkpoints' shards, model-0000i-of-0000N.safetensors,
and their index, model.safetensors.index.json: {"metadata": {"total_size"}, "weight_map":
{name: file}}.
"""

import json
import os
import re

from safetensors.torch import load_file, save_file

from support.common import UsageError, atomic_write

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


# ----------------------------------------------------------------------------- writing
def save_tensors(sd: dict, out_dir: str):
    """sd's tensors (CPU, contiguous) -> one model.safetensors; the weight files of an earlier
    export or checkpoint there (shards and their index) go."""
    with atomic_write(os.path.join(out_dir, WEIGHTS)) as tmp:
        save_file(sd, tmp, metadata={"format": "pt"})
    for name in os.listdir(out_dir):  # the weight files of an earlier export
        if name == INDEX or SHARD.fullmatch(name):
            os.remove(os.path.join(out_dir, name))


# ----------------------------------------------------------------------------- reading
def read_safetensors(file: str) -> dict:
    try:
        return load_file(file)
    except Exception as e:  # safetensors' own error does not name the file
        raise UsageError(
            f"{file}: not a readable safetensors file (missing, truncated or corrupted?): {e}"
        ) from None


def load_tensors(path: str) -> dict:
    """Every tensor of a draft directory: model.safetensors, or the shards its index names."""
    index = os.path.join(path, INDEX)
    if not os.path.isfile(index):
        return read_safetensors(os.path.join(path, WEIGHTS))
    if os.path.isfile(os.path.join(path, WEIGHTS)):
        raise UsageError(
            f"{path}: holds both {WEIGHTS} and {INDEX}; which is the draft is ambiguous"
        )
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(
            f"{index}: not a readable index (a JSON object with a weight_map): {e}"
        ) from None
    sd = {}
    for shard in sorted(set(weight_map.values())):
        part = read_safetensors(os.path.join(path, os.path.basename(shard)))
        stray = sorted(k for k in part if weight_map.get(k) != shard)
        if stray:
            raise UsageError(
                f"{index}: {shard} holds tensors the index does not place there: {stray[:5]}"
            )
        sd.update(part)
    if set(weight_map) - set(sd):
        raise UsageError(
            f"{index}: lists tensors no shard holds: {sorted(set(weight_map) - set(sd))[:5]}"
        )
    return sd
