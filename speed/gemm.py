"""GEMM layouts for the target on a CPU: stock nn.Linear, oneDNN's packed weights, MKL's packed
GEMM.
"""

import torch

from support.common import UsageError


# ----------------------------------------------------------------------------- CPU decoding
class PackedLinear(torch.nn.Module):
    """nn.Linear with its weight also held in oneDNN's own layout, converted once: for CPU decoding.

    Why: with a stock fp32 CPU GEMM (MKL) an input of more than one row streams the weights far
    slower than the 1-row path does, so on a 2-core CPU verifying 8 tokens cost about 1.7 decoding
    steps although both read every weight once (docs/cpu.md). oneDNN with the weight in its own
    layout streams them at about the same speed for 1 and 8 rows: verifying 8 tokens cost 1.2-1.4
    decoding steps, and the decoding step itself got faster too. Speculation lives on that ratio.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        # stay dense: the draft reads the target's head
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = linear.weight.detach().to_mkldnn()
        self.packed_bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()

    def forward(self, x):  # [..., in] -> [..., out]
        return torch._C._nn.mkldnn_linear(
            x.contiguous().to_mkldnn(), self.packed, self.packed_bias
        ).to_dense()


class MklLinear(torch.nn.Module):
    """nn.Linear through MKL's packed GEMM (cblas_sgemm_compute) for inputs of 1..MAX_ROWS rows:
    fp32, x86.

    Why: MKL's stock GEMM repacks the whole weight on every call, and with a few rows that
    repacking, not the product, is what an fp32 verify waits for. Packed once, the weight streams at
    about the 1-row speed: on an AVX-512 Xeon capped to AVX2 kernels, every linear of the target
    took 44.6 ms stock and 31.4 packed at 3 rows, 57.2 and 34.9 at 8 (docs/cpu.md). MKL
    packs for one row count, so there is a pack per count, made the first time that many rows come;
    larger inputs (prefill) keep the stock GEMM.
    """

    MAX_ROWS = 64

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        # {rows: the weight packed for them}
        self.packs = {}

    def forward(self, x):  # [..., in] -> [..., out]
        rows = x.numel() // x.shape[-1]
        if rows > self.MAX_ROWS:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if rows not in self.packs:
            self.packs[rows] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), rows)
        return torch.ops.mkl._mkl_linear(x, self.packs[rows], self.weight, self.bias, rows)


# the packed GEMM layouts; "stock" is nn.Linear
LAYOUTS = {"onednn": PackedLinear, "mkl": MklLinear}


def packable(layout: str, dtype, device) -> bool:
    """oneDNN packs fp32 and bf16 weights, MKL fp32 ones; both on the CPU only."""
    dtypes = (torch.float32, torch.bfloat16) if layout == "onednn" else (torch.float32,)
    return torch.device(device).type == "cpu" and dtype in dtypes


def check_packable(layout: str, dtype, device):
    """Refuse, in one line, a layout this dtype and device cannot be packed into."""
    if not packable(layout, dtype, device):
        raise UsageError(
            f"--target-gemm {layout}: only for {'fp32 or bf16' if layout == 'onednn' else 'fp32'} "
            f"targets on the CPU, not {dtype} on {torch.device(device).type}"
        )


def pack_linears(target, layout: str = "onednn"):
    """Swap every nn.Linear of a CPU target for a PackedLinear ("onednn") or an MklLinear ("mkl"),
    in place; returns the target. machine.choose_layout decides which (and refuses what this CPU
    cannot run)."""
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
                linear = torch.nn.Linear(
                    child.weight.shape[1],
                    child.weight.shape[0],
                    bias=child.bias is not None,
                    device="meta",
                )
                linear.weight, linear.bias = child.weight, child.bias
                setattr(module, name, linear)
    return target


def layout_of(target) -> str:
    """ "onednn", "mkl" or "stock": the GEMM layout the target's linears are in."""
    return next(
        (name for m in target.modules() for name, cls in LAYOUTS.items() if isinstance(m, cls)),
        "stock",
    )


def set_layout(target, layout: str):
    """Put the target's linears in `layout`. The modules of the layout left stay on the target, and
    coming back reuses them with their packs: packing the 135M target for one row count takes about
    0.17 s, which bench.py, switching layouts prompt by prompt, must not pay inside its timings."""
    now = layout_of(target)
    if now != layout:
        # {layout: its modules}, not registered
        kept = target.__dict__.setdefault("kept_layouts", {})
        slots = [
            (m, name)
            for m in target.modules()
            for name, c in m.named_children()
            if isinstance(c, (torch.nn.Linear, *LAYOUTS.values()))
        ]
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
    """Free the MKL packs made so far (each is a copy of its weight); the next forward makes what it
    needs."""
    for m in target.modules():
        if isinstance(m, MklLinear):
            m.packs.clear()
