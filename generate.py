"""Lossless speculative decoding with a DFlash / DFlash2 draft, that you can watch (SPEC section 5).

    python generate.py --draft drafts/smollm2-dflash2 --prompt "Why is the sky blue?" --compare
    python generate.py --draft drafts/smollm2-dflash2 --prompt "Why is the sky blue?" --show   # every block
    python generate.py --draft runs/smollm2/ckpt.pt --bench gsm8k humaneval --bench-limit 20

One cycle: the draft proposes B-1 tokens in ONE forward from the last committed token (the anchor),
the selector walks its top-K lattice, ONE target forward verifies [anchor, d_1..d_{B-1}], the longest
agreeing prefix plus one bonus token from the target is committed, the target's KV cache is cropped
back to the committed tokens, and their target features become new draft context. Greedy output is
the target's own greedy output token for token; at temperature > 0 rejection sampling against the
proposal distribution q keeps the output distributed exactly as the target's.

--verify-tokens k sends only the first k drafts; --tree-budget N sends a tree of N nodes instead of a
path (tree.py); auto, the default, picks the one predicted fastest on this machine.
"""
import argparse
import inspect
import sys
import time
from dataclasses import dataclass, field

import torch

import int8
import machine
import model
import tree
from common import DTYPES, bounded, run
from export import load_any
from show import Printer, ShowBlocks, show_legend
from target import capture_features, check_draft_fits, load_target


# ----------------------------------------------------------------------------- small pieces
def new_cache(target):
    from transformers import DynamicCache
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()  # sliding-window layers keep their rows until crop(), so rejected ones can go
    return cache


def with_cache(target, cache) -> dict:
    """The forward's keyword arguments that read and extend cache. transformers 5.24 names it `cache`;
    5.17 (and before) `past_key_values`, and takes any other name silently into **kwargs, uncached."""
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def crop(cache, length: int):
    cache.crop(length - cache.get_seq_length())  # transformers 5: crop(-n) drops the last n rows


def probs(logits, temperature: float):
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(logits, temperature: float, generator=None) -> int:
    """One token from logits [V]: argmax at temperature 0, else from softmax(logits / T)."""
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(probs(logits, temperature), 1, generator=generator))


def commit(ids, new: list, prompt_len: int, max_new_tokens: int, stop_ids, on_tokens=None):
    """Append new tokens to ids [1, L], cut at max_new_tokens or just after a stop token -> (ids, done).
    on_tokens(list of ids), if given, sees every committed batch: that is the streaming hook."""
    room = max_new_tokens - (ids.shape[1] - prompt_len)
    new = new[:room]
    stop = next((i for i, t in enumerate(new) if t in stop_ids), None)
    if stop is not None:
        new = new[:stop + 1]
    if on_tokens:
        on_tokens(new)
    ids = torch.cat([ids, torch.tensor([new], dtype=ids.dtype, device=ids.device)], dim=1)
    return ids, stop is not None or len(new) == room


def embed_and_head(target, draft):
    """The target's frozen embedding (a function of ids) and head (a function of hidden states, h @ W^T), in
    the draft's precision: a bf16 or int8 draft (int8.py) beside an fp32 target is still lossless, since only
    the target's verify commits tokens."""
    dt = next(draft.parameters()).dtype
    embed = lambda t: target.get_input_embeddings()(t).to(dt)
    if hasattr(draft, "int8_head"):                                    # int8.quantize made it once
        return embed, draft.int8_head
    w = target.get_output_embeddings().weight.to(dt)
    return embed, lambda h: h @ w.t()


# ----------------------------------------------------------------------------- propose and accept
def propose(draft, h, u, ids, temperature=0.0, use_selector=True, generator=None):
    """The block's proposal. h [1, L, H] final draft hidden states of slots 1..L (L <= B-1), u [1, L, V]
    their unary scores, ids [1, P] committed tokens (ids[:, -1] is the anchor) -> (drafts [1, L], q [1, L, V]
    or None).

    q is the distribution each draft token was sampled from; only rejection sampling needs it.
    Tests replace this function (the `proposer` argument) to force always-right / always-wrong drafts.
    """
    selector = draft.candidate_selector
    if use_selector and selector is not None:
        d, q_k, cand = selector.propose(h, u, ids[:, -1], temperature, generator)   # q_k [1, L, K]
        q = None if temperature == 0 else torch.zeros_like(u, dtype=torch.float32).scatter_(-1, cand, q_k)
        return d, q                                      # q: the selector's K-way q, zero off the candidates
    if temperature == 0:
        return u.argmax(-1), None
    q = probs(u, temperature)                            # plain DFlash / --unary: softmax(u / T) over the vocab
    return torch.multinomial(q[0], 1, generator=generator).T, q


