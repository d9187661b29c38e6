"""The cost model of speculative decoding on this machine: can a draft pay here, and from what tau?

    python -m speed.cost  # the embedded target, a random draft of the main config
    python -m speed.cost --draft out/smollm2-math-dflash2/export --context 400

Batch-1 speculative decoding trades one target forward per token for one per cycle:

    plain:        t_1 per token                     (one target forward of 1 token)
    speculative:  (t_n + t_draft) / tau per token   (a target forward of the n verified tokens,
                                                     one draft forward with its head over the n-1
                                                     slots sent and its selector walk, tau tokens
                                                     committed)
    speedup = tau * t_1 / (t_n + t_draft),  so it pays from tau > (t_n + t_draft) / t_1.

On a GPU t_n is close to t_1 (the weights are read once for all n tokens). On a CPU it need not be,
and which GEMMs are fastest depends on the CPU: stock fp32 GEMMs (MKL) with more than one row
streamed the weights far slower than the 1-row path on two machines; oneDNN's packed weights
(gemm.py) fixed that on an AMD EPYC and were twice as slow as stock on an Intel Xeon, where MKL's
own packed GEMM fixed it. So the functions below are also the short measurement behind
`--target-gemm auto` (machine.choose_layout), cached per machine: the decode table for generate.py,
the batched shapes for prepare.py. A tree of N nodes (tree.py) costs t_{N+1}: the table runs to 33
tokens, and generate.py's `auto` picks a path or a tree from it (auto.choose).
"""

import argparse
import functools

import torch
from tqdm import tqdm

import model
from compat.config_json import load_config
from decoding import crop, draft_proposal, embed_and_head, new_cache, with_cache
from export import load_any
from speed import machine
from speed.auto import priced_sizes
from speed.gemm import drop_packs, set_layout
from support.common import DTYPES, bounded, run
from support.show import now
from support.target import load_target


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
    """Median ms of one target forward of `tokens` new tokens after `context` cached ones, `rows`
    rows."""
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
        # back to the same context every time
        crop(cache, context)

    ms = median_ms(step, repeats, dev)
    # MKL's packs for this many rows: a copy of the weights each
    drop_packs(target)
    return ms


def fastest_rows(ms: dict, B: int) -> dict:
    """{r: ms of the head over r block rows} -> {L: the fastest r that covers slots 1..L, i.e. r >=
    L + 1}."""
    return {L: min(range(L + 1, B + 1), key=lambda r: (ms[r], r)) for L in range(1, B)}


@torch.no_grad()
def head_rows(draft, target, repeats: int = 3) -> dict:
    """{L: r}: the block rows the head should score to cover slots 1..L. Its GEMM [r, H] x [H, V]
    does not cost in proportion to r, and not alike on every CPU: with fp32 MKL 3 rows cost a third
    of 8 on one machine; in bf16 on an AMX Xeon 8 rows cost a seventh of 2..7. So every r in 2..B is
    timed here."""
    c, p = draft.config, next(draft.parameters())
    head = scoring_head(target, draft)
    h = torch.randn(1, c.block_size, c.hidden_size, dtype=p.dtype, device=p.device)
    ms = {
        r: median_ms(lambda: draft.unary_logits(h[:, :r], head), repeats, p.device)
        for r in range(2, c.block_size + 1)
    }
    return fastest_rows(ms, c.block_size)


def scoring_head(target, draft):
    """The head the draft's rows are scored with here: the one speed/ gave it, else the target's."""
    return machine.draft_head(draft) or embed_and_head(target, draft)[1]


def use_fastest_rows(draft, target):
    """Give the draft, in its precision here, the head that scores its rows fastest (draft.head,
    which the decoding loops score with: machine.draft_head): its own head, over head_rows' row
    counts. -> those row counts, {L: r}."""
    draft.head = FastestRows(scoring_head(target, draft), head_rows(draft, target))
    return draft.head.rows


class FastestRows(torch.nn.Module):
    """The head over a block's first n rows [1, n, H] -> [1, n, V], computed as a GEMM of rows[n -
    1] rows (zeros past the n real ones) where that many cost less here. In a float GEMM output row
    i depends on input row i alone; the int8 head (int8.py) quantizes its input per call, over the
    real rows and the zeros."""

    def __init__(self, head, rows: dict):
        super().__init__()
        self.head, self.rows = head, rows

    def forward(self, h):
        n = h.shape[1]
        r = self.rows.get(n - 1, n)
        if r > n:
            h = torch.cat([h, h.new_zeros(h.shape[0], r - n, h.shape[2])], dim=1)
        return self.head(h)[:, :n]


