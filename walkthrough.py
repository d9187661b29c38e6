"""One DFlash2 block's life, with real numbers and shapes (docs/walkthrough.md explains the output).

    python walkthrough.py

Tiny seeded random models (a 4-layer Qwen3 target and a 2-layer DFlash2 draft, vocabulary 32, block
B = 4), seconds on any CPU, nothing downloaded. Every number printed comes from the project's own
functions; this file only builds the inputs and prints:

    0. the target and one training row        4. the convolution's taps (conv.py)
    1. the anchored blocks (model.py)          5. the selector's lattice and walk, a tree
    2. one layer's visibility (attention.py)   6. the objective's labels and weights (loss.py)
    3. training path == inference path         7. one decoding cycle: decoding.py's steps

main() returns what it printed; test_all.py recomputes some of it.
"""

import argparse

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import attention
import decoding
import loss
import model
import tree
from conv import GroupedDynamicCausalConv
from selector import CandidateSelector, top_k_candidates

V, H, B, MASK = 32, 32, 4, 31  # vocabulary, hidden size, block size, mask_token_id
LAYER_IDS = [0, 2]  # the target layers the draft reads
PROMPT = [5, 17]  # x0 x1: the prompt of the training row and of the decoding
ANSWER = 6  # x2..x7: the target's own greedy answer (on-policy data, prepare.py --regenerate)
NEXT_TURN = [5, 17]  # x8 x9: the start of a next user turn, not supervised
ANCHORS = [2, 5]
GAMMA = 2.0  # the position weights' decay (loss.DEFAULT_GAMMA has none for B = 4)
WORDS = ["New", "York", "Jersey", "City", "Devils", "Times"]  # the selector story's vocabulary
# the target's and the draft's layer shapes
SHAPE = dict(
    hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8
)


# ----------------------------------------------------------------------------- the tiny models
def tiny_target():
    torch.manual_seed(0)
    # initializer_range wide enough that its greedy answer does not just repeat a token
    c = Qwen3Config(vocab_size=V, num_hidden_layers=4, initializer_range=0.5, **SHAPE)
    return Qwen3ForCausalLM(c).eval()


def tiny_draft():
    torch.manual_seed(1)
    c = model.DraftConfig(
        **SHAPE,
        num_hidden_layers=2,
        vocab_size=V,
        num_target_layers=4,
        target_layer_ids=LAYER_IDS,
        mask_token_id=MASK,
        block_size=B,
        rope_theta=10000.0,
        initializer_range=0.2,
        conv_kernel_size=2,
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=4,
    )
    draft = model.DraftModel(c)
    # A fresh DFlash2 draft computes exactly what plain DFlash computes (conv = identity, successor
    # codebook = 0). Move both off their starts, as training would, so that they do something here.
    with torch.no_grad():
        for layer in draft.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(0.3 * torch.randn_like(conv.base_kernel))
                conv.kernel_projection.weight.normal_(std=0.2)
        draft.candidate_selector.successor_codebook.normal_(std=0.3)
    return draft.eval()


def target_io(target):
    """The target's frozen embedding and head (h @ W_lm^T), which the draft borrows, never saves."""
    w = target.get_output_embeddings().weight  # [V, H]
    return target.get_input_embeddings(), lambda h: h @ w.t()


# ----------------------------------------------------------------------------- printing
def row(values, width=3) -> str:
    return " ".join(f"{v:>{width}}" for v in values)


def grid(say, allowed, row_names, splits=()):
    """A boolean [R, C] tensor as lines of '#' (may read) and '.', a '|' before columns splits."""
    for name, r in zip(row_names, allowed.tolist()):
        cells = "".join(("| " if j in splits else "") + "#."[not v] + " " for j, v in enumerate(r))
        say(f"  {name}  {cells.rstrip()}")


def words(tokens) -> str:
    return " ".join(WORDS[t] for t in tokens)


# ----------------------------------------------------------------------------- 0-3: row and blocks
def training_row(say, target):
    """The prompt, the target's greedy answer to it, the start of a next turn -> ids [1, S],
    loss_mask [1, S] (1 on the answer), the target's features [1, S, n_t*H]."""
    answer, _ = decoding.target_generate(target, torch.tensor([PROMPT]), ANSWER)  # [1, P + ANSWER]
    ids = torch.cat([answer, torch.tensor([NEXT_TURN])], dim=1)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, len(PROMPT) : len(PROMPT) + ANSWER] = 1
    _, feats = model.capture_features(target, LAYER_IDS, input_ids=ids)  # [1, S, n_t*H]
    say("\n0. The target and one training row")
    say(f"  row x[0..{ids.shape[1] - 1}]  {row(ids[0].tolist())}")
    say(f"  loss_mask     {row(loss_mask[0].tolist())}")
    say("  x0 x1 the prompt; x2..x7 the target's own greedy answer; x8 x9 a next turn")
    say(f"  features: the target's layers {LAYER_IDS} at every position -> {list(feats.shape)}")
    return ids, loss_mask, feats


