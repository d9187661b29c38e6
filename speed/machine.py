"""What this machine runs fast: one rule for the precision and the GEMM layout of every phase
(docs/cpu.md, "The rule"). Every `auto` flag asks it, for one of four phases:

    data    the target in prepare.py and in online training: batched forwards of many rows
    decode  the target in generate.py, batch 1: fp32 everywhere (bf16 verification is not
            lossless: docs/speculation.md, "Greedy equality and the target's precision")
    train   the draft's autocast in train.py
    draft   the draft in generate.py: it only proposes, so its precision cannot change the output

Precision: bf16 on CUDA and on a CPU with native bf16 (AVX-512 kernels with avx512_bf16 or AMX),
else fp32; the draft on x86 int8 weights (int8.py). GEMM layout (CPU only, gemm.py): bf16 onednn;
fp32 whichever a short measurement found fastest (cost.py); stock on a CPU the rule does not know.
"""

import json
import os
import platform

import torch

from speed import int8
from speed.gemm import check_packable, packable
from support.common import DTYPES, UsageError, atomic_write, cpu_name, dtype_name


# ----------------------------------------------------------------------------- what the CPU has
def cpu_info() -> dict:
    """What torch reports about this CPU. DFLASH2_CPU=generic makes every CPU unknown to the rule
    (fp32, stock GEMMs), so that runs and the tests compute the same thing everywhere."""
    generic = os.environ.get("DFLASH2_CPU") == "generic"
    return {
        "arch": "generic" if generic else platform.machine().lower(),
        # "AVX512", "AVX2", "DEFAULT", "SVE256", ...: the kernels torch runs
        "capability": torch.backends.cpu.get_cpu_capability(),
        # these two read the hardware, not the kernels
        "avx512_bf16": not generic and torch.cpu._is_avx512_bf16_supported(),
        "amx": not generic and torch.cpu._is_amx_tile_supported(),
        # a cap on oneDNN's instructions, if set
        "onednn_isa": "" if generic else os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
    }


def known(info) -> bool:
    """The rule knows x86 CPUs running AVX2 or AVX-512 kernels; anything else falls back."""
    return info["arch"] in ("x86_64", "amd64") and info["capability"] in ("AVX2", "AVX512")


def native_bf16(info) -> tuple:
    """(True if bf16 GEMMs run on bf16 instructions here, why in words)."""
    if not known(info):
        name = f"cpu {info['arch']} {info['capability']}"
        return False, f"{name}, unknown to the rule: fp32 with stock GEMMs"
    has = " + ".join(f for f in ("avx512_bf16", "amx") if info[f])
    if not has:
        return False, f"cpu {info['capability']}, no native bf16"
    # ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2 keep the hardware's bf16 units idle
    isa = info["onednn_isa"].upper()
    if info["capability"] != "AVX512" or isa and "AVX512" not in isa and "AMX" not in isa:
        why = f"cpu {info['capability']} kernels (capped; the hardware has {has}), no native bf16"
        return False, why
    return True, f"cpu AVX512 with {has}"


# ----------------------------------------------------------------------------- precision
def resolve_dtype(name: str, device, phase: str) -> torch.dtype:
    """A dtype flag's value (auto or a DTYPES name) -> torch dtype for this phase on this device."""
    assert phase in ("data", "decode", "train", "draft"), phase
    if name != "auto":
        return DTYPES[name]
    if phase == "decode":  # lossless: greedy speculation equals plain greedy token for token
        return torch.float32
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if native_bf16(cpu_info())[0] else torch.float32


def train_precision(draft: str, target: str, online: bool, device, compiled=False) -> tuple:
    """train.py's --dtype and --target-dtype -> (bf16 autocast for the draft?, the target's dtype,
    the lines that say the choice); compiled: whether the training step compiles, said too."""
    use_bf16 = resolve_dtype(draft, device, "train") == torch.bfloat16
    target_dtype = resolve_dtype(target, device, "data")
    parts = {"draft": ("bf16 autocast" if use_bf16 else "fp32") + (", compiled" * compiled)}
    parts.update({"online target": dtype_name(target_dtype)} if online else {})
    lines = [choice_line(describe(device), **parts)]
    dtypes = [torch.bfloat16] * use_bf16 + [target_dtype] * online
    lines += sorted({slow_bf16_note(dt, device) for dt in dtypes} - {""})
    return use_bf16, target_dtype, lines


def compile_training(flag, dtype: str, device) -> bool:
    """train.py's --compile (None, "on" or "auto") -> whether the training step compiles. auto:
    where the draft trains in bf16, where compiling paid (docs/cpu.md, "torch.compile: where it
    pays")."""
    if flag != "auto":
        return flag == "on"
    return resolve_dtype(dtype, device, "train") == torch.bfloat16


def draft_precision(name: str, device) -> str:
    """generate.py's --draft-dtype (auto, int8 or a DTYPES name) -> the draft's precision here."""
    if name == "int8":
        if torch.device(device).type != "cpu":
            raise UsageError(
                "--draft-dtype int8: the int8 kernels are CPU kernels; use bf16 on a GPU"
            )
        if not int8.runs():
            raise UsageError(
                f"--draft-dtype int8: torch's quantized kernels do not run on this CPU "
                f"({cpu_info()['capability']}; fbgemm needs x86 with AVX2); use fp32"
            )
        return name
    if name == "auto" and torch.device(device).type == "cpu" and known(cpu_info()) and int8.runs():
        return "int8"
    return dtype_name(resolve_dtype(name, device, "draft"))


