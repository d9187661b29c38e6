"""The cost model of speculative decoding on this machine: can a draft pay here, and from what tau?

    python cost.py                                   # the embedded target, a random DFlash2 draft of the main config
    python cost.py --draft out/smollm2-math-dflash2/export --context 400

Batch-1 speculative decoding trades one target forward per token for one per cycle:

    plain:        t_1 per token                     (one target forward of 1 token)
    speculative:  (t_B + t_draft) / tau per token   (a target forward of the B-token block, one draft
                                                     forward with its head, tau tokens committed)
    speedup = tau * t_1 / (t_B + t_draft),  so it pays from tau > (t_B + t_draft) / t_1.

On a GPU t_B is close to t_1 (the weights are read once for all B tokens). On a CPU it need not be: a
stock fp32 GEMM with more than one input row streams the weights far slower than its 1-row path, which
made t_8 about 1.7 t_1 here. With the weights in oneDNN's own layout, converted once (target.pack_linears,
generate.py's default on the CPU), t_8 came back to 1.2-1.4 t_1. This script measures both, so the numbers in README.md can be re-made.
A tree of N nodes (tree.py) costs t_{N+1}: the table runs to 32 tokens. generate.py's `auto` measures
the same costs (measured_costs) and picks a path or a tree from them (tree.choose).
"""
import argparse

import torch

import model
from common import DTYPES, bounded, run
from config import load_config
from export import load_any
from generate import crop, embed_and_head, new_cache, now
from target import load_target, pack_linears


def median_ms(fn, repeats: int, device=torch.device("cpu")) -> float:
    fn()                                                           # warm-up: first calls allocate
    times = []
    for _ in range(repeats):
        t0 = now(device)
        fn()
        times.append(now(device) - t0)
    return 1000 * sorted(times)[len(times) // 2]


@torch.no_grad()
def target_ms(target, context: int, tokens: int, repeats: int) -> float:
    """Median ms of one target forward of `tokens` new tokens after `context` cached ones (batch 1)."""
    gen, dev = torch.Generator().manual_seed(0), next(target.parameters()).device
    vocab = target.config.vocab_size
    cache = new_cache(target)
    target(input_ids=torch.randint(0, vocab, (1, context), generator=gen).to(dev), cache=cache, use_cache=True)
    block = torch.randint(0, vocab, (1, tokens), generator=gen).to(dev)

    def step():
        target(input_ids=block, cache=cache, use_cache=True)
        crop(cache, context)                                       # back to the same context every time
    return median_ms(step, repeats, dev)


@torch.no_grad()
def draft_ms(draft, target, context: int, repeats: int) -> float:
    """Median ms of one draft forward from `context` cached rows plus its unary head over the block."""
    c, p = draft.config, next(draft.parameters())
    embed, head = embed_and_head(target, draft)
    ctx = model.ContextCache()
    ctx.append(draft, torch.randn(1, context, len(c.target_layer_ids) * c.hidden_size, dtype=p.dtype, device=p.device),
               torch.arange(context, device=p.device)[None])
    anchor, pos = torch.tensor([1], device=p.device), torch.tensor([context], device=p.device)
    return median_ms(lambda: draft.unary_logits(model.forward_inference(draft, embed, ctx, anchor, pos), head),
                     repeats, p.device)


def measured_costs(target, draft, sizes, context: int = 200, repeats: int = 5):
    """This machine, now: ({n: ms of a target forward of n tokens for n in sizes}, ms of the draft's
    forward with its head), each the median of `repeats` after `context` cached tokens."""
    return ({n: target_ms(target, context, n, repeats) for n in sizes},
            draft_ms(draft, target, context, repeats))


def main(argv=None):
    ap = argparse.ArgumentParser(description="Measure the batch-1 cost model of speculative decoding.")
    ap.add_argument("--target", default=None, help="target model name or path (default: the embedded target)")
    ap.add_argument("--draft", default=None, help="a trained draft (default: random weights of --draft-config)")
    ap.add_argument("--draft-config", default="configs/smollm2-135m-dflash2.json")
    ap.add_argument("--draft-dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--context", type=bounded(int, low=1), default=200, help="cached tokens before each forward")
    ap.add_argument("--repeats", type=bounded(int, low=1), default=15)
    args = ap.parse_args(argv)

    draft = load_any(args.draft) if args.draft else model.DraftModel(load_config(args.draft_config))
    draft = draft.to(DTYPES[args.draft_dtype]).eval()
    B, sizes = draft.config.block_size, sorted({1, 4, draft.config.block_size, 16, 24, 32})
    target, _ = load_target(args.target, torch.float32)
    t_draft = draft_ms(draft, target, args.context, args.repeats)
    print(f"context {args.context} tokens, {torch.get_num_threads()} threads; draft forward + head "
          f"({args.draft_dtype}, block {B}): {t_draft:.1f} ms")
    print(f"{'fp32 target':<22}" + "".join(f"{f'{n} tok':>10}" for n in sizes) + f"{'t_B / t_1':>11}{'pays from tau':>15}")
    for name in ("stock GEMMs", "packed weights"):
        if name == "packed weights":
            pack_linears(target)
        ms = {n: target_ms(target, args.context, n, args.repeats) for n in sizes}
        print(f"{name:<22}" + "".join(f"{ms[n]:>8.1f}ms" for n in sizes) +
              f"{ms[B] / ms[1]:>11.2f}{(ms[B] + t_draft) / ms[1]:>15.2f}")

if __name__ == "__main__":
    run(main)