def accept_probability(p, q, d: int) -> float:
    """Rejection sampling accepts a draft token d ~ q with probability min(1, p(d) / q(d))."""
    return min(1.0, float(p[d] / q[d]))


def residual(p, q):
    """After a rejection the token comes from normalize(max(0, p - q))."""
    r = (p - q).clamp_min(0)
    return r / r.sum() if r.sum() > 0 else p   # r = 0 only if p == q, where rejection has probability 0


def rejection_sample(p, q, drafts, generator=None):
    """Target probabilities p [B, V], proposal q [B-1, V], drafts [B-1] -> (a, next token).

    Accept d_j while a uniform draw is below min(1, p_j(d_j) / q_j(d_j)); at the first rejection take
    the token from residual(p_j, q_j); if every draft is accepted the bonus comes from the last row.
    Each committed token is then distributed exactly as p (Leviathan et al. 2023; Chen et al. 2023).
    """
    for j, d in enumerate(drafts.tolist()):
        if float(torch.rand((), generator=generator, device=p.device)) >= accept_probability(p[j], q[j], d):
            return j, int(torch.multinomial(residual(p[j], q[j]), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))


# ----------------------------------------------------------------------------- the two decoding loops
@torch.no_grad()
def speculative_generate(target, draft, prompt_ids, max_new_tokens, temperature=0.0, use_selector=True,
                         generator=None, stop_ids=(), on_tokens=None, proposer=propose, on_cycle=None,
                         verify_tokens=None, tree_budget=None, grower=tree.draft_tree, head_rows=None):
    """prompt_ids [1, P] -> (ids [1, P + n], Stats); n = max_new_tokens unless a stop token came first.
    Each cycle verifies the path of verify_tokens drafts (default B-1), or with tree_budget a tree of that
    many nodes (tree.py). on_cycle(drafts, unary argmax, accepted, bonus, tree=None), if given, sees every
    cycle (--show); for a tree, drafts are its nodes and tree is (the Tree, the accepted nodes).
    head_rows {L: r} (cost.head_rows): how many block rows the head scores to cover slots 1..L; default L + 1."""
    c, dev, P = draft.config, prompt_ids.device, prompt_ids.shape[1]
    k = verify_tokens or c.block_size - 1
    L = k if tree_budget is None else min(tree_budget, c.block_size - 1)   # the deepest slot this cycle can send
    scored = head_rows[L] if head_rows else L + 1                          # rows 0..scored-1, scored > L
    embed, head = embed_and_head(target, draft)
    start, clock, taus = now(dev), PhaseClock(dev), []
    # Prefill: the target's cache and features for the prompt; the first new token from its last logit.
    cache, ctx = new_cache(target), model.ContextCache()
    out, feats = capture_features(target, c.target_layer_ids, input_ids=prompt_ids, logits_to_keep=1,
                                  **with_cache(target, cache))
    crop(cache, P)
    ctx.append(draft, feats, torch.arange(P, device=dev)[None])         # draft context: positions 0..P-1
    first = sample(out.logits[0, -1], temperature, generator)
    ids, done = commit(prompt_ids, [first], P, max_new_tokens, stop_ids, on_tokens)
    while not done:
        s = ids.shape[1] - 1       # the anchor's position: last committed token, not yet run by the target
        clock.start()
        h = model.forward_inference(draft, embed, ctx, ids[:, -1], torch.tensor([s], device=dev))  # [1, B, H]
        # Slots beyond L are never sent, and the head over the vocabulary is most of the draft's cost: it
        # scores the fewest rows from 0 (the anchor) that cover slot L, or more where more cost less here.
        u = draft.unary_logits(h[:, :scored], head)[:, 1:L + 1]   # [1, L, V]
        clock.lap("draft")
        if tree_budget is None:    # a path: the first k drafts of the walk (q: what they were sampled from)
            d, q = proposer(draft, h[:, 1:L + 1], u, ids, temperature, use_selector, generator)   # [1, L]
            t, q = tree.Tree.chain(int(ids[0, -1]), d[0, :k].tolist()), None if q is None else q[:, :k]
        else:                      # a tree, built deterministically from the draft's scores
            t, q = grower(draft, h[:, 1:L + 1], u, ids, tree_budget, use_selector), None
        clock.lap("selector")
        # One target forward over the block [anchor, nodes...]; a path's ancestor mask is the causal one.
        n, tree_kw = len(t.tokens), {} if t.is_chain() else dict(position_ids=s + torch.tensor([t.depths], device=dev),
                                                                 attention_mask=tree.attention_masks(t, cache, target.dtype))
        out, feats = capture_features(target, c.target_layer_ids, input_ids=torch.tensor([t.tokens], device=dev),
                                      **with_cache(target, cache), **tree_kw)
        if q is not None:          # sampled drafts: rejection sampling against q, as ever
            a, nxt = rejection_sample(probs(out.logits[0], temperature), q[0], d[0, :k], generator)
            path = list(range(1, a + 1))
        else:                      # follow the target's own token (argmax, or sampled from p) through the tree
            path, nxt = tree.walk(t, out.logits[0], lambda row: sample(row, temperature, generator))
        rows = [0] + path          # the anchor and the accepted nodes: only their KV rows stay, in this order
        if rows != list(range(len(rows))):
            tree.keep_rows(cache, n, rows)
        crop(cache, s + len(rows)) # the new token enters with the next block
        clock.lap("verify")
        # The verify pass already computed the features of the anchor and the accepted drafts: new context.
        ctx.append(draft, feats[:, rows], torch.arange(s, s + len(rows), device=dev)[None])
        clock.lap("draft")
        if on_cycle:
            best = u[0].argmax(-1).tolist()                             # the unary argmax of each node's slot
            on_cycle(t.tokens[1:], [best[i - 1] for i in t.depths[1:]], len(path), nxt,
                     **({} if tree_budget is None else dict(tree=(t, path))))
        ids, done = commit(ids, [t.tokens[i] for i in path] + [nxt], P, max_new_tokens, stop_ids, on_tokens)
        taus.append(len(path) + 1)
    return ids, Stats.of(ids.shape[1] - P, now(dev) - start, taus, c.block_size, clock)


