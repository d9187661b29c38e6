"""Lossless speculative decoding with a DFlash / DFlash2 draft: the cycle (docs/semantics.md, 5).

One cycle: the draft proposes B-1 tokens in ONE forward from the last committed token (the anchor),
the selector walks its top-K lattice, ONE target forward verifies [anchor, d_1..d_{B-1}], the
longest agreeing prefix plus one bonus token from the target is committed, the target's KV cache is
cropped back to the committed tokens, and their target features become new draft context. Greedy
output is the target's own greedy output token for token; at temperature > 0 rejection sampling
against the proposal distribution q keeps the output distributed exactly as the target's.

speculative_generate is that cycle for a path of k drafts (k = B-1 by default); tree.py runs the
same steps on a tree of N nodes. Neither holds a clock or prints: they return the ids and each
cycle's tau, and call watch(phase, **made) as each phase ends (generate.py --show prints them):

    phase     fires after                              made
    prefill   the prompt's forward and first token     ids [1, P+1]: the committed tokens
    draft     step 1, the draft's block forward        u [1, L, V]: unary scores of slots 1..L
    proposal  step 2, the walk (tree.py: the tree)     drafts [1, k]; tree.py: tree (a Tree)
    verify    steps 3-5: target forward, accept, crop  accepted, bonus; tree.py: path (nodes), bonus
    commit    step 6, the tokens committed             ids [1, P+n]: all committed so far
"""

import inspect

import torch
from transformers import DynamicCache

import model
from model import capture_features


# --------------------------------------------------------------------------------------- the cycle
@torch.no_grad()
def speculative_generate(
    target,
    draft,
    prompt_ids,
    max_new_tokens,
    verify_tokens=None,
    *,
    use_selector=True,
    temperature=0.0,
    generator=None,
    stop_ids=(),
    head=None,
    propose=None,
    watch=None,
):
    """prompt_ids [1, P] -> (ids [1, P + n], taus: accepted drafts + 1 per cycle); n =
    max_new_tokens unless a stop token came first. Each cycle verifies the first verify_tokens of
    the B-1 drafts (default all). head: what scores the draft's rows (default: the target's);
    propose: step 2 in place of draft_proposal; watch: the module docstring's."""
    c, P = draft.config, prompt_ids.shape[1]
    k = verify_tokens or c.block_size - 1
    embed, target_head = embed_and_head(target, draft)
    head, propose = head or target_head, propose or draft_proposal
    watch = watch or (lambda phase, **made: None)
    # Prefill: the target's cache and features for the prompt; its last logit gives the first token.
    cache, ctx, logits = prefill(target, draft, prompt_ids)
    first = sample(logits, temperature, generator)
    ids, done = commit(prompt_ids, [first], P, max_new_tokens, stop_ids)
    watch("prefill", ids=ids)
    taus = []
    while not done:
        s = ids.shape[1] - 1  # the anchor: the last committed token, not yet run by the target
        # 1. Draft: ONE forward of [anchor, MASK x (B-1)] at positions s..s+B-1; slots 1..k scored.
        h, u = draft_scores(draft, embed, head, ctx, ids, k)
        watch("draft", u=u)
        # 2. Walk: the selector's path through its lattice, or the unary argmax (T > 0: a sample).
        d, q = propose(draft, h, u, ids, temperature, use_selector, generator)
        watch("proposal", drafts=d)
        # 3. Verify: ONE target forward over [anchor, d_1..d_k]; row j is the target after d_1..d_j.
        block = torch.cat([ids[:, -1:], d], dim=1)
        logits, feats = target_forward(target, cache, c.target_layer_ids, block)
        # 4. Accept the longest prefix the target agrees with, plus a token of its own (the bonus);
        #    at T > 0 by rejection sampling against q.
        a, bonus = accept(logits, d[0], q, temperature, generator)
        # 5. Crop the cache to the anchor and the accepted drafts (the bonus comes with the next).
        crop(cache, s + a + 1)
        watch("verify", accepted=a, bonus=bonus)
        # 6. The verify computed their features already: they become draft context.
        extend_context(draft, ctx, feats[:, : a + 1], s)
        ids, done = commit(ids, d[0, :a].tolist() + [bonus], P, max_new_tokens, stop_ids)
        taus.append(a + 1)
        watch("commit", ids=ids)
    return ids, taus


@torch.no_grad()
def target_generate(
    target, prompt_ids, max_new_tokens, temperature=0.0, generator=None, stop_ids=()
):
    """Plain decoding, one target forward per token, same cache and sampling: the baseline."""
    P, cache = prompt_ids.shape[1], new_cache(target)
    logits = target(input_ids=prompt_ids, logits_to_keep=1, **with_cache(target, cache)).logits
    token = sample(logits[0, -1], temperature, generator)
    ids, done = commit(prompt_ids, [token], P, max_new_tokens, stop_ids)
    taus = []
    while not done:
        crop(cache, ids.shape[1] - 1)  # a no-op that also trims sliding-window layers
        logits = target(input_ids=ids[:, -1:], **with_cache(target, cache)).logits
        token = sample(logits[0, -1], temperature, generator)
        ids, done = commit(ids, [token], P, max_new_tokens, stop_ids)
        taus.append(1)
    return ids, taus


# --------------------------------------------------------------------------- the steps of a cycle
def embed_and_head(target, draft):
    """The target's frozen embedding and head (h @ W^T) in the draft's precision: lossless all the
    same, since only the target's verify commits tokens."""
    dt = next(draft.parameters()).dtype
    embed = lambda ids: target.get_input_embeddings()(ids).to(dt)  # noqa: E731
    w = target.get_output_embeddings().weight.to(dt)  # [V, H]
    return embed, lambda h: h @ w.t()  # noqa: E731


