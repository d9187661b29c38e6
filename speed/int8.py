"""The draft with int8 weights, for generate.py on x86 CPUs (`--draft-dtype int8`, auto there).

A draft cycle at batch 1 costs about what the draft's and the target head's weights weigh (49,152 x
576 for SmolLM2), and GEMMs of 2-8 rows read them far below memory speed in fp32, and in bf16 too
(software on AVX2, slow in oneDNN for 2-7 rows): on the Xeon the SmolLM2 draft's head over 3 rows
took 1.0 ms in int8, 5.7 in fp32, 113 in bf16 (docs/cpu.md, "Precision"). So the draft's linear
layers and the head hold int8 weights:

    weight  w[o, i] ~ s_o q[o, i],  q int8,  s_o = max_i |w[o, i]| / 127        one scale per row
    input   x[i] ~ a (r[i] - z),    r in 0..127, a and z from min and max of x  (dynamic: per call)
    output  y[o] = a s_o sum_i (r[i] - z) q[o, i]                               int32 sums, fp32 out

The inputs keep 7 bits, not 8: AVX2 sums the u8 x s8 products in pairs into 16 bits, which 8-bit
inputs can overflow (fbgemm's `reduce_range`). fc stays fp32: its input, the target's raw hidden
states, has a few features hundreds of times larger than the rest, which one scale per call would
leave almost no bits; the norms, attention, convolution taps and selector walk stay fp32 too. The
draft only proposes and the fp32 target verifies, so int8 changes how often a draft is accepted,
never the output.
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
            self.packed = torch.ops.quantized.linear_prepack(qw, None)  # the kernel's layout

    def forward(self, x):  # True: 7-bit inputs
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)


def runs() -> bool:
    """Whether a quantized engine runs Int8Linear here (fbgemm needs x86 with AVX2)."""
    try:
        Int8Linear(torch.ones(1, 1))(torch.ones(1, 1))
        return True
    except RuntimeError:
        return False


def quantize(draft, head_weight):
    """An fp32 CPU draft in place: every nn.Linear but fc -> Int8Linear. -> the target's head
    head_weight [V, H] as an Int8Linear, for the decoding loops' `head`."""
    for name, m in list(draft.named_modules()):
        if isinstance(m, nn.Linear) and name != "fc":
            parent, _, child = name.rpartition(".")
            setattr(draft.get_submodule(parent), child, Int8Linear(m.weight))
    return Int8Linear(head_weight)