@torch.no_grad()
def target_generate(target, prompt_ids, max_new_tokens, temperature=0.0, generator=None, stop_ids=(),
                    on_tokens=None):
    """Plain decoding, one target forward per token, same cache and sampling: the baseline."""
    dev, P = prompt_ids.device, prompt_ids.shape[1]
    start, cache = now(dev), new_cache(target)
    logits = target(input_ids=prompt_ids, logits_to_keep=1, **with_cache(target, cache)).logits[0, -1]
    ids, done = commit(prompt_ids, [sample(logits, temperature, generator)], P, max_new_tokens, stop_ids, on_tokens)
    while not done:
        crop(cache, ids.shape[1] - 1)   # a no-op that also trims sliding-window layers
        logits = target(input_ids=ids[:, -1:], **with_cache(target, cache)).logits[0, -1]
        ids, done = commit(ids, [sample(logits, temperature, generator)], P, max_new_tokens, stop_ids, on_tokens)
    return ids, Stats(new_tokens=ids.shape[1] - P, seconds=now(dev) - start)


# ----------------------------------------------------------------------------- statistics and timing
@dataclass
class Stats:
    new_tokens: int = 0
    seconds: float = 0.0                          # wall clock of the whole call, prefill included
    taus: list = field(default_factory=list)      # acceptance length per cycle: accepted drafts + 1, in 1..B
    accepted_at: list = None                      # [j-1]: in how many cycles draft slot j was accepted
    draft_s: float = 0.0                          # wall clock per phase, summed over the cycles
    select_s: float = 0.0
    verify_s: float = 0.0

    @property
    def mean_tau(self):
        return sum(self.taus) / len(self.taus) if self.taus else float("nan")

    @property
    def tok_per_s(self):
        return self.new_tokens / self.seconds if self.seconds else float("nan")

    @classmethod
    def of(cls, new_tokens, seconds, taus, block_size, clock):
        """A speculative call's statistics, from its acceptance lengths and its phase clock."""
        accepted_at = [sum(t > j for t in taus) for j in range(1, block_size)]   # slot j accepted iff tau > j
        return cls(new_tokens, seconds, taus, accepted_at, clock.seconds["draft"], clock.seconds["selector"],
                   clock.seconds["verify"])

    def summary(self) -> str:
        s = f"{self.new_tokens} tokens in {self.seconds:.2f} s, {self.tok_per_s:.1f} tok/s"
        if not self.taus:
            return s
        n, phases = len(self.taus), self.draft_s + self.select_s + self.verify_s
        rate = " ".join(f"{k / n:.2f}" for k in self.accepted_at)
        split = " / ".join(f"{name} {100 * t / phases:.0f}%" for name, t in
                           (("draft", self.draft_s), ("selector", self.select_s), ("verify", self.verify_s)))
        return (f"{s}; {n} cycles, mean acceptance length {self.mean_tau:.2f}\n"
                f"  acceptance rate by block position 1..{len(self.accepted_at)}: {rate}\n"
                f"  cycle time (wall clock per phase): {split}")