def draft_block(draft, target, context: int):
    """A timing's draft forward: its (embed, head, forward), forward() -> hidden [1, B, H] of one
    block after `context` cached rows of random features (the cost depends on their number, not
    their values)."""
    c, p = draft.config, next(draft.parameters())
    embed, head = embed_and_head(target, draft)[0], scoring_head(target, draft)
    ctx = model.ContextCache()
    ctx.append(
        draft,
        torch.randn(
            1, context, len(c.target_layer_ids) * c.hidden_size, dtype=p.dtype, device=p.device
        ),
        torch.arange(context, device=p.device)[None],
    )
    anchor, pos = torch.tensor([1], device=p.device), torch.tensor([context], device=p.device)
    return embed, head, lambda: model.forward_inference(draft, embed, ctx, anchor, pos)


@torch.no_grad()
def draft_ms(draft, target, context: int, repeats: int, L: int, use_selector: bool) -> float:
    """Median ms of what a cycle runs before its verify: one draft forward from `context` cached
    rows, the head over rows 0..L as decoding.py scores them, and with use_selector the selector's
    walk over slots 1..L (draft_proposal)."""
    p = next(draft.parameters())
    _, head, forward = draft_block(draft, target, context)
    ids = torch.ones(1, context + 1, dtype=torch.long, device=p.device)

    def cycle():
        h = forward()
        u = draft.unary_logits(h[:, : L + 1], head)[:, 1:]
        if use_selector:
            draft_proposal(draft, h[:, 1 : L + 1], u, ids)

    return median_ms(cycle, repeats, p.device)


def draft_costs(draft, target, context: int, repeats: int, walk: bool) -> dict:
    """{L: draft_ms over L slots} for L = 1..B-1: what auto and the CLI price."""
    return {
        L: draft_ms(draft, target, context, repeats, L, walk)
        for L in range(1, draft.config.block_size)
    }


def each_layout(target, measure) -> dict:
    """{layout: measure()} over the layouts this target can run in here (machine.layouts_here),
    which start with "stock"; the target is left stock."""
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
    c, dtype = target.config, next(target.parameters()).dtype
    return f"{c._name_or_path} {c.model_type} {c.hidden_size}x{c.num_hidden_layers} {dtype}"


def decode_key(target, sizes, context: int = 200) -> str:
    """decode_table's key in the machine's cache (v1: stock, onednn)."""
    return machine.machine_key("decode", target_key(target), context, sizes, "layouts v2")


def data_key(target) -> str:
    """data_costs' key in the machine's cache."""
    return machine.machine_key("data", target_key(target), "layouts v2")


def decode_table(target, sizes, context: int = 200, repeats: int = 7, refresh=False) -> dict:
    """{layout: {n: ms}}: batch-1 target forwards of n tokens in each layout, measured once per
    machine (refresh: measure again and keep the new numbers)."""
    table = machine.cached(
        decode_key(target, sizes, context),
        lambda: each_layout(
            target, lambda: {str(n): target_ms(target, context, n, repeats) for n in sizes}
        ),
        refresh,
    )
    return {layout: {int(n): ms for n, ms in row.items()} for layout, row in table.items()}


def data_costs(target, repeats: int = 3) -> dict:
    """{layout: ms} of prepare.py's two shapes, measured once per machine: one step of a 64-row
    regeneration after 128 tokens, plus one 256-token feature forward."""

    def measure():
        return target_ms(target, 128, 1, repeats, rows=64) + target_ms(target, 0, 256, repeats)

    return machine.cached(data_key(target), lambda: each_layout(target, measure))


def fastest(row: dict, n: int) -> str:
    """The layout with the faster n-token forward in a decode table."""
    return min(row, key=lambda layout: row[layout][n])


def verify_sums(table: dict, B: int) -> dict:
    """{layout: ms of its verify forwards of 2..B tokens, summed}: how speculation's layout is
    judged (every path priced alike: one size alone was too noisy a judge)."""
    return {layout: sum(row[n] for n in range(2, B + 1)) for layout, row in table.items()}


