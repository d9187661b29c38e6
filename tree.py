"""Verify a tree, not a path: a cycle's drafts as a tree, checked in one target forward (DDTree for
DFlash2).

    python generate.py --draft D --prompt "..." --tree-budget 16 --show    # watch the trees
    python generate.py --draft D --bench gsm8k --tree-budget 8 16 24 32   # one bench row per budget

A cycle's draft forward scores all B-1 slots at once. A path sends one token per slot to the target;
a tree sends up to N nodes, grown best-first from the anchor over each slot's top-K candidates
(DDTree, arXiv 2604.12989). A node at depth d holds a candidate of slot d; its score is the sum of
the log-probabilities along its path, one per edge:

    DFlash2:          log softmax_K(s_d(parent -> .))[child]  the selector's edge scores, given
                                                              the parent's own token (selector.py)
    DFlash, --unary:  log softmax_V(u_d)[child]               the slot's own distribution (DDTree)

The target sees node i at position anchor + depth_i, attending to the committed context and to i's
own ancestors only (one 4-D mask), so row i of its logits is exactly what it would say after i's
path. The walk then follows, from the anchor, the child that holds the target's own token (its
argmax, or at T > 0 a sample from p) until no child holds it; that token is the bonus. Every
committed token is the target's own choice given the committed prefix, and the tree is a function of
that prefix alone: the output is the target's, token for token at T = 0, in distribution at T > 0.

Without branching a tree of budget k is the path of k drafts: --verify-tokens k and --tree-budget N
are one mechanism, and tree_generate is decoding.py's cycle with a tree in place of the path.
"""

import heapq
import itertools
import math
from dataclasses import dataclass, field

import torch

from decoding import (
    commit,
    crop,
    draft_scores,
    embed_and_head,
    extend_context,
    prefill,
    sample,
    target_forward,
)
from selector import TOP_K, top_k_candidates


@dataclass
class Tree:
    """A draft tree laid out as the target's block: node 0 is the anchor; node i > 0 holds tokens[i]
    at depths[i], child of parents[i] < i. Best-first order puts every parent before its children,
    and a parent's best child before its other children."""

    tokens: list
    parents: list
    depths: list

    @classmethod
    def chain(cls, anchor: int, drafts: list):
        """A path: drafts d_1..d_k after the anchor."""
        n = len(drafts) + 1
        return cls([anchor] + list(drafts), list(range(-1, n - 1)), list(range(n)))

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def children(self) -> list:
        """[n] lists: children[i] the nodes whose parent is node i, best first."""
        kids = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]].append(i)
        return kids

    def ancestors(self) -> torch.Tensor:
        """[n, n] bool: [i, j] when node j is node i or one of its ancestors."""
        n = len(self.tokens)
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            anc[i] |= anc[self.parents[i]]
        return anc


# ----------------------------------------------------------------------------- build
@dataclass(order=True)
class Opening:
    """A node that may join the tree next, ordered best score first, ties to the earlier pushed."""

    neg_score: float
    order: int
    parent: int = field(compare=False)  # the node it would be a child of
    depth: int = field(compare=False)
    p: int = field(compare=False)  # the parent's candidate index (the anchor's: 0)
    rank: int = field(compare=False)  # it would be the parent's rank-th child, 0: the best
    parent_score: float = field(compare=False)