class PhaseClock:
    """Wall clock per phase of a cycle, summed over the cycles: start() as a cycle begins, lap(phase) as
    each phase ends adds the time since the last mark to that phase."""

    def __init__(self, device):
        self.device, self.seconds, self.last = device, {"draft": 0.0, "selector": 0.0, "verify": 0.0}, 0.0

    def start(self):
        self.last = now(self.device)

    def lap(self, phase: str):
        t = now(self.device)
        self.seconds[phase] += t - self.last
        self.last = t


def now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()  # CUDA runs asynchronously: time the work, not the kernel launches
    return time.perf_counter()


# ----------------------------------------------------------------------------- command line
def draft_in(precision: str, draft, target, device):
    """The draft on the device in machine.draft_precision's choice: a DTYPES name, or int8 weights on fp32."""
    draft = draft.to(device=device, dtype=DTYPES.get(precision, torch.float32))
    return int8.quantize(draft, target.get_output_embeddings().weight) if precision == "int8" else draft


def encode(tok, messages, device):
    """A conversation -> prompt ids [1, P] through the target's chat template (plain text without one)."""
    if tok.chat_template:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n".join(m["content"] for m in messages)
    return tok(text, return_tensors="pt", add_special_tokens=not tok.chat_template).input_ids.to(device)


def stop_token_ids(target, tok) -> set:
    ids = set()
    for e in (tok.eos_token_id, getattr(target.generation_config, "eos_token_id", None)):
        ids |= set(e) if isinstance(e, (list, tuple)) else ({e} if e is not None else set())
    return ids


def verify_arg(text):
    """A --verify-tokens / --tree-budget value: auto, or a count >= 1."""
    return text if text == "auto" else bounded(int, low=1)(text)


def shape_kw(shape) -> dict:
    return dict(verify_tokens=shape[1]) if shape[0] == "path" else dict(tree_budget=shape[1])


