"""Training checkpoint -> servable draft directory, in either public checkpoint format
(docs/training-at-scale.md, "Checkpoint formats"; docs/semantics.md, section 3).

    python export.py runs/smollm2/ckpt.pt --out-dir drafts/smollm2-dflash2 [--dtype bf16|fp16|fp32]
    python export.py runs/q8 --out-dir drafts/q8-spec --format speculators --verifier Qwen/Qwen3-8B

Only the draft's own tensors leave (no optimizer state, no embedding, no lm_head: those stay the
target's), as `zlab` (config.json with a `dflash_config`: what Z Lab, SGLang and vLLM load) or
`speculators` (compat/speculators.py), in one model.safetensors. load_any reads every form back,
single-file or sharded (compat/shards.py), and train.py's checkpoint ({"model", "config",
"optimizer", "step", "total", "args"}), so a draft can be re-exported in another dtype or format.
What an engine would refuse or misread is said at export (compat/serving.py).
"""

import argparse
import os
import shutil
import sys
import zipfile

import torch

import model
from compat.config_json import config_from_dict, config_to_dict, load_config
from compat.serving import llamacpp_refusal, serving_flags
from compat.shards import load_tensors, save_tensors
from compat.speculators import read_speculators, speculators_config
from support.common import DTYPES, UsageError, read_json, run, write_json
from support.metrics import ACCEPTANCE, acceptance_file  # the draft's statistics, carried along


# ------------------------------------------------------------------- draft directories: save / load
def save_draft(draft: model.DraftModel, out_dir: str, dtype=None, cfg=None):
    """config.json (cfg, by default the contract's) + exactly the contract's tensors."""
    os.makedirs(out_dir, exist_ok=True)
    sd = {
        k: (v.to(dtype) if dtype else v).detach().contiguous().cpu()
        for k, v in draft.state_dict().items()
    }
    save_tensors(sd, out_dir)
    stored = str(next(iter(sd.values())).dtype).replace("torch.", "")  # e.g. "bfloat16"
    cfg = dict(cfg or config_to_dict(draft.config), dtype=stored)
    # last: a directory with a config.json is complete
    write_json(os.path.join(out_dir, "config.json"), cfg)


def load_draft(path: str, dtype=torch.float32) -> model.DraftModel:
    """A draft directory (config.json + model.safetensors or its shards) -> DraftModel."""
    return draft_from_state_dict(load_config(path), load_tensors(path), source=path, dtype=dtype)


def draft_from_state_dict(cfg, sd: dict, source: str, dtype=torch.float32) -> model.DraftModel:
    """A DraftModel holding the tensors sd, after checking they are exactly what cfg asks for."""
    draft = model.DraftModel(cfg)
    check_state_dict(draft, sd, source)
    draft.load_state_dict({k: v.to(dtype) for k, v in sd.items()})
    return draft.to(dtype)


def check_state_dict(draft: model.DraftModel, sd: dict, source: str):
    expected = {k: tuple(v.shape) for k, v in draft.state_dict().items()}
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    wrong = [
        f"{k}: {tuple(sd[k].shape)} != {expected[k]}"
        for k in expected
        if k in sd and tuple(sd[k].shape) != expected[k]
    ]
    if missing or unexpected or wrong:
        raise UsageError(
            f"{source}: tensors do not match the config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
        )


# ----------------------------------------------------------------------------- training checkpoints
# what wrappers put before every key: torch.compile "_orig_mod.", DistributedDataParallel "module."
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def read_training_checkpoint(file: str, mmap=False) -> dict:
    """train.py's ckpt.pt -> its dict, read as data only (weights_only): loading a checkpoint never
    runs pickled code, and --resume and export.py refuse alike a file holding anything else."""
    if not zipfile.is_zipfile(file):  # torch.save writes a zip archive
        raise UsageError(f"{file}: not a training checkpoint (truncated, or not from torch.save)")
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except RuntimeError:  # torch's reader finds no pickled data in the archive
        raise UsageError(
            f"{file}: not a training checkpoint (a zip archive torch.save did not write)"
        ) from None
    if unsafe:
        raise UsageError(
            f"{file}: holds {', '.join(unsafe)}, which a checkpoint may not: it is read as data "
            "(tensors, numbers, strings, lists, dicts), never as pickled code; store fields instead"
        )
    return torch.load(file, map_location="cpu", mmap=mmap, weights_only=True)


