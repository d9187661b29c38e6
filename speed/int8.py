"""The draft with int8 weights, for generate.py on x86 CPUs (`--draft-dtype int8`, auto there).

At batch 1 a draft cycle reads every weight of the draft and of the target's head (49,152 x 576 for
SmolLM2) to compute a handful of rows, so it costs about what those weights weigh. Without native
bf16 (AVX2) bf16 runs in software and fp32 GEMMs of 2-8 rows run far below the memory's speed; with
it, oneDNN's bf16 GEMM of 2-7 rows is slow. So the draft's linear layers and the head hold int8
weights (docs/cpu.md, "Precision": on the Xeon, the SmolLM2 draft's head over 3 rows took 1.0 ms
in int8 against 5.7 in fp32 and 113 in bf16):

    weight  w[o, i] ~ s_o q[o, i],  q int8,  s_o = max_i |w[o, i]| / 127        one scale per row
    input   x[i] ~ a (r[i] - z),    r in 0..127, a and z from min and max of x  (dynamic: per call)
    output  y[o] = a s_o sum_i (r[i] - z) q[o, i]                               int32 sums, fp32 out

The inputs keep 7 bits, not 8: AVX2 sums the u8 x s8 products in pairs into 16 bits, which 8-bit
inputs can overflow (fbgemm's `reduce_range`). The kernels are torch's quantized ops (fbgemm on
x86).

fc stays fp32: its input is the target's raw hidden states, where a few features are hundreds of
times larger than the rest, and one scale per call would leave the rest almost no bits. It runs on
the newly accepted rows only, and the norms, attention, convolution taps and selector walk stay fp32
as well.

The draft only proposes and the fp32 target verifies, so int8 changes how often a draft is accepted,
never the output (greedy equality is tested, as for bf16).
"""

import warnings

import torch
import torch.nn as nn


def quantize_weight(w):
    """w [out, in] float -> (q [out, in] int8, s [out] fp32) with w ~ s[:, None] * q."""
    w = w.detach().float()
    s = (w.abs().amax(1) / 127).clamp_min(1e-12)
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s


class Int8Linear(nn.Module):
    """x [..., in] fp32 -> x W^T [..., out] fp32 with W held as int8 rows and fp32 row scales."""

    def __init__(self, weight):
        super().__init__()
        q, s = quantize_weight(weight)
        # torch marks its quantized tensors deprecated (torchao's successors)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(
                q, s.double(), torch.zeros_like(s, dtype=torch.long), 0
            )
            # the kernel's own weight layout
            self.packed = torch.ops.quantized.linear_prepack(qw, None)

    def forward(self, x):
        # True: 7-bit inputs
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)


def runs() -> bool:
    """Whether this machine has a quantized engine that runs Int8Linear (fbgemm needs x86 with
    AVX2)."""
    try:
        Int8Linear(torch.ones(1, 1))(torch.ones(1, 1))
        return True
    except RuntimeError:
        return False


def quantize(draft, head_weight):
    """An fp32 CPU draft in place: every nn.Linear but fc -> Int8Linear. -> the target's head
    head_weight [V, H] as an Int8Linear: what the decoding loops score the draft's rows with (their
    `head`) in place of the fp32 product."""
    for name, m in list(draft.named_modules()):
        if isinstance(m, nn.Linear) and name != "fc":
            parent, _, child = name.rpartition(".")
            setattr(draft.get_submodule(parent), child, Int8Linear(m.weight))
    return Int8Linear(head_weight)