def reply(target, draft, tok, messages, args, gen, stop) -> str:
    """Generate one answer, streaming it (--show: its blocks, then the text), then print the statistics
    (and the baseline with --compare)."""
    ids = encode(tok, messages, next(target.parameters()).device)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, generator=gen, stop_ids=stop)
    watch = dict(on_cycle=ShowBlocks(tok, sys.stdout.isatty(), args.shape[0] == "tree")) if args.show else \
        dict(on_tokens=Printer(tok))
    out, stats = speculative_generate(target, draft, ids, use_selector=not args.unary, **shape_kw(args.shape),
                                      head_rows=args.head_rows,
                                      **watch, **kw)
    if args.show:
        print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), end="")
    mode = "unary" if args.unary or not draft.candidate_selector else "selector"
    print(f"\n[{mode}, {tree.label(args.shape)}] {stats.summary()}")
    if args.compare:
        base, base_stats = target_generate(target, ids, **kw)
        same = "identical" if torch.equal(base, out) else "different (expected only at temperature > 0)"
        print(f"[plain] {base_stats.summary()}\n  speedup {stats.tok_per_s / base_stats.tok_per_s:.2f}x, output {same}")
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Speculative decoding with a DFlash / DFlash2 draft.")
    ap.add_argument("--target", default=None, help="target model name or path (default: the embedded target)")
    ap.add_argument("--draft", required=True, help="exported draft directory or training checkpoint ckpt.pt")
    ap.add_argument("--target-dtype", choices=["auto", *DTYPES], default="auto",
                    help="the target's dtype; auto: bf16 on GPU, fp32 on CPU (lossless, see README)")
    ap.add_argument("--draft-dtype", choices=["auto", *DTYPES, "int8"], default="auto",
                    help="the draft's precision; auto: bf16 on GPU, int8 weights on x86 CPUs (int8.py), else bf16 "
                         "where native, else fp32 (machine.py). Output is the target's either way")
    ap.add_argument("--target-gemm", choices=["auto", "stock", "onednn", "mkl"], default="auto",
                    help="the target's GEMM layout (target.py): stock, oneDNN's packed weights or MKL's packed GEMM; "
                         "auto: whichever cost.py measured fastest on this machine (cached); README, Your machine")
    ap.add_argument("--prompt", default=None, help="one prompt; without it, an interactive chat")
    ap.add_argument("--max-new-tokens", type=bounded(int, low=1), default=256)
    ap.add_argument("--temperature", type=bounded(float, low=0.0), default=0.0, help="0: greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--unary", action="store_true", help="plain argmax / softmax proposals, no selector walk")
    ap.add_argument("--compare", action="store_true", help="also run plain target decoding and compare")
    ap.add_argument("--bench", nargs="+", choices=["mtbench", "humaneval", "gsm8k"], default=None)
    ap.add_argument("--bench-limit", type=bounded(int, low=1), default=None, help="first N prompts of each set")
    ap.add_argument("--verify-tokens", nargs="+", type=verify_arg, metavar="{auto,1..B-1}",
                    help="verify a path: the first k of the B-1 drafts; auto: the k predicted fastest here")
    ap.add_argument("--tree-budget", nargs="+", type=verify_arg, metavar="{auto,N}",
                    help="verify a tree of N drafted nodes in one target forward (tree.py); auto (the default): "
                         "a tree or a path, whichever is predicted fastest here. --bench takes several: a row each")
    ap.add_argument("--show", action="store_true", help="print every cycle's block, in colour on a terminal, "
                    "else with these markers: " + show_legend())
    args = ap.parse_args(argv)
    if args.show and args.bench:
        ap.error("--show prints the blocks of single answers; it does not go with --bench")
    if not args.bench and len((args.verify_tokens or []) + (args.tree_budget or [])) > 1:
        ap.error("--verify-tokens / --tree-budget: one value (several, one row each, only with --bench)")

    draft = load_any(args.draft)            # first: a mistake in it shows before the target loads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target_dtype = machine.resolve_dtype(args.target_dtype, device, "decode")
    target, tok = load_target(args.target, target_dtype)
    target = target.to(device)
    check_draft_fits(draft.config, target)
    precision = machine.draft_precision(args.draft_dtype, device)
    draft = draft_in(precision, draft, target, device)
    import cost   # here, not at the top: cost.py imports this module's cache helpers
    layouts = cost.decoding_layouts(target, draft, args.target_gemm)
    print(machine.choice_line(machine.describe(device), target=f"{machine.dtype_name(target_dtype)}, {layouts['why']}",
                              draft=precision), file=sys.stderr)
    param = next(target.parameters())
    gen = torch.Generator(device=param.device).manual_seed(args.seed)
    stop = stop_token_ids(target, tok)
    if args.bench:
        import bench     # the benchmark rows: only --bench needs them
        return bench.bench(target, draft, tok, args, gen, stop, layouts)
    mode = "unary" if args.unary or not draft.candidate_selector else "selector"
    args.shape = tree.plan(args.verify_tokens, args.tree_budget, draft, args.draft, mode, layouts["costs"])[0]
    args.head_rows = layouts["head_rows"]
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
        messages.append({"role": "assistant", "content": reply(target, draft, tok, messages, args, gen, stop)})


if __name__ == "__main__":
    run(main)
