"""Watch a DFlash / DFlash2 draft decode: the command line around decoding.py.

    python generate.py --draft drafts/smollm2-dflash2 --prompt "Why is the sky blue?" --compare
    python generate.py --draft drafts/smollm2-dflash2 --prompt "Why is the sky blue?" --show
    python generate.py --draft runs/smollm2/ckpt.pt --bench gsm8k humaneval --bench-limit 20

--compare also decodes plainly, gives the speed-up as the median of 5 runs each way, and says
whether the outputs are identical (they are, at T = 0, up to a numerics tie, which it names); --show
prints every cycle's block; --bench decodes prompt sets every way
(speed/bench.py). Without --prompt it is a chat. --verify-tokens k sends the first k drafts of each
cycle, --tree-budget N a tree of N nodes (tree.py).

By default it runs what decoding.py and model.py show: the draft as trained (fp32), the stock fp32
target, the path of B-1 drafts. --fast puts speed/'s choices for this machine in place of those
three (the int8 draft on x86, packed target GEMMs, a tree of tune.FAST_TREE nodes) and says what it
replaced.
"""

import argparse
import os
import sys
from functools import partial

import torch

from decoding import speculative_generate, target_generate
from export import load_any
from speed import bench, machine, tune
from support import show
from support.common import DTYPES, UsageError, add_chat_template_kwargs, bounded, run
from support.target import check_draft_fits, encode, load_target, stop_token_ids
from tree import tree_generate


def reply(target, draft, tok, messages, args, gen, stop) -> str:
    """One answer: the cycle decodes it, streamed as it commits (--show: each cycle's block), then
    its statistics; --compare then times plain decoding against it. support/show.py prints."""
    ids = encode(tok, messages, next(target.parameters()).device, args.chat_template_kwargs)
    n, (kind, size), B = args.max_new_tokens, args.shape, draft.config.block_size
    # decoding.py's cycle with a path of `size` drafts, or tree.py's with a tree of `size` nodes;
    # speed/'s head scores the draft's rows, if it gave one
    cycle = speculative_generate if kind == "path" else tree_generate
    kw = dict(use_selector=not args.unary, stop_ids=stop, head=machine.draft_head(draft))
    if args.compare:  # untimed greedy warm-ups, as --bench runs: a first decoding pays one-off
        cycle(target, draft, ids, 8, size, **kw)  # costs, which a short answer shows
        target_generate(target, ids, 8, stop_ids=stop)
    kw["temperature"] = args.temperature
    state = gen.get_state()  # --compare's repeats decode this answer again from here
    answer = show.Answer(tok, args, ids, B)  # the cycle's watch: prints the answer as it comes
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
    a("--target", default=None, help="target model name or path (default: the embedded target)")
    a("--draft", required=True, help="exported draft directory or training checkpoint ckpt.pt")
    a(
        "--target-dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="the target's dtype; auto: fp32 on every device, so that greedy output is plain "
        "greedy's token for token (docs/speculation.md); bf16 is faster on a GPU, and --compare "
        "names the near-ties it flips",
    )
    tune.add_flags(a)  # --fast, --draft-dtype, --target-gemm: speed/'s choices
    a("--prompt", default=None, help="one prompt; without it, an interactive chat")
    add_chat_template_kwargs(a)
    a("--max-new-tokens", type=bounded(int, low=1), default=256)
    a("--temperature", type=bounded(float, low=0.0), default=0.0, help="0: greedy")
    a("--seed", type=int, default=0)
    a("--unary", action="store_true", help="plain argmax / softmax proposals, no selector walk")
    a("--compare", action="store_true", help="also run plain target decoding and compare")
    a("--bench", nargs="+", choices=["mtbench", "humaneval", "gsm8k"], default=None)
    a("--bench-limit", type=bounded(int, low=1), default=None, help="first N prompts of each set")
    a(
        "--verify-tokens",
        nargs="+",
        type=bounded(int, low=1),
        metavar="{1..B-1}",
        help="verify a path: the first k of the B-1 drafts (default: all B-1). --bench takes "
        "several: a row each",
    )
    a(
        "--tree-budget",
        nargs="+",
        type=bounded(int, low=1),
        metavar="N",
        help="verify a tree of N drafted nodes in one target forward (tree.py); --fast's default: "
        "speed/tune.py's FAST_TREE. --bench takes several: a row each",
    )
    a(
        "--show",
        action="store_true",
        help="print every cycle's block, in colour on a terminal, "
        "else with these markers: " + show.show_legend(),
    )
    a(
        "--show-svg",
        metavar="FILE",
        default=None,
        help="also draw every cycle's block, marked as --show marks it, into an SVG picture "
        "(with --prompt)",
    )
    args = ap.parse_args(argv)
    if args.show and args.bench:
        ap.error("--show prints the blocks of single answers; it does not go with --bench")
    if args.show_svg and (args.bench or args.prompt is None):
        ap.error("--show-svg draws the blocks of one answer: give --prompt, not --bench")
    folder = os.path.dirname(os.path.abspath(args.show_svg or "."))
    if args.show_svg and not os.path.isdir(folder):  # a bad path: one line (support/common.run)
        raise UsageError(f"--show-svg {args.show_svg}: no folder {folder}")
    if not args.bench and len((args.verify_tokens or []) + (args.tree_budget or [])) > 1:
        ap.error(
            "--verify-tokens / --tree-budget: one value (several, one row each, only with --bench)"
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    draft = load_any(args.draft)  # first: a mistake in it shows before the target loads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target_dtype = machine.resolve_dtype(args.target_dtype, device, "decode")
    target, tok = load_target(args.target, target_dtype)
    target = target.to(device)
    check_draft_fits(draft.config, target)
    fast = tune.fill_defaults(args, draft.config.block_size)
    if fast:
        print(fast, file=sys.stderr)
    shapes = tune.verify_shapes(args, draft.config.block_size)  # refused before any measurement
    draft, layouts, line = tune.decoding(target, draft, args)  # how to run here (speed/)
    print(line, file=sys.stderr)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    stop = stop_token_ids(target, tok)
    if args.bench:
        return bench.bench(target, draft, tok, args, gen, stop, layouts, shapes)
    args.mode = "unary" if args.unary or not draft.candidate_selector else "selector"
    args.shape = shapes[0]
    if args.prompt is not None:
        reply(target, draft, tok, [{"role": "user", "content": args.prompt}], args, gen, stop)
        return
    messages = []
    while True:
        try:
            text = input("\n> ")
        except (EOFError, KeyboardInterrupt):
            break
        messages.append({"role": "user", "content": text})
        answer = reply(target, draft, tok, messages, args, gen, stop)
        messages.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    run(main)
