"""Lossless speculative decoding with a DFlash / DFlash2 draft: the cycle.
(docs/semantics.md, section 5)

One cycle: the draft proposes B-1 tokens in ONE forward from the last committed token (the anchor),
the selector walks its top-K lattice, ONE target forward verifies [anchor, d_1..d_{B-1}], the
longest agreeing prefix plus one bonus token from the target is committed, the target's KV cache is
cropped back to the committed tokens, and their target features become new draft context. Greedy
output is the target's own greedy output token for token; at temperature > 0 rejection sampling
against the proposal distribution q keeps the output distributed exactly as the target's.

verify_tokens=k sends only the first k drafts; tree_budget=N sends a tree of N nodes instead of a
path (tree.py). generate.py is the command line around these functions.
"""

import time
from dataclasses import dataclass, field

import torch

import model
import tree
from target import capture_features, crop, new_cache, with_cache


# -------------------------------------------------------------------------- sampling and committing
def probs(logits, temperature: float):
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(logits, temperature: float, generator=None) -> int:
    """One token from logits [V]: argmax at temperature 0, else from softmax(logits / T)."""
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(probs(logits, temperature), 1, generator=generator))


def commit(ids, new: list, prompt_len: int, max_new_tokens: int, stop_ids, on_tokens=None):
    """Append new tokens to ids [1, L], cut at max_new_tokens or just after a stop token -> (ids,
    done). on_tokens(list of ids), if given, sees every committed batch: that is the streaming
    hook."""
    room = max_new_tokens - (ids.shape[1] - prompt_len)
    new = new[:room]
    stop = next((i for i, t in enumerate(new) if t in stop_ids), None)
    if stop is not None:
        new = new[: stop + 1]
    if on_tokens:
        on_tokens(new)
    ids = torch.cat([ids, torch.tensor([new], dtype=ids.dtype, device=ids.device)], dim=1)
    return ids, stop is not None or len(new) == room


def embed_and_head(target, draft):
    """The target's frozen embedding (a function of ids) and head (a function of hidden states,
    h @ W^T), in the draft's precision: a bf16 draft beside an fp32 target is still lossless, since
    only the target's verify commits tokens. A draft tuned for this machine (speed/tune.py) brings a
    head of its own, `draft.fast_head` (int8 weights, or more rows scored where more cost less):
    the same rows come out."""
    dt = next(draft.parameters()).dtype
    embed = lambda ids: target.get_input_embeddings()(ids).to(dt)  # noqa: E731
    if getattr(draft, "fast_head", None) is not None:
        return embed, draft.fast_head
    w = target.get_output_embeddings().weight.to(dt)  # [V, H]
    return embed, lambda h: h @ w.t()  # noqa: E731


# ----------------------------------------------------------------------------- propose and accept
def propose(draft, h, u, ids, temperature=0.0, use_selector=True, generator=None):
    """The block's proposal -> (drafts [1, L], q [1, L, V] or None).
    h [1, L, H]: final draft hidden states of slots 1..L (L <= B-1); u [1, L, V]: their unary
    scores; ids [1, P]: the committed tokens (ids[:, -1] is the anchor).

    q is the distribution each draft token was sampled from; only rejection sampling needs it.
    """
    selector = draft.candidate_selector
    if use_selector and selector is not None:
        d, q_k, cand = selector.propose(h, u, ids[:, -1], temperature, generator)  # q_k [1, L, K]
        if temperature == 0:
            return d, None
        # q: the selector's K-way q, zero off the candidates
        return d, torch.zeros_like(u, dtype=torch.float32).scatter_(-1, cand, q_k)
    if temperature == 0:
        return u.argmax(-1), None
    # plain DFlash / --unary: softmax(u / T) over the vocab
    q = probs(u, temperature)
    return torch.multinomial(q[0], 1, generator=generator).T, q


def accept_probability(p, q, d: int) -> float:
    """Rejection sampling accepts a draft token d ~ q with probability min(1, p(d) / q(d))."""
    return min(1.0, float(p[d] / q[d]))


def residual(p, q):
    """After a rejection the token comes from normalize(max(0, p - q))."""
    r = (p - q).clamp_min(0)
    # r = 0 only if p == q, where rejection has probability 0
    return r / r.sum() if r.sum() > 0 else p