def grow(cand_ids, children, budget: int, branch: bool = True, anchor: int = -1) -> Tree:
    """The best-first tree of `budget` nodes (fewer if the lattice has fewer).

    cand_ids [L][K]: the candidate tokens of slots 1..L. children[d][p]: the candidates of slot d+1
    after candidate p of slot d (the anchor's: p = 0), as (log-probability, candidate index) pairs,
    best first; one row when they do not depend on the parent (unary). A child never scores above
    its parent nor a sibling above the one before it, so popping the best open node and opening its
    best child and next sibling visits the nodes in order of score. Without branching only the best
    child opens: the path of best children.
    """
    L, tree = len(cand_ids), Tree([anchor], [-1], [0])
    heap, order = [], itertools.count()

    def kids(depth, p):  # the children at `depth` of a node holding candidate p (anchor: p = 0)
        rows = children[depth - 1] if depth <= L else [[]]
        return rows[p] if len(rows) > 1 else rows[0]

    def push(parent_score, parent, depth, p, rank):  # the rank-th child of node `parent`
        row = kids(depth, p)
        if rank < len(row) and row[rank][0] > -math.inf:  # a certain miss gets no node
            score = parent_score + row[rank][0]
            heapq.heappush(heap, Opening(-score, next(order), parent, depth, p, rank, parent_score))

    push(0.0, 0, 1, 0, 0)
    while heap and len(tree.tokens) <= budget:
        node = heapq.heappop(heap)
        c = kids(node.depth, node.p)[node.rank][1]
        tree.tokens.append(cand_ids[node.depth - 1][c])
        tree.parents.append(node.parent)
        tree.depths.append(node.depth)
        push(-node.neg_score, len(tree.tokens) - 1, node.depth + 1, c, 0)  # its best child
        if branch:  # its next sibling
            push(node.parent_score, node.parent, node.depth, node.p, node.rank + 1)
    return tree


@torch.no_grad()
def draft_tree(draft, h, u, ids, budget: int, use_selector=True, branch=True) -> Tree:
    """The cycle's best-first Tree of `budget` nodes from draft_scores' h, u of slots 1..L. Children
    are ordered by raw score, ties in the candidates' order, so that without branching the tree is
    exactly the selector's greedy walk (or the unary argmax path)."""
    sel = draft.candidate_selector if use_selector else None
    K = min(sel.top_k if sel is not None else draft.config.selector_top_k or TOP_K, u.shape[-1])
    cand_scores, cand_ids = top_k_candidates(u, K)  # [1, L, K], best first
    if sel is not None:
        s = sel.lattice(h, ids[:, -1], cand_ids, cand_scores)[0].float()  # [L, K, K]: [d, p]
        logp = torch.log_softmax(s, dim=-1)  # the selector's K-way q
    else:  # equal scores in vocabulary order, as argmax breaks ties: the path is its argmax
        by_id, perm = cand_ids.sort(dim=-1)  # in vocabulary order
        scores = cand_scores.gather(-1, perm).float()
        cand_ids = by_id.gather(-1, scores.sort(dim=-1, descending=True, stable=True).indices)
        s = u[0].float().gather(-1, cand_ids[0])[:, None]  # [L, 1, K]: any parent
        logp = torch.log_softmax(u[0].float(), dim=-1).gather(-1, cand_ids[0])[:, None]
    order = s.sort(dim=-1, descending=True, stable=True).indices  # best first, ties in order
    children = [
        [list(zip(lp, o)) for lp, o in zip(a, b)]
        for a, b in zip(logp.gather(-1, order).tolist(), order.tolist())
    ]
    return grow(cand_ids[0].tolist(), children, budget, branch, int(ids[0, -1]))