def blocks(say, ids):
    S = ids.shape[1]
    positions, docs = torch.arange(S)[None], torch.zeros(1, S, dtype=torch.long)  # [1, S]
    anchors = torch.tensor([ANCHORS])  # [1, A]
    made = model.anchored_blocks(ids, anchors, B, MASK, positions, docs)  # each [1, A*B]
    block_ids, q_pos, q_anchor, q_block, q_doc = made
    Q = q_pos.shape[1]
    say(
        f"\n1. Anchored blocks (model.anchored_blocks): anchors {ANCHORS}, B = {B}, M = mask {MASK}"
    )
    say(f"  slot       {row([i % B for i in range(Q)])}")
    say(f"  block      {row([f'x{q_pos[0, i]}' if i % B == 0 else 'M' for i in range(Q)])}")
    for name, values in zip(["block_ids", "q_pos", "q_anchor", "q_block"], made):
        say(f"  {name:<9}  {row(values[0].tolist())}")
    return anchors, (q_anchor, q_pos, q_block, q_doc), (positions, docs)


def visibility(say, queries, context):
    _, q_pos, q_block, q_doc = queries
    keys = attention.attention_keys(q_pos, q_block, q_doc, *context)  # each [1, C + Q]
    C, Q = context[0].shape[1], q_pos.shape[1]
    full = attention.block_attention_mask(queries, keys, causal=False)[0, 0]  # [Q, C + Q]
    causal = attention.block_attention_mask(queries, keys, causal=True)[0, 0]
    rows = [f"b{q_block[0, i]} s{i % B} pos {q_pos[0, i]}" for i in range(Q)]
    in_block = [b * B for b in range(1, Q // B)]
    say(f"\n2. Who sees what (attention.block_attention_mask): [Q, C + Q] = {list(full.shape)}")
    say(f"  keys: {C} context rows (the target's features at positions 0..{C - 1}), then the")
    say(f"  block rows at positions {row(keys[0][0, C:].tolist(), 1)}. A full-attention layer:")
    say(f"  {'key position':>13}  {' '.join(str(p % 10) for p in range(C))}")
    grid(say, full, rows, [C] + [C + b for b in in_block])
    say("  a causal layer (sliding layers by default, or is_causal: true), inside the blocks:")
    grid(say, causal[:, C:], rows, in_block)


def same_block_both_paths(say, draft, embed, ids, feats, anchors):
    """The central invariant: all blocks in one training pass == each block alone at inference."""
    h_train = model.forward_training(draft, embed, ids, feats, anchors)  # [N, A, B, H]
    a = ANCHORS[1]
    cache = model.ContextCache()
    cache.append(draft, feats[:, :a], torch.arange(a)[None])  # what serving at anchor a has seen
    h_inf = model.forward_inference(draft, embed, cache, ids[:, a], torch.tensor([a]))  # [1, B, H]
    diff = (h_train[0, 1] - h_inf[0]).abs().max()
    say("\n3. Training path == inference path (model.forward_training, model.forward_inference)")
    say(f"  forward_training: both blocks in one pass -> h {list(h_train.shape)} [N, A, B, H]")
    say(f"  forward_inference: block 1 alone against a ContextCache of rows 0..{a - 1}")
    say(f"  -> h {list(h_inf.shape)}; max |difference| from training block 1: {diff:.1e}")
    return h_train


# ----------------------------------------------------------------------------- 4: the convolution
def convolution(say):
    torch.manual_seed(2)
    T, Hc, G = 3, 4, 2
    conv = GroupedDynamicCausalConv(hidden_size=Hc, kernel_size=T, group_size=G, block_size=B)
    conv.base_kernel.normal_()  # as if trained: a fresh module is the identity (below)
    conv.kernel_projection.weight.normal_()
    a = torch.randn(1, 2 * B, Hc)  # [N, 2 blocks of B rows, H], flattened as in training
    k = conv.kernels(a)  # [2 sides, N, S, T, H]
    # output row i reads input row r if a pulse at row r alone reaches y[i]
    pulses = torch.eye(2 * B)[:, :, None].expand(-1, -1, Hc)  # [2B pulses, S, H]
    reads = conv.convolve(pulses, k[0].expand(2 * B, -1, -1, -1)).ne(0).any(-1).T  # [out, in]
    lin = torch.nn.Linear(Hc, Hc)
    identity = torch.equal(GroupedDynamicCausalConv(Hc, T, G, B)(a, lin), lin(a))
    say(
        f"\n4. The convolution (conv.GroupedDynamicCausalConv): T = {T}, B = {B}, H = {Hc}, G = {G}"
    )
    say(f"  base_kernel {list(conv.base_kernel.shape)} [pre/post, T, H]; the per-row kernels")
    say(f"  {list(k.shape)} [side, N, rows, T, H]. Which input rows each output row reads:")
    ins = " ".join(str(r) for r in range(B)) + " | " + " ".join(str(r) for r in range(B, 2 * B))
    say(f"  {'in row':>11}  {ins}")
    grid(say, reads, [f"b{i // B} s{i % B} row {i}" for i in range(2 * B)], [B])
    say(f"  row {B} (block 1, slot 0) never reads row {B - 1} (block 0): no tap crosses a block")
    i = B + 1
    say(f"  row {i}'s pre kernel, beta[t] + d[{i}, t, c // G], one value per channel c:")
    for t in range(T):
        unused = "" if i % B >= t else f"   unused: slot {i % B} < t"
        say(f"    t = {t}: {row([f'{v:+.2f}' for v in k[0, 0, i, t].tolist()], 6)}{unused}")
    say(f"  a fresh module is the exact identity, conv(a, f) == f(a): {identity}")
    return reads


# ----------------------------------------------------------------------------- 5: the selector
def selector_story():
    """Anchor "New"; slot 1's candidates York 2.0, Jersey 1.9; slot 2's Devils 1.6, City 1.5
    (Times 1.2 falls outside the top 2). Rank 1 with P h = 1, so s(p -> c) = u[c] + A[p] * Bs[c],
    with A[York] = 1, A[Jersey] = -0.5, Bs[City] = 1, Bs[Devils] = -1, all else 0."""
    w = {x: i for i, x in enumerate(WORDS)}
    sel = CandidateSelector(
        hidden_size=2, vocab_size=len(WORDS), rank=1, top_k=2, initializer_range=0
    )
    A, Bs = sel.predecessor_codebook, sel.successor_codebook  # [V, rank 1]
    with torch.no_grad():
        sel.hidden_projection.weight.copy_(torch.tensor([[1.0, 0.0]]))
        A[w["York"], 0], A[w["Jersey"], 0] = 1.0, -0.5
        Bs[w["City"], 0], Bs[w["Devils"], 0] = 1.0, -1.0
    u = torch.full((1, 2, len(WORDS)), -2.0)  # [N, 2 slots, V] unary scores
    u[0, 0, w["York"]], u[0, 0, w["Jersey"]] = 2.0, 1.9
    u[0, 1, w["Devils"]], u[0, 1, w["City"]], u[0, 1, w["Times"]] = 1.6, 1.5, 1.2
    h = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])  # [N, 2, hidden]: P h = 1 at both slots
    return sel, h, u, torch.tensor([w["New"]])


