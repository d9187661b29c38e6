"""Training checkpoint -> Hugging Face draft directory (config.json + model.safetensors, SPEC section 3).

    python export.py runs/smollm2/ckpt.pt --out-dir drafts/smollm2-dflash2 [--dtype bf16|fp16|fp32]

The checkpoint train.py writes is one torch.save file holding {"model", "config", "optimizer",
"step", "args"}. Only the draft's own tensors leave: no optimizer state, no embedding, no lm_head
(those stay the target's). An exported directory is accepted as input too, to re-export in
another dtype. Anything that does not match its config is refused with a message naming the file.
"""
import argparse
import os

import torch

import model
from common import DTYPES, run
from config import config_from_dict, load_config

# Wrappers add these to every key: torch.compile -> "_orig_mod.", DistributedDataParallel -> "module.".
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def read_checkpoint(file: str) -> tuple:
    """A training checkpoint file -> (config dict, state dict), wrapper prefixes removed."""
    try:
        # weights_only: a checkpoint is data; loading it must never run pickled code.
        ckpt = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{file}: not a readable training checkpoint (truncated or corrupted?): {e}") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise ValueError(f"{file}: a training checkpoint needs 'model' and 'config' entries")
    sd = {}
    for k, v in ckpt["model"].items():
        while k.startswith(WRAPPER_PREFIXES):
            k = k.split(".", 1)[1]
        sd[k] = v
    return ckpt["config"], sd


def load_any(path: str, dtype=torch.float32) -> model.DraftModel:
    """A draft from an exported directory, a training checkpoint file, or a run directory with ckpt.pt."""
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "model.safetensors")):
        return model.load_draft(path, dtype).eval()
    file = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no draft at {path}: expected a checkpoint file, or a directory with "
                                "model.safetensors + config.json, or one with ckpt.pt")
    cfg_dict, sd = read_checkpoint(file)
    return model.draft_from_state_dict(config_from_dict(cfg_dict, source=file), sd, source=file, dtype=dtype).eval()


def export(checkpoint_path_or_dir: str, out_dir: str, dtype=torch.bfloat16) -> str:
    """Write out_dir/config.json + out_dir/model.safetensors (contract tensor names only, in dtype)."""
    draft = load_any(checkpoint_path_or_dir)          # fp32: no rounding before the one cast below
    model.save_draft(draft, out_dir, dtype=dtype)
    return out_dir


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="ckpt.pt, a run directory holding it, or an exported draft directory")
    ap.add_argument("--out-dir", required=True, help="directory for config.json + model.safetensors")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="tensor dtype in the export")
    args = ap.parse_args(argv)
    export(args.checkpoint, args.out_dir, DTYPES[args.dtype])
    cfg = load_config(args.out_dir)
    print(f"exported {'DFlash2' if cfg.dflash2 else 'DFlash'} draft ({args.dtype}) to {args.out_dir}")


if __name__ == "__main__":
    run(main)
