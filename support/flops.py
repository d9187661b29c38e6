"""How much arithmetic a training step does, and what fraction of the GPU's peak that is (MFU).

Model FLOPs, as MFU is usually defined: the matmuls the step needs, once, the backward at twice the
forward, no recomputation, padding or masked-out score (docs/training-at-scale.md, "Throughput and
MFU", term by term). Left out: norms, RoPE, softmax, top-K, the metrics, kl's target logits.
"""

import contextlib
import time

import torch

from support.common import UsageError

# Dense bf16 tensor-core peak, TFLOP/s, from NVIDIA's data sheets (which quote twice these, sparse).
# The longest key in the device's name wins ("H100 NVL" over "H100"); --peak-tflops overrides.
PEAK_TFLOPS = {"H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}


def keys_per_slot(cfg, context: torch.Tensor, sliding: bool) -> torch.Tensor:
    """Keys read by slot j of each block (attention.attention_rule): context [n] -> [n, B]."""
    B, W, causal = cfg.block_size, cfg.sliding_window, cfg.causal_in_block(sliding)
    j = torch.arange(B)
    if not sliding or W is None:  # own: the block's slots it reads (causal: slots 0..j)
        own = j + 1 if causal else torch.full((B,), B)
        seen = context[:, None].expand(-1, B)
    else:  # the window reaches W - 1 - j rows back before the block
        own = (j + 1).clamp(max=W) if causal else B - (j - W + 1).clamp(min=0)
        seen = torch.minimum(context[:, None], (W - 1 - j).clamp(min=0))
    return seen + own  # [n, B]


def forward_flops(cfg, context: torch.Tensor, tokens: int) -> int:
    """Matmul FLOPs of the draft's forward: anchors after context [n] rows, `tokens` rows."""
    H, d, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    n, B, V = len(context), cfg.block_size, cfg.vocab_size
    slot = 2 * H * (2 * nh * d + 2 * nkv * d) + 6 * H * cfg.intermediate_size  # q k v o, MLP
    if cfg.dflash2:  # the two convolutions' kernel projections
        slot += 8 * H * cfg.conv_kernel_size * (H // cfg.conv_group_size)
    keys = sum(
        int(keys_per_slot(cfg, context, t == "sliding_attention").sum()) for t in cfg.layer_types
    )
    # block slots, the context rows' k and v, the scores and values over the keys a slot reads
    flops = cfg.num_hidden_layers * (n * B * slot + tokens * 4 * H * nkv * d) + 4 * nh * d * keys
    # fc over the target layers, once a token; the unary head over V, once a labelled slot
    flops += tokens * 2 * len(cfg.target_layer_ids) * H * H + n * (B - 1) * 2 * H * V
    if cfg.dflash2:  # the selector: rank r projection, K teacher-forced candidate scores
        flops += n * (B - 1) * 2 * cfg.selector_rank * (H + cfg.selector_top_k)
    return flops


def step_flops(cfg, batch: dict, target_weights: int = 0) -> int:
    """One micro-batch: 3x the draft's forward, plus the online target's (target_weights: its
    linear_weights; 0 offline)."""
    tokens = int(batch["attention_mask"].sum())
    # an anchor at position a of its document reads a context rows
    context = batch["positions"].gather(1, batch["anchors"])[batch["anchor_valid"]].cpu()
    return 3 * forward_flops(cfg, context, tokens) + 2 * target_weights * tokens


def linear_weights(model: torch.nn.Module) -> int:
    """Weights of a model's linear layers: 2x this is its forward FLOPs per token."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def peak_flops(device: torch.device, peak_tflops=None):
    """The device's peak FLOP/s for MFU, or None where none is known (a CPU: no MFU here)."""
    if device.type != "cuda":
        if peak_tflops is not None:
            raise UsageError(
                "--peak-tflops: MFU is only estimated on a CUDA GPU; this run is on the CPU"
            )
        return None
    name = torch.cuda.get_device_name(device)
    known = max((k for k in PEAK_TFLOPS if k in name), key=len, default=None)
    peak = peak_tflops or PEAK_TFLOPS.get(known)
    return None if peak is None else peak * 1e12


class Meter:
    """train.py's throughput: this rank's target tokens, anchors and model FLOPs a second over each
    logging interval, and MFU. It counts the host's copy of a batch (a device batch would wait for
    the GPU). compiles: the steps that compiled are left out, their seconds summed in compile_s."""

    def __init__(self, device: torch.device, peak_tflops=None, compiles=False):
        self.peak = peak_flops(device, peak_tflops)  # FLOP/s; None (a CPU): no MFU, no counting
        self.note = ""  # a line for the log
        if device.type == "cuda" and not self.peak:
            name = torch.cuda.get_device_name(device)
            self.note = f"no MFU: {name} is not in flops.PEAK_TFLOPS; give its --peak-tflops"
        self.compile_s = 0.0 if compiles else None
        self.restart()

    def restart(self):
        self.seen = torch.zeros(3, dtype=torch.float64)  # target tokens, anchors, model FLOPs
        self.start = time.time()

    def count(self, cfg, batch: dict, target=None):
        """Add one micro-batch, on the host; target: the online target (None offline)."""
        weights = linear_weights(target) if target is not None and self.peak else 0
        flop = step_flops(cfg, batch, weights) if self.peak else 0
        counts = [batch["attention_mask"].sum().item(), batch["anchor_valid"].sum().item(), flop]
        self.seen.add_(torch.tensor(counts, dtype=torch.float64))

    def mark(self) -> tuple:
        """What has been counted, and when: leave_out(mark) drops what came after."""
        return self.seen.clone(), time.time()

    def leave_out(self, mark: tuple, compiled=False):
        """Leave what came since mark out of the rates (compiled: its seconds to compile_s)."""
        seen, t = mark
        seconds = time.time() - t
        self.seen, self.start = seen, self.start + seconds
        if compiled:
            self.compile_s += seconds

    @contextlib.contextmanager
    def paused(self):
        """Time that is not training (an evaluation, a checkpoint) left out of the rates."""
        mark = self.mark()
        yield
        self.leave_out(mark)

    def rates(self) -> dict:
        """The rates since the last call (MFU to 4 digits: a tiny model's is not 0); restarts."""
        tok_s, anchor_s, flop_s = (self.seen / max(time.time() - self.start, 1e-9)).tolist()
        self.restart()
        out = {"target_tok_per_s": round(tok_s, 1), "anchors_per_s": round(anchor_s, 1)}
        out.update({"mfu": float(f"{flop_s / self.peak:.4g}")} if self.peak else {})
        return out | ({} if self.compile_s is None else {"compile_s": round(self.compile_s, 3)})

    def brief(self, rates: dict) -> dict:
        """rates (none yet: {}) for a progress bar."""
        kept = {k: rates[k] for k in ("mfu", "compile_s") if k in rates}
        return {"tok_s": f"{rates['target_tok_per_s']:.0f}", **kept} if rates else {}
