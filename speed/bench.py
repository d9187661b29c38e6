"""generate.py --bench: each prompt set decoded plainly and speculatively, one row per way.

    python generate.py --draft out/smollm2-math-dflash2/export --bench gsm8k --bench-limit 16 \\
        --max-new-tokens 128 --verify-tokens 7 --tree-budget 8 16 24 32

Rows: every mode (selector, unary) times every verify shape asked (tune.choose), then plain
decoding, in each GEMM layout where `--target-gemm auto` measured them: speedups divide by the
fastest plain decoding. "same" counts answers equal to plain decoding's, token for token. Mean tau
is pooled over a set's cycles; tok/s counts new tokens over each call's wall time (prefill
included).
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
    a("--bench", nargs="+", choices=list(EVAL_SETS), help="decode these prompt sets every way")
    a("--bench-limit", type=count, help="only the first N prompts of each set")


def tok_per_s(stats) -> float:
    return sum(s.new_tokens for s in stats) / sum(s.seconds for s in stats)


def bench(target, draft, head, tok, args, gen, stop, layouts, shapes):
    """Print the table of args.bench's sets, a row per way of decoding them. head and layouts:
    tune.decoding's; shapes: tune.choose's."""
    dev, kwargs = next(target.parameters()).device, args.chat_template_kwargs
    modes = ["selector", "unary"] if draft.candidate_selector else ["unary"]
    rows = [(m, shape) for m in modes for shape in shapes]
    kw = dict(temperature=args.temperature, generator=gen, stop_ids=stop)
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
        new = args.max_new_tokens
        for w in decode_every_way(target, draft, head, prompts, warm, new, kw, layouts, rows):
            same = "" if w["same"] is None else f" {w['same']:>3}/{len(prompts):<2}"
            print(
                f"{name:<10} {w['mode']:<14} {w['verify']:<18} {w['tau']:>8.2f} "
                f"{w['tok_s']:>8.1f} {w['speedup']:>7.2f}x{same}"
            )


def decode_every_way(target, draft, head, prompts, warm, new, kw, layouts, rows) -> list:
    """Each prompt ([1, P] ids) decoded for `new` tokens plainly in each layout and speculatively
    each way of rows ((mode, verify shape)), after an untimed warm-up of each on warm. kw: the
    loops' temperature, generator, stop_ids. -> a {"mode", "verify", "tau", "tok_s", "speedup",
    "same"} per way, the rows then plain decoding: same counts answers equal to the first plain
    layout's (None for plain decoding)."""
    plains = list(layouts["table"]) if layouts["table"] else [layouts["plain"]]
    for layout in plains:  # warm-ups
        set_layout(target, layout)
        target_generate(target, warm, 8)
    set_layout(target, layouts["speculate"])
    for r in rows:
        speculate(target, draft, warm, 8, r[1], use_selector=r[0] == "selector", head=head)
    # Prompt by prompt, every way back to back: a shared machine's speed drifts over minutes, and a
    # drift must not fall on one way's whole run (plain 22.0 then 23.9 tok/s on two runs of a VM).
    runs, outs = {key: [] for key in ["plain " + layout for layout in plains] + rows}, {}
    for ids in prompts:
        for layout in plains:
            set_layout(target, layout)
            out, stats = timed(lambda: target_generate(target, ids, new, **kw), ids)
            runs["plain " + layout].append(stats)
            if layout == plains[0]:  # the reference
                outs.setdefault("plain", []).append(out)
        set_layout(target, layouts["speculate"])
        for r in rows:
            selector = r[0] == "selector"
            out, stats = speculate(
                target, draft, ids, new, r[1], use_selector=selector, head=head, **kw
            )
            runs[r].append(stats)
            outs.setdefault(r, []).append(out)
    base = max(tok_per_s(runs["plain " + layout]) for layout in plains)

    def way(mode, verify, stats, same=None):
        taus = [t for s in stats for t in s.taus] or [1.0]  # plain decoding: one token a step
        tps, tau = tok_per_s(stats), sum(taus) / len(taus)
        return dict(mode=mode, verify=verify, tau=tau, tok_s=tps, speedup=tps / base, same=same)

    same = lambda r: sum(torch.equal(a, b) for a, b in zip(outs[r], outs["plain"]))
    ways = [way(r[0], label(r[1]), runs[r], same(r)) for r in rows]
    return ways + [way("plain " + layout, "", runs["plain " + layout]) for layout in plains]
