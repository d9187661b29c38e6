"""Watch a DFlash / DFlash2 draft decode: the command line around decoding.py.

    python generate.py --draft drafts/smollm2-dflash2 --prompt "Why is the sky blue?" --compare
    python generate.py --draft drafts/smollm2-dflash2 --prompt "Why is the sky blue?" --show
    python generate.py --draft runs/smollm2/ckpt.pt --bench gsm8k humaneval --bench-limit 20

--compare also decodes plainly and says whether the outputs are identical (they are, at T = 0);
--show prints every cycle's block; --bench decodes prompt sets every way (speed/bench.py). Without
--prompt it is a chat. --verify-tokens k sends the first k drafts of each cycle, --tree-budget N a
tree of N nodes (tree.py); `auto`, the default, picks the shape predicted fastest here (speed/).
"""

import argparse
import sys

import torch

from common import DTYPES, add_chat_template_kwargs, bounded, run
from decoding import shape_kw, speculative_generate, target_generate
from export import load_any
from show import Printer, ShowBlocks, show_legend
from speed import bench, machine, tune
from target import check_draft_fits, encode, load_target, stop_token_ids
from tree import label


def verify_arg(text):
    """A --verify-tokens / --tree-budget value: auto, or a count >= 1."""
    return text if text == "auto" else bounded(int, low=1)(text)


def reply(target, draft, tok, messages, args, gen, stop) -> str:
    """Generate one answer, streaming it (--show: its blocks, then the text), then print the
    statistics (and the baseline with --compare)."""
    ids = encode(tok, messages, next(target.parameters()).device, args.chat_template_kwargs)
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        generator=gen,
        stop_ids=stop,
    )
    if args.show:
        watch = dict(on_cycle=ShowBlocks(tok, sys.stdout.isatty(), args.shape[0] == "tree"))
    else:
        watch = dict(on_tokens=Printer(tok))
    out, stats = speculative_generate(
        target, draft, ids, use_selector=not args.unary, **shape_kw(args.shape), **watch, **kw
    )
    if args.show:
        print(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True), end="")
    print(f"\n[{args.mode}, {label(args.shape)}] {stats.summary()}")
    if args.compare:
        base, base_stats = target_generate(target, ids, **kw)
        same = (
            "identical"
            if torch.equal(base, out)
            else "different (expected only at temperature > 0)"
        )
        print(
            f"[plain] {base_stats.summary()}\n"
            f"  speedup {stats.tok_per_s / base_stats.tok_per_s:.2f}x, output {same}"
        )
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
        help="the target's dtype; auto: bf16 on GPU, fp32 on CPU (lossless, see docs/cpu.md)",
    )
    a(
        "--draft-dtype",
        choices=["auto", *DTYPES, "int8"],
        default="auto",
        help="the draft's precision; auto: bf16 on GPU, int8 weights on x86 CPUs (speed/int8.py), "
        "else bf16 where native, else fp32 (speed/machine.py). Output is the target's either way",
    )
    a(
        "--target-gemm",
        choices=["auto", "stock", "onednn", "mkl"],
        default="auto",
        help="the target's GEMM layout (speed/gemm.py): stock, oneDNN's packed weights or MKL's "
        "packed GEMM; auto: whichever speed/cost.py measured fastest here (cached; docs/cpu.md)",
    )
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
        type=verify_arg,
        metavar="{auto,1..B-1}",
        help="verify a path: the first k of the B-1 drafts; auto: the k predicted fastest here",
    )
    a(
        "--tree-budget",
        nargs="+",
        type=verify_arg,
        metavar="{auto,N}",
        help="verify a tree of N drafted nodes in one target forward (tree.py); "
        "auto (the default): a tree or a path, whichever is predicted fastest here. --bench takes "
        "several: a row each",
    )
    a(
        "--show",
        action="store_true",
        help="print every cycle's block, in colour on a terminal, "
        "else with these markers: " + show_legend(),
    )
    args = ap.parse_args(argv)
    if args.show and args.bench:
        ap.error("--show prints the blocks of single answers; it does not go with --bench")
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
    draft, layouts, line = tune.decoding(target, draft, args)  # how to run here (speed/)
    print(line, file=sys.stderr)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    stop = stop_token_ids(target, tok)
    if args.bench:
        return bench.bench(target, draft, tok, args, gen, stop, layouts)
    args.mode = "unary" if args.unary or not draft.candidate_selector else "selector"
    args.shape = tune.verify_shapes(args, draft, args.mode, layouts)[0]
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
