"""Offline feature shards: prepare.py --features writes them, train.py (offline) streams them.

    OUT/shard-00000.safetensors   per sample j: input_ids.j [S], loss_mask.j [S], features.j
                                  [S, n_t*H], target_hidden.j [S, H] (--save-target-hidden);
                                  metadata: the settings that made the shard and its counts
    OUT/manifest.json             the target, its layers, the shards, the skip counts

Features are large (a Qwen3-8B target: 40 KB a token in bf16, 4 TB for 100K conversations of 1K
tokens), so FeatureSamples reads a sample's tensors from disk when it is indexed, through one open
shard; what stays in memory is a (shard, sample) index, 16 bytes a sample.
"""

import json
import math
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from support.common import UsageError, atomic_write, read_json, write_json

# what a sample may hold, in file order
KEYS = ("input_ids", "loss_mask", "features", "target_hidden")
# per shard, summed in the manifest
COUNTS = ("num_samples", "skipped_nonfinite", "skipped_no_anchor")


# ----------------------------------------------------------------------------- writing
def shard_path(out_dir: str, k: int) -> str:
    return os.path.join(out_dir, f"shard-{k:05d}.safetensors")


def shard_settings(layer_ids, feature_dtype, max_length, target_hidden, shard_size, kwargs) -> dict:
    """The settings that make a shard (kwargs: the chat template's), as metadata strings."""
    return {
        "target_layer_ids": json.dumps(layer_ids),
        "feature_dtype": feature_dtype,
        "max_length": str(max_length),
        "target_hidden": str(target_hidden),
        "shard_size": str(shard_size),
        "chat_template_kwargs": json.dumps(kwargs, sort_keys=True),  # one spelling per dict
    }


def shard_metadata(path: str) -> dict:
    """A shard's metadata, from its header (older shards: rendered without template kwargs)."""
    with safe_open(path, "pt") as f:
        return {"chat_template_kwargs": "{}", **f.metadata()}


def save_shard(path: str, samples: list, metadata: dict):
    """Sample dicts -> one shard, written atomically: sample j's tensor `key` as `key.j`."""
    tensors = {f"{key}.{j}": t.contiguous() for j, s in enumerate(samples) for key, t in s.items()}
    with atomic_write(path) as tmp:
        save_file(tensors, tmp, metadata={key: str(v) for key, v in metadata.items()})


def shard_done(path: str, settings: dict, n: int) -> bool:
    """Whether a rerun may skip a shard: complete (n samples), made with these settings."""
    if not os.path.exists(path):
        return False
    meta = shard_metadata(path)
    old = {key: meta.get(key) for key in settings}
    if old != settings:
        raise UsageError(
            f"{path} was made with {old}, this run asks for {settings}; use a new --out-dir"
        )
    return sum(int(meta[key]) for key in COUNTS) == n


def write_manifest(out_dir, num_conversations, shard_size, target_name, hidden_size):
    """manifest.json from the shards' own metadata; run once every rank has written its shards."""
    shards, totals = [], dict.fromkeys(COUNTS, 0)
    for k in range(math.ceil(num_conversations / shard_size)):
        path = shard_path(out_dir, k)
        if not os.path.exists(path):
            raise RuntimeError(f"{path} is missing: not every rank has finished")
        meta = shard_metadata(path)
        shards.append({"file": os.path.basename(path), "num_samples": int(meta["num_samples"])})
        totals = {key: v + int(meta[key]) for key, v in totals.items()}
    manifest = {
        "target": target_name,
        "target_layer_ids": json.loads(meta["target_layer_ids"]),
        "hidden_size": hidden_size,
        "feature_dtype": meta["feature_dtype"],
        "target_hidden": meta["target_hidden"] == "True",
        "max_length": int(meta["max_length"]),
        "chat_template_kwargs": json.loads(meta["chat_template_kwargs"]),
        **totals,
        "shards": shards,
    }
    write_json(os.path.join(out_dir, "manifest.json"), manifest)


# ----------------------------------------------------------------------------- reading
class FeatureSamples:
    """A feature directory's samples, read on demand; a slice or list of positions: another."""

    def __init__(self, out_dir: str, files: list, index: torch.Tensor, keys: tuple):
        self.out_dir, self.files, self.keys = out_dir, files, keys
        self.index = index  # [n, 2] long: (shard number, sample number in that shard)
        self.shard = None  # (shard number, open safe_open handle): at most one

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, (slice, list)):
            return FeatureSamples(self.out_dir, self.files, self.index[i], self.keys)
        return self.read(i, self.keys)

    def __getstate__(self):
        # a copy for another process (a DataLoader worker) opens its own shard: no handle travels
        return {**self.__dict__, "shard": None}

    def read(self, i: int, keys) -> dict:
        """Only the tensors `keys` of sample i (e.g. its loss_mask alone, without the features)."""
        k, j = self.index[i].tolist()
        if self.shard is None or self.shard[0] != k:  # the previous shard's handle (and map) goes
            self.shard = (k, safe_open(os.path.join(self.out_dir, self.files[k]), "pt"))
        return {key: self.shard[1].get_tensor(f"{key}.{j}") for key in keys}


def read_manifest(out_dir: str) -> dict:
    """OUT/manifest.json, or UsageError saying how to make one."""
    if not os.path.isfile(os.path.join(out_dir, "manifest.json")):
        raise UsageError(
            f"{out_dir} is not a feature directory (it has no manifest.json); make one with: "
            "python prepare.py --data CONVERSATIONS.jsonl --features --draft-config CONFIG "
            f"--out-dir {out_dir} (or train on a conversations JSONL directly with train.py "
            "--online)"
        )
    return read_json(os.path.join(out_dir, "manifest.json"))


def load_features(out_dir: str) -> FeatureSamples:
    """A feature directory -> its samples in manifest order, streamed from disk."""
    manifest = read_manifest(out_dir)
    files = [shard["file"] for shard in manifest["shards"]]
    index = torch.tensor(
        [(k, j) for k, shard in enumerate(manifest["shards"]) for j in range(shard["num_samples"])],
        dtype=torch.long,
    ).view(-1, 2)
    return FeatureSamples(out_dir, files, index, KEYS if manifest["target_hidden"] else KEYS[:3])