def prefill(target, draft, prompt_ids):
    """The target over the prompt [1, P] -> (its KV cache, the draft's context: the prompt's
    features at positions 0..P-1, the logits [V] after the prompt)."""
    cache, ctx = new_cache(target), model.ContextCache()
    logits, feats = target_forward(
        target, cache, draft.config.target_layer_ids, prompt_ids, logits_to_keep=1
    )
    crop(cache, prompt_ids.shape[1])  # a no-op that also trims sliding-window layers
    extend_context(draft, ctx, feats, 0)
    return cache, ctx, logits[-1]


def draft_scores(draft, embed, head, ctx, ids, L: int):
    """The draft's block after the committed ids [1, s+1] -> (h [1, L, H], u [1, L, V]) at slots
    1..L: only the slots the cycle can send are scored (the vocabulary head is most of the cost)."""
    s = torch.tensor([ids.shape[1] - 1], device=ids.device)
    h = model.forward_inference(draft, embed, ctx, ids[:, -1], s)  # [1, B, H]
    u = draft.unary_logits(h[:, : L + 1], head)[:, 1:]
    return h[:, 1 : L + 1], u


def draft_proposal(
    draft, h, u, ids, temperature=0.0, use_selector=True, generator=None, walk="sequential"
):
    """draft_scores' h, u of slots 1..L -> (drafts [1, L], q [1, L, V]: the distribution they were
    sampled from, for rejection sampling; None when greedy). walk: a name in selector.WALKS."""
    selector = draft.candidate_selector
    if use_selector and selector is not None:
        d, q_k, cand = selector.propose(h, u, ids[:, -1], temperature, generator, walk)  # [1, L, K]
        if temperature == 0:
            return d, None
        # q: the selector's K-way q, zero off the candidates
        return d, torch.zeros_like(u, dtype=torch.float32).scatter_(-1, cand, q_k)
    if temperature == 0:
        return u.argmax(-1), None
    # plain DFlash / --unary: softmax(u / T) over the vocab
    q = probs(u, temperature)
    return torch.multinomial(q[0], 1, generator=generator).T, q


def target_forward(target, cache, layer_ids, ids, **kw):
    """The target over ids [1, n] after the cached rows -> (logits [n, V], features [1, n, k*H])."""
    out, feats = capture_features(
        target, layer_ids, input_ids=ids, **with_cache(target, cache), **kw
    )
    return out.logits[0], feats


def accept(logits, drafts, q, temperature: float, generator=None):
    """The verify's logits [k+1, V], drafts [k], their q [k, V] or None -> (a, the next token)."""
    if q is not None:  # sampled drafts: accept d_j with probability min(1, p_j(d_j) / q_j(d_j))
        return rejection_sample(probs(logits, temperature), q[0], drafts, generator)
    best = logits.argmax(-1).tolist()  # [k+1]
    a = next((j for j, d in enumerate(drafts.tolist()) if d != best[j]), len(drafts))
    return a, best[a]


def extend_context(draft, ctx, feats, start: int):
    """The target's features [1, n, k*H] at positions start..start+n-1 become draft context."""
    ctx.append(draft, feats, torch.arange(start, start + feats.shape[1], device=feats.device)[None])


def commit(ids, new: list, prompt_len: int, max_new_tokens: int, stop_ids):
    """Append new tokens to ids, cut at max_new_tokens or just after a stop token -> (ids, done)."""
    room = max_new_tokens - (ids.shape[1] - prompt_len)
    new = new[:room]
    stop = next((i for i, t in enumerate(new) if t in stop_ids), None)
    if stop is not None:
        new = new[: stop + 1]
    ids = torch.cat([ids, torch.tensor([new], dtype=ids.dtype, device=ids.device)], dim=1)
    return ids, stop is not None or len(new) == room


# ------------------------------------------------------------------------ the target's KV cache
def new_cache(target):
    """An empty KV cache for the target. Sliding-window layers keep their rows until crop(), so the
    rows of rejected drafts can still be dropped after a verify."""
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()
    return cache


def with_cache(target, cache) -> dict:
    """The forward's keyword arguments that read and extend cache. transformers 5.24 names it
    `cache`; 5.17 (and before) `past_key_values`, and takes any other name silently into **kwargs,
    uncached."""
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def crop(cache, length: int):
    """Keep the first `length` rows of every layer (transformers 5: crop(-n) drops the last n)."""
    cache.crop(length - cache.get_seq_length())


# ------------------------------------------------------------------ sampling and the rejection rule
def probs(logits, temperature: float):
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(logits, temperature: float, generator=None) -> int:
    """One token from logits [V]: argmax at temperature 0, else from softmax(logits / T)."""
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(probs(logits, temperature), 1, generator=generator))


def accept_probability(p, q, d: int) -> float:
    """Rejection sampling accepts a draft token d ~ q with probability min(1, p(d) / q(d))."""
    return min(1.0, float(p[d] / q[d]))


def residual(p, q):
    """After a rejection the token comes from normalize(max(0, p - q))."""
    r = (p - q).clamp_min(0)
    # r = 0 only if p == q, where rejection has probability 0
    return r / r.sum() if r.sum() > 0 else p


def rejection_sample(p, q, drafts, generator=None):
    """Target probabilities p [B, V], proposal q [B-1, V], drafts [B-1] -> (a, next token): accept
    d_j while a uniform draw is below min(1, p_j(d_j) / q_j(d_j)), then a token from the residual,
    or the last row's bonus; each is distributed exactly as p (Leviathan et al. 2023)."""
    for j, d in enumerate(drafts.tolist()):
        draw = float(torch.rand((), generator=generator, device=p.device))
        if draw >= accept_probability(p[j], q[j], d):
            return j, int(torch.multinomial(residual(p[j], q[j]), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))
