"""generate.py --bench: each prompt set decoded plainly and speculatively, one row per way.

    python generate.py --draft out/smollm2-math-dflash2/export --bench gsm8k --bench-limit 16 \\
        --max-new-tokens 128 --verify-tokens 7 --tree-budget 8 16 24 32

Rows: every mode (selector, unary) times every verify shape asked (a path of k drafts or a tree of N
nodes: tune.choose), then plain decoding. Where `--target-gemm auto` measured the GEMM layouts,
plain decoding runs in each and the speedups divide by the fastest: the fastest plain decoding this
machine has, not the layout speculation happens to use. "same" counts answers equal to
plain decoding's, token for token. Mean tau is pooled over all cycles of a set; tok/s counts new
tokens over the wall time of each call (prefill included). Each prompt is decoded every way back to
back before the next one starts, so a shared machine that speeds up or slows down meanwhile does so
for every row.
"""

import torch

from decoding import target_generate
from speed.gemm import set_layout
from support.common import count
from support.promptsets import EVAL_SETS, eval_prompts
from support.show import label, speculate, timed
from support.target import encode


def add_flags(a):
    """generate.py's flags for the bench; a: its ArgumentParser's add_argument."""
    a(
        "--bench",
        nargs="+",
        choices=list(EVAL_SETS),
        help="decode these prompt sets every way and compare",
    )
    a("--bench-limit", type=count, help="only the first N prompts of each set")


def tok_per_s(stats) -> float:
    return sum(s.new_tokens for s in stats) / sum(s.seconds for s in stats)


def bench(target, draft, head, tok, args, gen, stop, layouts, shapes):
    """Print the table: args.bench's sets (the first args.bench_limit prompts of each), each row
    one way of decoding them. head: what speculation scores the draft's rows with (tune.decoding's;
    None: the target's); layouts: tune.decoding's; shapes: the verify shapes (tune.choose's)."""
    dev, modes = (
        next(target.parameters()).device,
        ["selector", "unary"] if draft.candidate_selector else ["unary"],
    )
    rows = [(m, shape) for m in modes for shape in shapes]
    plains = list(layouts["table"]) if layouts["table"] else [layouts["plain"]]
    new, kw = args.max_new_tokens, dict(temperature=args.temperature, generator=gen, stop_ids=stop)
    kwargs = args.chat_template_kwargs
    warm = encode(tok, [{"role": "user", "content": "Hi"}], dev, kwargs)
    print(
        f"{'set':<10} {'mode':<14} {'verify':<18} {'mean tau':>8} {'tok/s':>8} {'speedup':>8} "
        f"{'same':>6}"
    )
    for name in args.bench:
        prompts = [
            encode(tok, [{"role": "user", "content": text}], dev, kwargs)
            for text in eval_prompts(name)[: args.bench_limit]
        ]
        for layout in plains:  # warm-ups
            set_layout(target, layout)
            target_generate(target, warm, 8)
        set_layout(target, layouts["speculate"])
        for r in rows:
            speculate(target, draft, warm, 8, r[1], use_selector=r[0] == "selector", head=head)
        # Prompt by prompt, every way back to back: a shared machine's speed drifts over minutes,
        # and a drift must not fall on one way's whole run (plain 22.0 then 23.9 tok/s on two runs
        # of one VM).
        runs, outs = {key: [] for key in ["plain " + layout for layout in plains] + rows}, {}
        for ids in prompts:
            for layout in plains:
                set_layout(target, layout)
                out, stats = timed(lambda: target_generate(target, ids, new, **kw), ids)
                runs["plain " + layout].append(stats)
                # the first layout's: the reference
                if layout == plains[0]:
                    outs.setdefault("plain", []).append(out)
            set_layout(target, layouts["speculate"])
            for r in rows:
                use_selector = r[0] == "selector"
                out, stats = speculate(
                    target,
                    draft,
                    ids,
                    new,
                    r[1],
                    use_selector=use_selector,
                    head=head,
                    **kw,
                )
                runs[r].append(stats)
                outs.setdefault(r, []).append(out)
        base, n = max(tok_per_s(runs["plain " + layout]) for layout in plains), len(prompts)
        for r in rows:
            taus = [t for s in runs[r] for t in s.taus]
            same = sum(torch.equal(a, b) for a, b in zip(outs[r], outs["plain"]))
            print(
                f"{name:<10} {r[0]:<14} {label(r[1]):<18} {sum(taus) / len(taus):>8.2f} "
                f"{tok_per_s(runs[r]):>8.1f} {tok_per_s(runs[r]) / base:>7.2f}x {same:>3}/{n:<2}"
            )
        for layout in plains:
            tps = tok_per_s(runs["plain " + layout])
            print(
                f"{name:<10} {'plain ' + layout:<14} {'':<18} {1.0:>8.2f} {tps:>8.1f} "
                f"{tps / base:>7.2f}x"
            )
