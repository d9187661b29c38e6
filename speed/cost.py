"""Timings on this machine: which GEMM layout runs the target fastest (behind `--target-gemm auto`:
which GEMMs make a verify of n tokens cost about one step differs by CPU, docs/cpu.md), and how
many rows the draft's head should score. Cached per machine (machine.cached)."""

import time

import torch
from tqdm import tqdm

from decoding import crop, embed_and_head, new_cache, with_cache
from speed import machine
from speed.gemm import drop_packs, set_layout


def now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()  # CUDA runs asynchronously: time the work, not the kernel launches
    return time.perf_counter()


def median_ms(fn, repeats: int, device=torch.device("cpu")) -> float:
    fn()  # warm-up: first calls allocate
    times = []
    for _ in range(repeats):
        t0 = now(device)
        fn()
        times.append(now(device) - t0)
    return 1000 * sorted(times)[len(times) // 2]


@torch.no_grad()
def target_ms(target, context: int, tokens: int, repeats: int, rows: int = 1) -> float:
    """Median ms of a forward of `tokens` new tokens after `context` cached ones, in `rows` rows."""
    gen, dev = torch.Generator().manual_seed(0), next(target.parameters()).device
    vocab = target.config.vocab_size
    cache = new_cache(target)
    if context:
        target(
            input_ids=torch.randint(0, vocab, (rows, context), generator=gen).to(dev),
            **with_cache(target, cache),
        )
    block = torch.randint(0, vocab, (rows, tokens), generator=gen).to(dev)

    def step():
        target(input_ids=block, **with_cache(target, cache))
        crop(cache, context)  # back to the same context every time

    ms = median_ms(step, repeats, dev)
    drop_packs(target)  # MKL's packs for this many rows: a copy of the weights each
    return ms


def fastest_rows(ms: dict, B: int) -> dict:
    """{r: ms of the head over r block rows} -> {L: the fastest r that covers slots 1..L, i.e. r >=
    L + 1}."""
    return {L: min(range(L + 1, B + 1), key=lambda r: (ms[r], r)) for L in range(1, B)}


@torch.no_grad()
def head_rows(draft, head, repeats: int = 3) -> dict:
    """{L: r}: the block rows `head` should score to cover the draft's slots 1..L. The GEMM's cost
    is not in proportion to r and differs by CPU (bf16 on an AMX Xeon: 8 rows a seventh of 2..7's),
    so every r in 2..B is timed."""
    c, p = draft.config, next(draft.parameters())
    h = torch.randn(1, c.block_size, c.hidden_size, dtype=p.dtype, device=p.device)
    ms = {
        r: median_ms(lambda: draft.unary_logits(h[:, :r], head), repeats, p.device)
        for r in range(2, c.block_size + 1)
    }
    return fastest_rows(ms, c.block_size)


def fastest_head(draft, target, head=None):
    """The loops' `head`: FastestRows of head (int8.py's) or the target's in the draft's dtype."""
    head = head or embed_and_head(target, draft)[1]
    return FastestRows(head, head_rows(draft, head))


class FastestRows(torch.nn.Module):
    """The head over a block's first n rows [1, n, H] -> [1, n, V], computed over rows[n - 1] rows
    (zeros past the n real ones) where that many cost less. A float GEMM's row i depends on input
    row i alone; the int8 head quantizes its input per call, the zeros included."""

    def __init__(self, head, rows: dict):
        super().__init__()
        self.head, self.rows = head, rows

    def forward(self, h):
        n = h.shape[1]
        r = self.rows.get(n - 1, n)
        if r > n:
            h = torch.cat([h, h.new_zeros(h.shape[0], r - n, h.shape[2])], dim=1)
        return self.head(h)[:, :n]


def each_layout(target, measure) -> dict:
    """{layout: measure()} over machine.layouts_here; the target is left stock."""
    param, out = next(target.parameters()), {}
    layouts = machine.layouts_here(param.dtype, param.device)
    # minutes on a slow CPU, once per machine (the result is cached): a bar, not silence
    bar = tqdm(layouts, desc="timing the target's GEMM layouts (once per machine)", unit="layout")
    try:
        for layout in bar:
            set_layout(target, layout)
            out[layout] = measure()
    finally:
        set_layout(target, "stock")
        target.__dict__.pop("kept_layouts", None)  # the packed copies measured: freed
    return out


def target_key(target) -> str:
    """The target in the machine's cache keys."""
    c, dtype = target.config, next(target.parameters()).dtype
    return f"{c._name_or_path} {c.model_type} {c.hidden_size}x{c.num_hidden_layers} {dtype}"


def decode_table(target, sizes, context: int = 200, repeats: int = 7) -> dict:
    """{layout: {n: ms}}: batch-1 target forwards of n tokens in each layout, cached."""

    def measure():
        return {str(n): target_ms(target, context, n, repeats) for n in sizes}

    # v1 held stock and onednn only
    key = machine.machine_key("decode", target_key(target), context, sizes, "layouts v2")
    table = machine.cached(key, lambda: each_layout(target, measure))
    return {layout: {int(n): ms for n, ms in row.items()} for layout, row in table.items()}


def data_costs(target, repeats: int = 3) -> dict:
    """{layout: ms} of prepare.py's two shapes, measured once per machine: one step of a 64-row
    regeneration after 128 tokens, plus one 256-token feature forward."""

    def measure():
        return target_ms(target, 128, 1, repeats, rows=64) + target_ms(target, 0, 256, repeats)

    key = machine.machine_key("data", target_key(target), "layouts v2")
    return machine.cached(key, lambda: each_layout(target, measure))


def decoding_layouts(target, draft, wanted) -> dict:
    """The target's GEMM layout for speculation and for plain decoding (1 token), from the decode
    table of 1..B tokens where machine.choose_layout must measure; the target is left in
    speculation's. -> {"speculate", "plain", "why", "table" (or None)}."""
    B, table = draft.config.block_size, {}

    def measure():  # {layout: its verifies of 2..B tokens, summed}: one size alone was too noisy
        table.update(decode_table(target, sizes=list(range(1, B + 1))))
        return {layout: sum(row[n] for n in range(2, B + 1)) for layout, row in table.items()}

    layout, why = machine.choose_layout(
        next(target.parameters()).dtype, target.device, wanted, measure
    )
    plain = min(table, key=lambda k: table[k][1]) if table else layout
    set_layout(target, layout)
    if table:
        ms = ", ".join(f"{k} {row[1]:.1f}" for k, row in table.items())
        why += f"; plain decoding {plain} ({ms} ms)"
    return {"speculate": layout, "plain": plain, "why": why, "table": table or None}