def draft_in(precision: str, draft, target, device) -> tuple:
    """The draft on the device in draft_precision's choice -> (draft, head): head the target's head
    in int8 for an int8 draft, else None (the target's own)."""
    draft = draft.to(device=device, dtype=DTYPES.get(precision, torch.float32))
    if precision == "int8":
        return draft, int8.quantize(draft, target.get_output_embeddings().weight)
    return draft, None


def slow_bf16_note(dtype, device) -> str:
    """A line for an explicit bf16 on a CPU without native bf16: it runs, but slowly."""
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu":
        native, why = native_bf16(cpu_info())
        if not native:
            return f"note: bf16 on this CPU ({why}) runs in software, often 4-16x slower than fp32"
    return ""


# ----------------------------------------------------------------------------- GEMM layout
def packed_bf16_runs() -> bool:
    """Whether oneDNN's packed bf16 GEMM runs here (it needs avx512bw/vl/dq or avx_ne_convert)."""
    try:
        w = torch.ones(1, 1, dtype=torch.bfloat16)
        torch._C._nn.mkldnn_linear(w.to_mkldnn(), w.to_mkldnn(), None)
        return True
    except RuntimeError:
        return False


def mkl_packs_run() -> bool:
    """Whether MKL's packed fp32 GEMM runs here (torch built with MKL: x86)."""
    try:
        w = torch.ones(1, 1)
        torch.ops.mkl._mkl_linear(w, torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w, None, 1)
        return True
    except (RuntimeError, AttributeError):
        return False


def layouts_here(dtype, device) -> list:
    """The GEMM layouts a target of this dtype can run in on this device, "stock" first."""
    runs = {"onednn": lambda: dtype != torch.bfloat16 or packed_bf16_runs(), "mkl": mkl_packs_run}
    return ["stock"] + [
        layout for layout in ("onednn", "mkl") if packable(layout, dtype, device) and runs[layout]()
    ]


def choose_layout(dtype, device, wanted, measure=None) -> tuple:
    """--target-gemm {auto, stock, onednn, mkl} or None (stock, nothing asked) -> (layout, why).
    measure() -> {layout: ms} over layouts_here(), called only where the rule cannot tell."""
    if wanted is None:
        return "stock", "stock GEMMs"
    if wanted != "auto":
        if wanted != "stock" and wanted not in layouts_here(dtype, device):
            refuse_layout(wanted, dtype, device)
        return wanted, f"{wanted} GEMMs (asked)"
    here = layouts_here(dtype, device)
    if len(here) == 1:
        return "stock", "stock GEMMs"
    info = cpu_info()
    if not known(info):
        return "stock", "stock GEMMs (unknown CPU)"
    if dtype == torch.bfloat16:
        if native_bf16(info)[0] and "onednn" in here:
            return "onednn", "onednn GEMMs (oneDNN bf16)"
        return "stock", "stock GEMMs (no oneDNN bf16 here)"
    ms = measure()
    best = min(ms, key=ms.get)
    times = ", ".join(f"{layout} {t:.1f}" for layout, t in ms.items())
    return best, f"{best} GEMMs (measured {times} ms)"


def refuse_layout(layout: str, dtype, device):
    """--target-gemm asked for a layout this machine cannot run: say in one line what is missing."""
    check_packable(layout, dtype, device)
    if layout == "onednn":
        raise UsageError(
            "--target-gemm onednn with a bf16 target: oneDNN's bf16 GEMM needs AVX-512 (avx512bw, "
            f"avx512vl, avx512dq) or AVX-NE-CONVERT, which this CPU ({cpu_info()['capability']}) "
            "lacks; use --target-gemm stock or --target-dtype fp32"
        )
    raise UsageError(
        f"--target-gemm mkl: this torch has no MKL ({platform.machine()}); use --target-gemm stock"
    )


def choice_line(info_why: str, **parts) -> str:
    """`cpu AVX2, no native bf16: target fp32, stock GEMMs (measured ...); draft fp32`."""
    return info_why + ": " + "; ".join(f"{k} {v}" for k, v in parts.items())


def describe(device) -> str:
    if torch.device(device).type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    return native_bf16(cpu_info())[1].removesuffix(": fp32 with stock GEMMs")


# ---------------------------------------------------------------------------- the per-machine cache
def cache_path() -> str:
    root = os.environ.get("DFLASH2_CACHE") or os.path.expanduser("~/.cache/dflash2")
    return os.path.join(root, "machine.json")


def machine_key(*extra) -> str:
    """This CPU, its kernels and ISA caps, torch and the threads, plus what was measured: a new
    machine measures anew."""
    info, caps = cpu_info(), ("MKL_ENABLE_INSTRUCTIONS", "FBGEMM_ENABLE_INSTRUCTIONS")
    parts = [cpu_name(), info["capability"], info["onednn_isa"]]
    parts += [os.environ.get(v, "") for v in caps]
    parts += [f"torch {torch.__version__}", f"{torch.get_num_threads()} threads", *map(str, extra)]
    return " | ".join(parts)


def cached(key: str, measure):
    """measure()'s JSON-able result for this key, measured once and kept in cache_path()."""
    path = cache_path()
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):  # none yet, or unreadable: measure again and rewrite it
        table = {}
    if key not in table:
        table[key] = measure()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_write(path) as tmp, open(tmp, "w") as f:
            json.dump(table, f, indent=1)
    return table[key]