def decoding_layouts(target, draft, wanted) -> dict:
    """The target's GEMM layout for speculation and for plain decoding (1 token):
    machine.choose_layout, from the decode table where it must measure. Speculation's layout is the
    one with the smallest verify_sums. The target is left in the speculation's layout. ->
    {"speculate", "plain": layout names, "why", "table" (or None), "costs": costs(sizes, mode) ->
    ({n: ms of an n-token target forward}, {L: ms of the draft's cycle over L slots}), what
    auto.plan prices shapes with; its 1-token price is the fastest plain step of the table}. The
    draft's cycle is timed with the head it will decode with (tune.py sets it first)."""
    B, table = draft.config.block_size, {}
    sizes = priced_sizes(B)

    def measure():
        table.update(decode_table(target, sizes=sizes))
        return verify_sums(table, B)

    layout, why = machine.choose_layout(
        next(target.parameters()).dtype, target.device, wanted, measure
    )
    plain = fastest(table, 1) if table else layout
    set_layout(target, layout)
    if table:
        why += (
            f"; plain decoding {plain} ("
            + ", ".join(f"{k} {row[1]:.1f}" for k, row in table.items())
            + " ms)"
        )

    @functools.cache  # timed once per mode, however many shapes ask
    def t_draft(mode):
        return draft_costs(draft, target, 200, 5, mode == "selector")

    # the table of the speculation's layout where it was measured, else measured now
    def costs(want, mode):
        if table and set(want) <= set(sizes):
            row = table[layout]
            return {
                n: min(r[1] for r in table.values()) if n == 1 else row[n] for n in want
            }, t_draft(mode)
        return {n: target_ms(target, 200, n, 5) for n in want}, t_draft(mode)

    return {"speculate": layout, "plain": plain, "why": why, "table": table or None, "costs": costs}


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Measure the batch-1 cost model of speculative decoding."
    )
    ap.add_argument(
        "--target", default=None, help="target model name or path (default: the embedded target)"
    )
    ap.add_argument(
        "--draft", default=None, help="a trained draft (default: random weights of --draft-config)"
    )
    ap.add_argument("--draft-config", default="configs/smollm2-135m-dflash2.json")
    ap.add_argument(
        "--draft-dtype",
        choices=["auto", *DTYPES, "int8"],
        default="auto",
        help="auto: what generate.py picks on this machine (machine.py)",
    )
    ap.add_argument(
        "--context", type=bounded(int, low=1), default=200, help="cached tokens before each forward"
    )
    ap.add_argument("--repeats", type=bounded(int, low=1), default=15)
    args = ap.parse_args(argv)

    precision = machine.draft_precision(args.draft_dtype, "cpu")
    draft = load_any(args.draft) if args.draft else model.DraftModel(load_config(args.draft_config))
    target, _ = load_target(args.target, torch.float32)
    draft = machine.draft_in(precision, draft.eval(), target, "cpu")
    B = draft.config.block_size
    # what a cycle runs before its verify, per depth L
    walk = draft.candidate_selector is not None
    rows = use_fastest_rows(draft, target)
    t_draft = draft_costs(draft, target, args.context, args.repeats, walk)
    print(
        f"{machine.describe('cpu')}; context {args.context} tokens, {torch.get_num_threads()} "
        f"threads; draft ({precision}, block {B}) forward + head over L "
        f"slots{' + selector walk' * walk}: "
        + ", ".join(f"L={L} {ms:.1f}" for L, ms in t_draft.items())
        + " ms (head rows: "
        + " ".join(str(r) for r in rows.values())
        + ")"
    )
    # what generate.py's auto prices; it reuses this measurement
    sizes = priced_sizes(B)
    table = decode_table(target, sizes, args.context, args.repeats, refresh=True)
    print(
        f"{'fp32 target':<16}" + "".join(f"{f'{n} tok':>9}" for n in sizes) + f"{'t_B / t_1':>11}"
    )
    # the fastest plain decoding this machine has
    plain = min(ms[1] for ms in table.values())
    for layout, ms in table.items():
        print(
            f"{layout + ' GEMMs':<16}"
            + "".join(f"{ms[n]:>7.1f}ms" for n in sizes)
            + f"{ms[B] / ms[1]:>11.2f}"
        )
    print(
        f"plain decoding is fastest with {fastest(table, 1)} GEMMs ({plain:.1f} ms), a block of "
        f"{B} is verified fastest with {fastest(table, B)} GEMMs. A path of k drafts pays from tau "
        f"(t_(k+1) + draft_k) / {plain:.1f}:"
    )
    for layout, ms in table.items():
        print(
            f"{layout + ' GEMMs':<16}"
            + ", ".join(f"k={k} {(ms[k + 1] + t_draft[k]) / plain:.2f}" for k in range(1, B))
        )


if __name__ == "__main__":
    run(main)