def rejection_sample(p, q, drafts, generator=None):
    """Target probabilities p [B, V], proposal q [B-1, V], drafts [B-1] -> (a, next token).

    Accept d_j while a uniform draw is below min(1, p_j(d_j) / q_j(d_j)); at the first rejection
    take the token from residual(p_j, q_j); if every draft is accepted the bonus comes from the last
    row. Each committed token is then distributed exactly as p (Leviathan et al. 2023; Chen et al.
    2023).
    """
    for j, d in enumerate(drafts.tolist()):
        if float(torch.rand((), generator=generator, device=p.device)) >= accept_probability(
            p[j], q[j], d
        ):
            return j, int(torch.multinomial(residual(p[j], q[j]), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))


# --------------------------------------------------------------------------- the two decoding loops
def target_forward(target, cache, layer_ids, ids, **kw):
    """The target over ids [1, n] after the cached rows, which it extends by n -> (logits [n', V],
    features [1, n, k*H] at the draft's layer ids); n' = n unless kw keeps fewer logits."""
    out, feats = capture_features(
        target, layer_ids, input_ids=ids, **with_cache(target, cache), **kw
    )
    return out.logits[0], feats


@torch.no_grad()
def speculative_generate(
    target,
    draft,
    prompt_ids,
    max_new_tokens,
    temperature=0.0,
    use_selector=True,
    generator=None,
    stop_ids=(),
    verify_tokens=None,
    tree_budget=None,
    on_tokens=None,
    on_cycle=None,
):
    """prompt_ids [1, P] -> (ids [1, P + n], Stats); n = max_new_tokens unless a stop token came
    first. Each cycle verifies a path of verify_tokens drafts (default B-1) or, with tree_budget, a
    tree of that many nodes (tree.py). on_tokens(new ids) sees every committed batch (streaming);
    on_cycle(drafts, unary argmax, accepted, bonus, tree=None) sees every cycle (--show)."""
    c, dev, P = draft.config, prompt_ids.device, prompt_ids.shape[1]
    k = verify_tokens or c.block_size - 1
    L = k if tree_budget is None else min(tree_budget, c.block_size - 1)  # deepest slot sent
    embed, head = embed_and_head(target, draft)
    start, clock, taus = now(dev), PhaseClock(dev), []
    # Prefill: the target's cache and features for the prompt; its last logit gives the first token.
    cache, ctx = new_cache(target), model.ContextCache()
    logits, feats = target_forward(target, cache, c.target_layer_ids, prompt_ids, logits_to_keep=1)
    crop(cache, P)
    ctx.append(draft, feats, torch.arange(P, device=dev)[None])  # draft context: positions 0..P-1
    first = sample(logits[-1], temperature, generator)
    ids, done = commit(prompt_ids, [first], P, max_new_tokens, stop_ids, on_tokens)
    while not done:
        s = ids.shape[1] - 1  # the anchor: the last committed token, not yet run by the target
        clock.start()
        # 1. Draft: ONE forward of [anchor, MASK x (B-1)] at positions s..s+B-1, reading ctx.
        h = model.forward_inference(draft, embed, ctx, ids[:, -1], torch.tensor([s], device=dev))
        u = draft.unary_logits(h[:, : L + 1], head)[:, 1:]  # [1, L, V]: slots 1..L
        clock.lap("draft")
        # 2. Propose: a path (the selector's walk or the unary argmax, first k), or a tree.
        if tree_budget is None:
            d, q = propose(draft, h[:, 1 : L + 1], u, ids, temperature, use_selector, generator)
            t = tree.Tree.chain(int(ids[0, -1]), d[0, :k].tolist())
            q = None if q is None else q[:, :k]  # what each draft was sampled from
        else:  # built deterministically from the draft's scores
            t, q = tree.draft_tree(draft, h[:, 1 : L + 1], u, ids, tree_budget, use_selector), None
        clock.lap("selector")
        # 3. Verify: ONE target forward over [anchor, nodes...]. Node i sits at s + depth_i and
        #    sees its ancestors only (a path's ancestor mask is the causal one).
        tree_kw = {}
        if not t.is_chain():
            masks = tree.attention_masks(t, cache, target.dtype)
            tree_kw = dict(
                position_ids=s + torch.tensor([t.depths], device=dev), attention_mask=masks
            )
        block = torch.tensor([t.tokens], device=dev)
        logits, feats = target_forward(target, cache, c.target_layer_ids, block, **tree_kw)
        # 4. Accept the longest prefix the target agrees with, plus a token of its own (the bonus).
        if q is not None:  # sampled drafts: accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
            a, nxt = rejection_sample(probs(logits, temperature), q[0], d[0, :k], generator)
            path = list(range(1, a + 1))
        else:  # follow the target's own token (argmax, or a sample from p) through the tree
            path, nxt = tree.walk(t, logits, lambda row: sample(row, temperature, generator))
        rows = [0] + path  # the anchor and the accepted nodes: only their KV rows stay, in order
        if rows != list(range(len(rows))):
            tree.keep_rows(cache, len(t.tokens), rows)
        crop(cache, s + len(rows))  # the bonus token enters with the next block
        clock.lap("verify")
        # 5. The verify computed the kept rows' features already: they become draft context.
        ctx.append(draft, feats[:, rows], torch.arange(s, s + len(rows), device=dev)[None])
        clock.lap("draft")
        if on_cycle:
            best = u[0].argmax(-1).tolist()  # the unary argmax of each node's slot
            seen = dict(tree=(t, path)) if tree_budget else {}  # for a tree: it, and the path taken
            on_cycle(t.tokens[1:], [best[i - 1] for i in t.depths[1:]], len(path), nxt, **seen)
        new = [t.tokens[i] for i in path] + [nxt]
        ids, done = commit(ids, new, P, max_new_tokens, stop_ids, on_tokens)
        taus.append(len(path) + 1)
    return ids, Stats.of(ids.shape[1] - P, now(dev) - start, taus, c.block_size, clock)