def selector(say):
    sel, h, u, anchor = selector_story()
    cand_scores, cand_ids = top_k_candidates(u, sel.top_k)  # [1, 2, K]
    lattice = sel.lattice(h, anchor, cand_ids, cand_scores)  # [1, 2, K, K]
    walk, _ = sel.walk(lattice, cand_ids)  # [1, 2]
    c1, c2 = cand_ids[0].tolist()
    say('\n5. The selector (selector.CandidateSelector, K = 2, rank 1), anchor "New"')
    for j in range(2):
        top = zip(cand_ids[0, j].tolist(), cand_scores[0, j].tolist())
        say(f"  slot {j + 1}: unary top 2: " + ", ".join(f"{WORDS[c]} {s:.1f}" for c, s in top))
    say("  lattice, slot 1 (its one predecessor is the anchor):")
    first = zip(c1, lattice[0, 0, 0].tolist())
    say(f"    {'New':>8} -> " + "  ".join(f"{WORDS[c]} {s:.2f}" for c, s in first))
    say("  lattice, slot 2, s(p -> c) = u[c] + A[p] * (P h) * Bs[c]:")
    say(f"    {'':>8}    " + "".join(f"{WORDS[c]:>8}" for c in c2))
    for p, prev in enumerate(c1):
        say(f"    {WORDS[prev]:>8} -> " + "".join(f"{s:8.2f}" for s in lattice[0, 1, p].tolist()))
    say(f"  unary path (the argmax per slot): New {words(u.argmax(-1)[0].tolist())}")
    say(f"  the walk (the argmax after the previous pick): New {words(walk[0].tolist())}")
    story_tree(say, lattice, cand_ids, int(anchor))


