"""GEMM layouts for the target on a CPU: stock nn.Linear, oneDNN's packed weights, MKL's packed
GEMM."""

import torch

from support.common import UsageError


# ----------------------------------------------------------------------------- CPU decoding
class PackedLinear(torch.nn.Module):
    """nn.Linear with its weight also held in oneDNN's own layout, converted once. Why: a stock fp32
    GEMM streams the weights far slower for 8 rows than for 1 (verifying 8 tokens cost 1.7 decoding
    steps on a 2-core CPU); oneDNN's layout streams them alike (1.2-1.4 steps, docs/cpu.md), and
    speculation lives on that ratio."""

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
    """nn.Linear through MKL's packed GEMM for inputs of 1..MAX_ROWS rows: fp32, x86. Why: MKL's
    stock GEMM repacks the whole weight every call, and with a few rows that, not the product, is
    what a verify waits for (44.6 ms stock, 31.4 packed at 3 rows on a Xeon: docs/cpu.md). A pack
    holds for one row count: one per count, made when that many rows first come; prefill stays
    stock."""

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


def slots(target, kinds) -> list:
    """(module, name) of each child of the target that is an instance of kinds."""
    return [
        (m, name)
        for m in target.modules()
        for name, c in m.named_children()
        if isinstance(c, kinds)
    ]


def pack_linears(target, layout: str = "onednn"):
    """Swap every nn.Linear of a CPU target for LAYOUTS[layout]'s, in place; returns the target."""
    param = next(target.parameters())
    check_packable(layout, param.dtype, param.device)
    for m, name in slots(target, torch.nn.Linear):
        setattr(m, name, LAYOUTS[layout](getattr(m, name)))
    return target


def unpack_linears(target):
    """Undo pack_linears: every packed linear back to an nn.Linear with the same (dense) weight."""
    for m, name in slots(target, tuple(LAYOUTS.values())):
        child = getattr(m, name)
        out, inp = child.weight.shape
        linear = torch.nn.Linear(inp, out, bias=child.bias is not None, device="meta")
        linear.weight, linear.bias = child.weight, child.bias
        setattr(m, name, linear)
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
        places = slots(target, (torch.nn.Linear, *LAYOUTS.values()))
        kept[now] = [getattr(m, name) for m, name in places]
        if layout in kept:
            for (m, name), module in zip(places, kept[layout]):
                setattr(m, name, module)
        else:
            unpack_linears(target)
            if layout != "stock":
                pack_linears(target, layout)
    return target


def drop_packs(target):
    """Free the MKL packs made so far (each a copy of its weight); a forward makes what it needs."""
    for m in target.modules():
        if isinstance(m, MklLinear):
            m.packs.clear()
