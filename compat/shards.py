"""A draft directory's tensor files, laid out as transformers lays them out (export.py writes and
reads them):

    model.safetensors                     every tensor, up to --max-shard-size
    model-00001-of-0000N.safetensors ...  past it: shards, split in order (a tensor larger than the
    model.safetensors.index.json          limit gets a shard of its own), and the index naming the
                                          shard of each tensor: {"metadata": {"total_size"},
                                          "weight_map": {name: file}}
"""

import argparse
import json
import os
import re

from safetensors.torch import load_file, save_file

from support.common import UsageError, atomic_write, write_json

MAX_SHARD_BYTES = 5 * 10**9  # transformers 4.x's default (5.x raised its own to 50GB)
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


# ----------------------------------------------------------------------------- writing
def save_tensors(sd: dict, out_dir: str, max_shard_bytes=None):
    """sd's tensors (CPU, contiguous) -> one model.safetensors, or past max_shard_bytes shards and
    their index; the weight files of an earlier export that this one does not overwrite go."""
    shards, size = [{}], 0
    for k, v in sd.items():
        if max_shard_bytes and shards[-1] and size + v.nbytes > max_shard_bytes:
            shards, size = shards + [{}], 0
        shards[-1][k], size = v, size + v.nbytes
    n = len(shards)
    names = (
        [WEIGHTS] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    for name, part in zip(names, shards):
        with atomic_write(os.path.join(out_dir, name)) as tmp:
            save_file(part, tmp, metadata={"format": "pt"})
    if n > 1:
        write_json(
            os.path.join(out_dir, INDEX),
            {
                "metadata": {"total_size": sum(v.nbytes for v in sd.values())},
                "weight_map": {k: f for f, p in zip(names, shards) for k in p},
            },
        )
    keep = set(names) | ({INDEX} if n > 1 else set())
    for name in os.listdir(out_dir):  # the weight files of an earlier export
        if (name in (WEIGHTS, INDEX) or SHARD.fullmatch(name)) and name not in keep:
            os.remove(os.path.join(out_dir, name))


def size_in_bytes(s: str) -> int:
    """'5GB' -> 5 * 10**9, '500MiB' -> 500 * 2**20, '1000' -> 1000 (transformers' units)."""
    units = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    m = re.fullmatch(r"(\d+)\s*([KMG]I?B)?", s.strip(), re.IGNORECASE)
    if not m or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 5GB, 500MB, 2GiB)")
    return int(m.group(1)) * units[(m.group(2) or "").upper()]


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