def story_tree(say, lattice, cand_ids, anchor):
    """A tree over the same lattice (tree.grow, as tree.draft_tree grows one): a node scores the
    summed log-probabilities of its path's edges, log softmax_K(s(parent -> .))."""
    logp = torch.log_softmax(lattice[0], dim=-1).tolist()  # [slot, parent's candidate, K]
    best_first = lambda r: sorted(zip(r, range(len(r))), reverse=True)  # noqa: E731
    children = [[best_first(logp[0][0])], [best_first(r) for r in logp[1]]]
    t = tree.grow(cand_ids[0].tolist(), children, budget=4, anchor=anchor)
    say("  a tree of 4 nodes over the same lattice (tree.grow), best first:")
    for i, (tok, parent, depth) in enumerate(zip(t.tokens, t.parents, t.depths)):
        say(f"    node {i}: {'  ' * depth}{WORDS[tok]:<7} depth {depth}, parent {parent}")
    say("  its ancestor mask (Tree.ancestors), node i (row) sees node j (column):")
    grid(say, t.ancestors(), [f"node {i} {WORDS[x]:<6}" for i, x in enumerate(t.tokens)])
    return t


# ----------------------------------------------------------------------------- 6: the objective
def labels_and_weights(say, draft, target, ids, loss_mask, anchors, h_train):
    head_w = target.get_output_embeddings().weight  # [V, H]
    valid = torch.ones_like(anchors, dtype=torch.bool)
    labels, prev, w0 = loss.block_labels(ids, loss_mask, anchors, valid, B)  # [N, A, B-1]
    w = loss.exp_weights(w0, GAMMA)
    out = loss.objective(
        draft, head_w, h_train, ids, loss_mask, anchors, valid, loss.LossConfig(gamma=GAMMA)
    )  # ce with exponential decay; alpha_t None: the selector's term is left out
    n, d, guess = out.numerator, out.denominator, out.slots.argmax
    say(f"\n6. The objective (loss.block_labels, loss.exp_weights, gamma = {GAMMA})")
    for b, a in enumerate(ANCHORS):
        say(f"  block {b} (anchor {a}): slots 1..{B - 1} at positions {list(range(a + 1, a + B))}")
        say(f"    labels x[a+j]            {row(labels[0, b].tolist(), 5)}")
        say(f"    prev x[a+j-1]            {row(prev[0, b].tolist(), 5)}")
        say(f"    w0                       {row([f'{v:.0f}' for v in w0[0, b].tolist()], 5)}")
        say(f"    w = w0 exp(-(j-1)/gamma) {row([f'{v:.3f}' for v in w[0, b].tolist()], 5)}")
        say(f"    the draft's argmax       {row(guess[0, b].tolist(), 5)}")
    say(f"  loss.objective, ce: sum w * -log q(label) / sum w = {n:.4f} / {d:.4f} = {n / d:.4f}")


# ----------------------------------------------------------------------------- 7: decoding
def prefill(target, draft, prompt):
    """decoding.prefill, then the first token committed -> (cache, context, ids [1, P + 1])."""
    cache, ctx, logits = decoding.prefill(target, draft, prompt)
    first = decoding.sample(logits, temperature=0.0)
    ids, _ = decoding.commit(prompt, [first], len(PROMPT), ANSWER, stop_ids=())
    return cache, ctx, ids


