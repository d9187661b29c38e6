"""Watch a DFlash / DFlash2 draft decode: the command line around decoding.py.

    python generate.py --draft drafts/smollm2-dflash2 --prompt "Why is the sky blue?" --compare
    python generate.py --draft drafts/smollm2-dflash2 --prompt "Why is the sky blue?" --show
    python generate.py --draft runs/smollm2/ckpt.pt --bench gsm8k humaneval --bench-limit 20

Without --prompt it is a chat. What it prints is support/show.py's; --bench decodes prompt sets
every way (speed/bench.py). By default it runs what decoding.py and model.py show: the draft as
trained (fp32), the stock fp32 target, the path of B-1 drafts; --fast puts speed/'s choices for
this machine in their place (the int8 draft on x86, packed target GEMMs, a tree of
tune.FAST_TREE nodes) and says what it replaced.
"""

import argparse
import sys
from functools import partial

import torch

from decoding import draft_proposal, speculative_generate, target_generate
from export import load_any
from selector import WALKS
from speed import bench, machine, tune
from support import distributed, show
from support.common import add_chat_template_kwargs, add_target_flags, count, nonneg, run
from support.target import check_draft_fits, encode, load_target, stop_token_ids
from tree import tree_generate


def reply(target, draft, tok, messages, args, gen, stop, *, mode, shape, head) -> str:
    """One answer, streamed as it commits (support/show.py prints), then its statistics; --compare
    times plain decoding against it. mode: "selector" or "unary"; shape: ("path", k drafts) or
    ("tree", N nodes); head: what scores the draft's rows (the target's head, or speed/'s)."""
    ids = encode(tok, messages, next(target.parameters()).device, args.chat_template_kwargs)
    n, (kind, size), B = args.max_new_tokens, shape, draft.config.block_size
    # decoding.py's cycle with a path of `size` drafts, or tree.py's with a tree of `size` nodes
    cycle = speculative_generate if kind == "path" else tree_generate
    kw = dict(use_selector=not args.unary, stop_ids=stop, head=head)
    if kind == "path":  # step 2 walks the selector's lattice the way --walk names
        kw["propose"] = partial(draft_proposal, walk=args.walk)
    if args.compare:  # untimed greedy warm-ups, as --bench runs: a first decoding pays one-off
        cycle(target, draft, ids, 8, size, **kw)  # costs, which a short answer shows
        target_generate(target, ids, 8, stop_ids=stop)
    kw["temperature"] = args.temperature
    state = gen.get_state()  # --compare's repeats decode this answer again from here
    # the cycle's watch: prints the answer as it comes
    answer = show.Answer(tok, ids, B, mode, shape, args.show, args.show_svg)
    out, taus = cycle(target, draft, ids, n, size, generator=gen, watch=answer, **kw)
    answer.report(out, taus, messages)
    if args.compare:  # each way again, as functions of their generator
        spec = partial(cycle, target, draft, ids, n, size, **kw)
        plain = partial(target_generate, target, ids, n, args.temperature, stop_ids=stop)
        print(show.versus_plain(target, ids, out, spec, plain, gen, state, args.temperature, B))
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Speculative decoding with a DFlash / DFlash2 draft.")
    a = ap.add_argument
    add_target_flags(a, auto="fp32, where greedy is exact")
    a("--draft", required=True, help="exported draft directory or training checkpoint ckpt.pt")
    tune.add_flags(a)  # --fast, --draft-dtype, --target-gemm: speed/'s choices
    a("--prompt", default=None, help="one prompt; without it, an interactive chat")
    add_chat_template_kwargs(a)
    a("--max-new-tokens", type=count, default=256, help="the answer's length at most")
    a("--temperature", type=nonneg, default=0.0, help="0: greedy")
    a("--seed", type=int, default=0, help="the seed of sampling at temperature > 0")
    a("--unary", action="store_true", help="plain argmax / softmax proposals, no selector walk")
    a("--walk", choices=list(WALKS), default="sequential", help="how the selector walks (path)")
    sizes = dict(nargs="+", type=count)  # several only with --bench: a row each
    a("--verify-tokens", **sizes, metavar="K", help="verify the first K drafts of each cycle's B-1")
    a("--tree-budget", **sizes, metavar="N", help="verify a tree of N drafted nodes (tree.py)")
    show.add_flags(a)  # --show, --show-svg, --compare: what it prints
    bench.add_flags(a)  # --bench, --bench-limit: prompt sets decoded every way
    args = ap.parse_args(argv)
    if args.walk != "sequential" and (args.tree_budget or args.fast or args.bench or args.unary):
        ap.error("--walk: a path of selector drafts (no --tree-budget, --fast, --bench, --unary)")
    show.check_flags(args, ap.error)
    if not args.bench and len((args.verify_tokens or []) + (args.tree_budget or [])) > 1:
        ap.error("--verify-tokens / --tree-budget: several values (a row each) only with --bench")
    return args


def main(argv=None):
    args = parse_args(argv)
    draft = load_any(args.draft)  # first: a mistake in it shows before the target loads
    device = distributed.rank_device()
    target_dtype = machine.resolve_dtype(args.target_dtype, device, "decode")
    target, tok = load_target(args.target, target_dtype)
    target = target.to(device)
    check_draft_fits(draft.config, target)
    # what the flags ask, --fast's choices in place of the defaults: the reading path's otherwise
    draft_dtype, target_gemm, shapes, fast = tune.choose(args, draft.config.block_size)
    if fast:
        print(fast, file=sys.stderr)
    # how to run here (speed/): head, what scores the draft's rows (None: the target's head)
    draft, head, layouts, line = tune.decoding(target, draft, draft_dtype, target_gemm)
    print(line, file=sys.stderr)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    stop = stop_token_ids(target, tok)
    if args.bench:
        return bench.bench(target, draft, head, tok, args, gen, stop, layouts, shapes)
    mode = "unary" if args.unary or not draft.candidate_selector else "selector"
    how = dict(mode=mode, shape=shapes[0], head=head)
    if args.prompt is not None:
        messages = [{"role": "user", "content": args.prompt}]
        reply(target, draft, tok, messages, args, gen, stop, **how)
        return
    messages = []
    while True:
        try:
            text = input("\n> ")
        except (EOFError, KeyboardInterrupt):
            break
        messages.append({"role": "user", "content": text})
        answer = reply(target, draft, tok, messages, args, gen, stop, **how)
        messages.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    run(main)
