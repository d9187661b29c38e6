"""Grouped dynamic causal convolution: DFlash2's first addition (docs/semantics.md, section 2.1).

A DFlash draft fills a block of B slots in parallel, and every slot only talks to its
neighbours through attention. DFlash2 wraps each attention and MLP sublayer f in two short
causal convolutions along the block, so that slot i also mixes in slots i-1, i-2, ... directly:

    delta = kernel_projection(a)                                  # a = normalised sublayer input
    x1    = conv(a,     base_kernel[0], delta[side 0])            # "pre"  convolution
    y     = conv(f(x1), base_kernel[1], delta[side 1])            # "post" convolution
    conv(x, beta, d)[i, c] = sum_{t<T} [slot(i) >= t] * (beta[t, c] + d[i, t, c // G]) * x[i - t, c]

beta is a learned kernel shared by all positions; d is a per-position correction predicted from
the hidden state, shared by the G channels of a group. slot(i) = i mod B is the position inside the
block, so a tap never reads across a block boundary: many anchored blocks flattened into one
training stream give exactly what each block gives alone at inference.
"""

import torch
import torch.nn as nn


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        assert hidden_size % group_size == 0, "conv_group_size must divide hidden_size"
        self.hidden_size, self.kernel_size, self.group_size = hidden_size, kernel_size, group_size
        self.block_size = block_size
        self.num_groups = hidden_size // group_size
        T, H = kernel_size, hidden_size
        self.base_kernel = nn.Parameter(torch.empty(2, T, H))  # side 0 = pre, side 1 = post
        # flat output index: side * (T * H/G) + t * (H/G) + group
        self.kernel_projection = nn.Linear(H, 2 * T * self.num_groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        # Exact identity: tap 0 passes x through, every other tap and every correction is zero,
        # so a fresh DFlash2 layer computes exactly what a DFlash layer computes.
        self.base_kernel.zero_()
        self.base_kernel[:, 0, :] = 1.0
        self.kernel_projection.weight.zero_()

    def kernels(self, a: torch.Tensor) -> torch.Tensor:
        """Per-position kernels for both sides: a [N, S, H] -> [2, N, S, T, H]."""
        N, S, _ = a.shape
        T, Gn = self.kernel_size, self.num_groups
        delta = self.kernel_projection(a).view(N, S, 2, T, Gn)  # [N, S, 2, T, H/G]
        delta = delta.repeat_interleave(self.group_size, dim=-1)  # [N, S, 2, T, H]
        return self.base_kernel[:, None, None] + delta.permute(2, 0, 1, 3, 4)  # [2, N, S, T, H]

    def convolve(self, x: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        """x [N, S, H], kernel [N, S, T, H] -> [N, S, H]; causal inside each block of B slots."""
        S = x.shape[1]
        slot = torch.arange(S, device=x.device) % self.block_size  # [S]
        y = kernel[:, :, 0] * x
        for t in range(1, self.kernel_size):
            shifted = torch.nn.functional.pad(x, (0, 0, t, 0))[:, :S]  # shifted[i] = x[i - t]
            inside = (slot >= t).to(x.dtype)[None, :, None]  # tap stays in the block
            y = y + inside * kernel[:, :, t] * shifted
        return y

    def forward(self, a: torch.Tensor, sublayer, *args) -> torch.Tensor:
        """a [N, S, H] is the normalised sublayer input; returns post(f(pre(a), *args)), to add to
        the residual (args: what the sublayer takes besides its input, e.g. attention's positions
        and mask)."""
        k = self.kernels(a)
        return self.convolve(sublayer(self.convolve(a, k[0]), *args), k[1])