def read_checkpoint(file: str) -> tuple:
    """A training checkpoint file -> (config dict, state dict), wrapper prefixes removed."""
    ckpt = read_training_checkpoint(file)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise UsageError(f"{file}: a training checkpoint needs 'model' and 'config' entries")
    sd = {}
    for k, v in ckpt["model"].items():
        while k.startswith(WRAPPER_PREFIXES):
            k = k.split(".", 1)[1]
        sd[k] = v
    return ckpt["config"], sd


def load_any(path: str, dtype=torch.float32) -> model.DraftModel:
    """A draft from an exported directory (either format), a ckpt.pt, or a run directory with it."""
    cfg_file = os.path.join(path, "config.json")
    if os.path.isdir(path) and os.path.isfile(cfg_file):
        d = read_json(cfg_file)
        if "speculators_model_type" not in d:
            return load_draft(path, dtype).eval()
        cfg, sd = read_speculators(path, d)
        return draft_from_state_dict(cfg, sd, source=path, dtype=dtype).eval()
    file = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise UsageError(
            f"no draft at {path}: expected a checkpoint file, or a directory with "
            "config.json + model.safetensors (or its shards), or one with ckpt.pt"
        )
    cfg_dict, sd = read_checkpoint(file)
    return draft_from_state_dict(
        config_from_dict(cfg_dict, source=file), sd, source=file, dtype=dtype
    ).eval()


# ----------------------------------------------------------------------------- export
def export(source: str, out_dir: str, dtype=torch.bfloat16, fmt="zlab", verifier=None) -> str:
    """load_any(source) -> out_dir/config.json + the contract's tensors in dtype, format fmt."""
    draft = load_any(source)  # fp32: no rounding before the one cast below
    cfg = speculators_config(draft.config, verifier) if fmt == "speculators" else None  # refusals
    save_draft(draft, out_dir, dtype=dtype, cfg=cfg)
    src, dst = acceptance_file(source), os.path.join(out_dir, ACCEPTANCE)
    if os.path.isfile(src) and not os.path.samefile(os.path.dirname(src), out_dir):
        shutil.copyfile(src, dst)
    elif not os.path.isfile(src) and os.path.isfile(dst):
        os.remove(dst)  # an earlier export's statistics, not this draft's
    return out_dir


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = ap.add_argument
    a("checkpoint", help="ckpt.pt, a run directory holding it, or an exported draft directory")
    a("--out-dir", required=True, help="where config.json and the tensors go")
    a("--dtype", choices=sorted(DTYPES), default="bf16", help="the exported tensors' dtype")
    a("--format", choices=["zlab", "speculators"], default="zlab", help="the public format written")
    a("--verifier", help="--format speculators: the target whose embedding and head it reloads")
    args = ap.parse_args(argv)
    if args.format == "speculators" and not args.verifier:
        ap.error("--format speculators needs --verifier (the target model's hub name or path)")
    dtype = DTYPES[args.dtype]
    export(args.checkpoint, args.out_dir, dtype, args.format, args.verifier)
    draft = load_any(args.out_dir)
    files = sorted(f for f in os.listdir(args.out_dir) if f.endswith(".safetensors"))
    print(
        f"exported {'DFlash2' if draft.config.dflash2 else 'DFlash'} draft ({args.dtype}, "
        f"{args.format} format, {len(files)} tensor file(s)) to {args.out_dir}"
    )
    print(serving_flags(draft.config))
    refusal = llamacpp_refusal(draft.config)
    if refusal and args.format == "zlab":  # SGLang, vLLM and Z Lab load it: a warning, not an error
        print(f"warning: {refusal}; tools/llamacpp.py will not convert it", file=sys.stderr)


if __name__ == "__main__":
    run(main)