@torch.no_grad()
def target_generate(
    target, prompt_ids, max_new_tokens, temperature=0.0, generator=None, stop_ids=(), on_tokens=None
):
    """Plain decoding, one target forward per token, same cache and sampling: the baseline."""
    dev, P = prompt_ids.device, prompt_ids.shape[1]
    start, cache = now(dev), new_cache(target)
    logits = target(input_ids=prompt_ids, logits_to_keep=1, **with_cache(target, cache)).logits
    token = sample(logits[0, -1], temperature, generator)
    ids, done = commit(prompt_ids, [token], P, max_new_tokens, stop_ids, on_tokens)
    while not done:
        crop(cache, ids.shape[1] - 1)  # a no-op that also trims sliding-window layers
        logits = target(input_ids=ids[:, -1:], **with_cache(target, cache)).logits
        token = sample(logits[0, -1], temperature, generator)
        ids, done = commit(ids, [token], P, max_new_tokens, stop_ids, on_tokens)
    return ids, Stats(new_tokens=ids.shape[1] - P, seconds=now(dev) - start)


def shape_kw(shape) -> dict:
    """A verify shape, ("path", k) or ("tree", n), as speculative_generate's keyword argument."""
    return dict(verify_tokens=shape[1]) if shape[0] == "path" else dict(tree_budget=shape[1])


# ---------------------------------------------------------------------------- statistics and timing
@dataclass
class Stats:
    new_tokens: int = 0
    seconds: float = 0.0  # wall clock of the whole call, prefill included
    # acceptance length per cycle: accepted drafts + 1, in 1..B
    taus: list = field(default_factory=list)
    # [j-1]: in how many cycles draft slot j was accepted
    accepted_at: list = None
    draft_s: float = 0.0  # wall clock per phase, summed over the cycles
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
        # slot j accepted iff tau > j
        accepted_at = [sum(t > j for t in taus) for j in range(1, block_size)]
        return cls(
            new_tokens,
            seconds,
            taus,
            accepted_at,
            clock.seconds["draft"],
            clock.seconds["selector"],
            clock.seconds["verify"],
        )

    def summary(self) -> str:
        s = f"{self.new_tokens} tokens in {self.seconds:.2f} s, {self.tok_per_s:.1f} tok/s"
        if not self.taus:
            return s
        n, phases = len(self.taus), self.draft_s + self.select_s + self.verify_s
        rate = " ".join(f"{k / n:.2f}" for k in self.accepted_at)
        split = " / ".join(
            f"{name} {100 * t / phases:.0f}%"
            for name, t in (
                ("draft", self.draft_s),
                ("selector", self.select_s),
                ("verify", self.verify_s),
            )
        )
        return (
            f"{s}; {n} cycles, mean acceptance length {self.mean_tau:.2f}\n"
            f"  acceptance rate by block position 1..{len(self.accepted_at)}: {rate}\n"
            f"  cycle time (wall clock per phase): {split}"
        )


class PhaseClock:
    """Wall clock per phase of a cycle, summed over the cycles: start() as a cycle begins,
    lap(phase) as each phase ends adds the time since the last mark to that phase."""

    def __init__(self, device):
        self.device, self.seconds, self.last = (
            device,
            {"draft": 0.0, "selector": 0.0, "verify": 0.0},
            0.0,
        )

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