def cycle(say, target, draft, embed, head, cache, ctx, ids, scripted=None):
    """One greedy cycle from the last committed token: decoding.speculative_generate's steps,
    called in its order, each printed -> h of slots 1..B-1 [1, B-1, H]."""
    s = ids.shape[1] - 1  # the anchor's position
    h, u = decoding.draft_scores(draft, embed, head, ctx, ids, B - 1)  # [1, B-1, H], [1, B-1, V]
    say(f"    draft   [x{s} M M M] at positions {s}..{s + B - 1}, {ctx.pos.shape[1]} context rows")
    unary = u[0].argmax(-1).tolist()
    say(f"            -> h {list(h.shape)} of slots 1..{B - 1}; their unary argmax: {unary}")
    d, q = decoding.draft_proposal(draft, h, u, ids)  # [1, B-1]; q: None (greedy)
    departs = [j + 1 for j, (x, y) in enumerate(zip(d[0].tolist(), unary)) if x != y]
    where = f"departs from it at slot(s) {departs}" if departs else "the unary path here"
    say(f"    walk    the selector's path: {d[0].tolist()}, {where}")
    if scripted is not None:
        d = torch.tensor([scripted])
        say(f"            replaced by the script: {scripted}")
    block = torch.cat([ids[:, -1:], d], dim=1)
    before = cache.get_seq_length()
    logits, feats = decoding.target_forward(target, cache, LAYER_IDS, block)  # row i: after d_i
    grew = f"cache {before} -> {cache.get_seq_length()} rows"
    say(f"    verify  the target runs {block[0].tolist()}: {grew}")
    say(f"            its own next token after each: {logits.argmax(-1).tolist()}")
    # accept the longest agreeing prefix, then the target's own next token (the bonus)
    a, bonus = decoding.accept(logits, d[0], q, temperature=0.0)
    say(f"    accept  {a} draft(s) {d[0, :a].tolist()}, then the bonus {bonus}")
    decoding.crop(cache, s + a + 1)
    say(f"    crop    the cache keeps positions 0..{s + a}: {cache.get_seq_length()} rows")
    # the verify computed their features already: they become draft context
    decoding.extend_context(draft, ctx, feats[:, : a + 1], s)
    rows = ctx.pos.shape[1]
    say(f"    context + the features of positions {s}..{s + a}: {rows} draft context rows")
    ids, _ = decoding.commit(ids, d[0, :a].tolist() + [bonus], len(PROMPT), ANSWER, stop_ids=())
    new = ids[0, s + 1 :].tolist()
    say(f"    commit  {new}: tau = {a + 1}; the next anchor is x{s + a + 1} = {new[-1]}")
    return h


def decode(say, target, draft, embed, head, ids, h_train):
    prompt = ids[:, : len(PROMPT)]
    answer = ids[0, len(PROMPT) : len(PROMPT) + ANSWER].tolist()
    say("\n7. One decoding cycle, greedy: decoding.py's steps, in speculative_generate's order")
    say(f"  prompt {PROMPT}; the target's greedy answer (decoding.target_generate): {answer}")
    cache, ctx, ids = prefill(target, draft, prompt)
    rows = cache.get_seq_length()
    say(f"  prefill: the target runs the prompt once -> its cache ({rows} rows), the")
    say(f"  draft's context rows 0..{len(PROMPT) - 1} (its features), the first token {ids[0, -1]}")
    say("  cycle 1, the random draft:")
    h = cycle(say, target, draft, embed, head, cache, ctx, ids)
    same = f"training block 0's, anchor {ANCHORS[0]}, slots 1..{B - 1}"
    say(f"    (h is {same}: max |difference| {(h[0] - h_train[0, 0, 1:]).abs().max():.1e})")
    script = answer[1:3] + [(answer[3] + 1) % V]  # right at slots 1 and 2, wrong at slot 3
    cache, ctx, ids = prefill(target, draft, prompt)
    say("  cycle 1 again, a scripted draft right at slots 1 and 2, wrong at slot 3:")
    cycle(say, target, draft, embed, head, cache, ctx, ids, script)
    out, taus = decoding.speculative_generate(target, draft, prompt, ANSWER)
    new = out[0, len(PROMPT) :].tolist()
    say("  the whole answer, decoding.speculative_generate with the random draft:")
    say(f"    {new}, taus {taus}; the target's own answer: {new == answer}")


# ----------------------------------------------------------------------------- main
@torch.no_grad()  # nothing here trains
def main() -> str:
    """Print the walkthrough; return what was printed."""
    lines = []

    def say(line):
        print(line)
        lines.append(line)

    torch.set_num_threads(1)  # tiny matrices: one thread is the fastest
    target, draft = tiny_target(), tiny_draft()
    embed, head = target_io(target)
    say(f"DFlash2 walkthrough: a Qwen3 target (4 layers, H {H}, V {V}), a DFlash2 draft")
    say(f"(2 layers, B {B}), both random and seeded")
    ids, loss_mask, feats = training_row(say, target)
    anchors, queries, context = blocks(say, ids)
    visibility(say, queries, context)
    h_train = same_block_both_paths(say, draft, embed, ids, feats, anchors)
    convolution(say)
    selector(say)
    labels_and_weights(say, draft, target, ids, loss_mask, anchors, h_train)
    decode(say, target, draft, embed, head, ids, h_train)
    return "\n".join(lines)


if __name__ == "__main__":
    argparse.ArgumentParser(description="One DFlash2 block's life, printed.").parse_args()
    main()