# ---------------------------------------------------------------------------- verify in one forward
def attention_masks(tree: Tree, cache, dtype):
    """The additive 4-D masks [1, 1, n, kv] for the tree's n nodes after the cached context: each
    node sees every cached row (inside the window on sliding layers) and its own ancestors. The
    columns are what the cache hands the attention: its kept rows, then the n new ones. -> {layer
    kind: mask} for a cache with both kinds (Qwen3, Gemma take that mapping), else the one mask."""
    n, s = len(tree.tokens), cache.get_seq_length()
    anc, depth = tree.ancestors(), torch.tensor(tree.depths)
    masks = {}
    for i, layer in enumerate(cache.layers):
        kind = "sliding_attention" if layer.is_sliding else "full_attention"
        if kind in masks:
            continue
        kv_length, kv_offset = cache.get_mask_sizes(n, i)
        seen = torch.ones(n, kv_length - n, dtype=torch.bool)  # the committed context
        if layer.is_sliding:  # query pos - key pos < window
            W, past = layer.sliding_window, kv_offset + torch.arange(kv_length - n)
            seen &= (s + depth[:, None]) - past[None] < W
            ok = anc & (depth[:, None] - depth[None] < W)
        else:
            ok = anc
        allowed = torch.cat([seen, ok], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        masks[kind] = mask[None, None].to(layer.keys.device)
    return masks if len(masks) > 1 else masks.popitem()[1]


def follow_target(tree: Tree, logits, pick):
    """Follow the target through the tree: logits [n, V] (row i: the target after node i's path),
    pick(row) its token there, as plain decoding picks -> (accepted nodes, the bonus)."""
    # (node, token) -> the child of node that holds token
    child = {(p, tree.tokens[c]): c for p, kids in enumerate(tree.children()) for c in kids}
    node, path = 0, []
    while True:
        token = pick(logits[node])
        node = child.get((node, token))
        if node is None:
            return path, token
        path.append(node)


def keep_rows(cache, n: int, rows: list):
    """After a forward of n block tokens (the last n rows of every layer, sliding ones too), move
    the KV rows of the kept nodes `rows` (ascending) to the front of them; crop() drops the rest."""
    if rows == list(range(len(rows))):  # already in front: a path's accepted prefix
        return
    idx = torch.tensor(rows, device=cache.layers[0].keys.device)  # one copy for every layer
    for layer in cache.layers:
        for t in (layer.keys, layer.values):  # [1, heads, rows, head_dim]
            start = t.shape[2] - n
            t[:, :, start : start + len(rows)] = t[:, :, start + idx]


# ------------------------------------------------------------------------- the cycle, with a tree
@torch.no_grad()
def tree_generate(
    target,
    draft,
    prompt_ids,
    max_new_tokens,
    budget: int,
    *,
    use_selector=True,
    temperature=0.0,
    generator=None,
    stop_ids=(),
    head=None,
    propose=None,
    watch=None,
):
    """decoding.speculative_generate's cycle with a tree of `budget` nodes verified in place of the
    path: the same steps but the proposal, the verify's positions and mask, the walk and the KV
    rows kept. -> (ids [1, P + n], taus); propose: step 2 in place of draft_tree."""
    c, P, dev = draft.config, prompt_ids.shape[1], prompt_ids.device
    L = min(budget, c.block_size - 1)  # the deepest slot a tree of `budget` nodes reaches
    embed, target_head = embed_and_head(target, draft)
    head, propose = head or target_head, propose or draft_tree
    watch = watch or (lambda phase, **made: None)
    pick = lambda row: sample(row, temperature, generator)  # noqa: E731
    cache, ctx, logits = prefill(target, draft, prompt_ids)
    ids, done = commit(prompt_ids, [pick(logits)], P, max_new_tokens, stop_ids)
    watch("prefill", ids=ids)
    taus = []
    while not done:
        s = ids.shape[1] - 1  # the anchor
        # 1. Draft: the same block forward, slots 1..L scored.
        h, u = draft_scores(draft, embed, head, ctx, ids, L)
        watch("draft", u=u)
        # 2. Grow the tree best-first over each slot's top-K, from the draft's scores alone.
        t = propose(draft, h, u, ids, budget, use_selector)
        watch("proposal", tree=t)
        # 3. Verify: ONE target forward over [anchor, nodes...]; node i sits at s + depth_i and
        #    sees its ancestors only (a path's ancestor mask is the causal one).
        kw = {}
        if not t.is_chain():
            pos = s + torch.tensor([t.depths], device=dev)
            kw = dict(position_ids=pos, attention_mask=attention_masks(t, cache, target.dtype))
        block = torch.tensor([t.tokens], device=dev)
        logits, feats = target_forward(target, cache, c.target_layer_ids, block, **kw)
        # 4. Accept: follow the target's own token (argmax, or a sample from p) down the tree.
        path, bonus = follow_target(t, logits, pick)
        # 5. Keep only the KV rows of the anchor and the accepted nodes, in order; crop the rest.
        rows = [0] + path
        keep_rows(cache, len(t.tokens), rows)
        crop(cache, s + len(rows))
        watch("verify", path=path, bonus=bonus)
        # 6. Their features become draft context.
        extend_context(draft, ctx, feats[:, rows], s)
        ids, done = commit(ids, [t.tokens[i] for i in path] + [bonus], P, max_new_tokens, stop_ids)
        taus.append(len(path) + 1)
        watch("commit", ids=ids)
    return ids, taus
