"""Verify a tree, not a path: a cycle's drafts as a tree, checked in one target forward (DDTree for DFlash2).

    python generate.py --draft D --prompt "..." --tree-budget 16 --show      # watch the trees
    python generate.py --draft D --bench gsm8k --tree-budget 8 16 24 32     # one bench row per budget

A cycle's draft forward scores all B-1 slots at once. A path sends one token per slot to the target; a
tree sends up to N nodes, grown best-first from the anchor over each slot's top-K candidates (DDTree,
arXiv 2604.12989). A node at depth d holds a candidate of slot d; its score is the sum of the
log-probabilities along its path, one per edge:

    DFlash2:           log softmax_K(s_d(parent -> .))[child]    the selector's edge scores, given the
                                                                 parent's own token (selector.py)
    DFlash, --unary:   log softmax_V(u_d)[child]                 the slot's own distribution (DDTree)

The target sees node i at position anchor + depth_i, attending to the committed context and to i's own
ancestors only (one 4-D mask), so row i of its logits is exactly what it would say after i's path. The
walk then follows, from the anchor, the child that holds the target's own token (greedy: its argmax;
T > 0: a sample from p) until no child holds it; that token is the bonus. Every committed token is the
target's own choice given the committed prefix, and the tree is a function of that prefix alone (the
draft is deterministic given it), so the output is the target's: token for token at T = 0, and
exactly in distribution at T > 0.

Each node opens only its best child when branching is off: a tree of budget k is then the path of k
drafts, so --verify-tokens k and --tree-budget N are one mechanism, and `auto` picks between them by one
rule (choose, from the measured cost table and the draft's held-out acceptance statistics).
"""
import heapq
import math
from dataclasses import dataclass

import torch

from selector import top_k_candidates

TREE_BUDGETS = (8, 16, 24, 32)   # the tree budgets `auto` prices besides the paths (priced_sizes)
TOP_K = 16                       # candidates per slot where the draft has no selector_top_k (plain DFlash)


@dataclass
class Tree:
    """A draft tree laid out as the target's block: node 0 is the anchor; node i > 0 holds tokens[i] at
    depths[i], child of parents[i] < i. Best-first order puts every parent before its children, and a
    parent's best child before its other children."""
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

    def ancestors(self) -> torch.Tensor:
        """[n, n] bool: [i, j] when node j is node i or one of its ancestors."""
        n = len(self.tokens)
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            anc[i] |= anc[self.parents[i]]
        return anc


# ----------------------------------------------------------------------------- build
def grow(cand_ids, children, budget: int, branch: bool = True, anchor: int = -1) -> Tree:
    """The best-first tree of `budget` nodes (fewer if the lattice has fewer).

    cand_ids [L][K]: the candidate tokens of slots 1..L. children[d][p]: the candidates of slot d+1 after
    candidate p of slot d (after the anchor when d = 0: p = 0), as (log-probability, candidate index)
    pairs, best first; children[d] has one row when they do not depend on the parent (unary).
    A node's score is its path's summed log-probability. Popping the best open node and then opening its
    best child and its next sibling visits the nodes in order of score, since a child never scores above
    its parent nor a sibling above the one before it: the tree of budget n is the first n of any larger
    budget's. Without branching only the best child opens: the path of best children.
    """
    L, tree = len(cand_ids), Tree([anchor], [-1], [0])
    heap, count = [], 0        # (-score, tie-break, parent node, depth, parent's candidate, rank, parent's score)

    def row(depth, p):         # the children at `depth` of a node holding candidate p (anchor: p = 0)
        rows = children[depth - 1] if depth <= L else [[]]
        return rows[p] if len(rows) > 1 else rows[0]

    def push(score, parent, depth, p, rank):     # the rank-th child of node `parent`
        nonlocal count
        if rank < len(row(depth, p)) and row(depth, p)[rank][0] > -math.inf:     # a certain miss gets no node
            heapq.heappush(heap, (-(score + row(depth, p)[rank][0]), count, parent, depth, p, rank, score))
            count += 1

    push(0.0, 0, 1, 0, 0)
    while heap and len(tree.tokens) <= budget:
        neg, _, parent, depth, p, rank, parent_score = heapq.heappop(heap)
        c = row(depth, p)[rank][1]
        tree.tokens.append(cand_ids[depth - 1][c])
        tree.parents.append(parent)
        tree.depths.append(depth)
        push(-neg, len(tree.tokens) - 1, depth + 1, c, 0)                         # its best child
        if branch:
            push(parent_score, parent, depth, p, rank + 1)                        # its next sibling
    return tree


@torch.no_grad()
def draft_tree(draft, h, u, ids, budget: int, use_selector=True, branch=True) -> Tree:
    """The cycle's tree: h [1, L, H] final draft hidden states, u [1, L, V] unary scores of slots 1..L,
    ids [1, P] committed tokens (ids[:, -1] is the anchor) -> the best-first Tree of `budget` nodes.
    Tests replace this function (generate's `grower` argument) to script trees.

    The children of a node are ordered by the raw scores and ties keep the candidates' order, so that
    without branching the tree is exactly the selector's greedy walk (or the unary argmax path)."""
    sel = draft.candidate_selector if use_selector else None
    K = min(sel.top_k if sel is not None else draft.config.selector_top_k or TOP_K, u.shape[-1])
    cand_scores, cand_ids = top_k_candidates(u, K)                               # [1, L, K], best first
    if sel is not None:
        s = sel.lattice(h, ids[:, -1], cand_ids, cand_scores)[0].float()         # [L, K, K]: [d, p] after cand p
        logp = torch.log_softmax(s, dim=-1)                                      # the selector's K-way q
    else:                   # equal scores in vocabulary order, as argmax breaks ties: the path is its argmax
        by_id, perm = cand_ids.sort(dim=-1)                                     # in vocabulary order
        best = cand_scores.gather(-1, perm).float().sort(dim=-1, descending=True, stable=True).indices
        cand_ids = by_id.gather(-1, best)                                         # by score, then by id
        s = u[0].float().gather(-1, cand_ids[0])[:, None]                        # [L, 1, K]: any parent
        logp = torch.log_softmax(u[0].float(), dim=-1).gather(-1, cand_ids[0])[:, None]
    order = s.sort(dim=-1, descending=True, stable=True).indices                 # best first, ties in order
    children = [[list(zip(lp, o)) for lp, o in zip(a, b)]
                for a, b in zip(logp.gather(-1, order).tolist(), order.tolist())]
    return grow(cand_ids[0].tolist(), children, budget, branch, int(ids[0, -1]))


# ----------------------------------------------------------------------------- verify in one forward
def attention_masks(tree: Tree, cache, dtype):
    """The additive 4-D masks [1, 1, n, kv] for the tree's n block tokens after the cached context: each
    node sees every cached row (inside the sliding window on sliding layers) and its own ancestors.

    The key columns are, per layer kind, what the cache will hand the attention: its kept context rows
    (positions kv_offset..) and then the n new rows. Returns {layer kind: mask} for a cache with sliding
    and full layers (Qwen3, Gemma: their forward takes that mapping), else the one mask."""
    n, s = len(tree.tokens), cache.get_seq_length()
    anc, depth = tree.ancestors(), torch.tensor(tree.depths)
    masks = {}
    for i, layer in enumerate(cache.layers):
        kind = "sliding_attention" if layer.is_sliding else "full_attention"
        if kind in masks:
            continue
        kv_length, kv_offset = cache.get_mask_sizes(n, i)
        seen = torch.ones(n, kv_length - n, dtype=torch.bool)                     # the committed context
        if layer.is_sliding:                                                      # query pos - key pos < window
            W, past = layer.sliding_window, kv_offset + torch.arange(kv_length - n)
            seen &= (s + depth[:, None]) - past[None] < W
            ok = anc & (depth[:, None] - depth[None] < W)
        else:
            ok = anc
        allowed = torch.cat([seen, ok], dim=1)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        masks[kind] = mask[None, None].to(layer.keys.device)
    return masks if len(masks) > 1 else masks.popitem()[1]


def walk(tree: Tree, logits, pick):
    """Follow the target through the tree: logits [n, V] (row i: the target after node i's path), pick(row)
    -> the target's token there (its argmax, or a sample from p, exactly as plain decoding picks).
    -> (accepted nodes, the token after the last of them: the bonus)."""
    child = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if i}
    node, path = 0, []
    while True:
        token = pick(logits[node])
        node = child.get((node, token))
        if node is None:
            return path, token
        path.append(node)


def keep_rows(cache, n: int, rows: list):
    """After a forward of n block tokens, move the KV rows of the kept block nodes `rows` (ascending) to the
    front of the block's rows, in every layer; crop() then drops the rest. The block's rows are the last n
    of every layer, sliding ones included (their cache keeps its past until crop: generate.new_cache)."""
    idx = torch.tensor(rows)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):                                   # [1, heads, rows, head_dim]
            start = t.shape[2] - n
            t[:, :, start:start + len(rows)] = t[:, :, start + idx.to(t.device)]


# ----------------------------------------------------------------------------- choose: a path or a tree, how big
def expected_tau(stats: dict, budget: int, branch: bool) -> float:
    """Expected tau (accepted drafts + 1) of a path of `budget` drafts (branch False) or of a best-first
    tree of `budget` nodes, from one mode's held-out statistics (acceptance.json, written by train.py):
    stats["accepted"][d-1] = r_d, the share of blocks whose greedy path was right up to slot d, and
    stats["rank"][d-1][m] = rho_d(m), the share of slot-d labels that were the draft's candidate m (0: best).

    Path: E = 1 + r_1 + ... + r_k, exactly (a path cut at k accepts min(run, k) drafts).
    Tree, a model: given a right prefix, slot d's label is candidate m with probability rho'_d(m): rho_d
    rescaled so that the best candidate has the measured conditional rate a_d = r_d / r_{d-1}, the others
    scaled alike (their sum at most 1 - a_d); slots independent. A node reached through candidates
    m_1..m_d is then accepted with probability prod_i rho'_i(m_i); the tree of budget n holds the n most
    likely nodes (grown best-first, as the draft's own trees are) and E = 1 + the sum of their
    probabilities. The draft's real trees follow its per-cycle scores instead, so this is an estimate."""
    r = stats["accepted"]
    if not branch:
        return 1 + sum(r[:budget])
    probs = []
    for d, rho in enumerate(stats["rank"]):
        prev = r[d - 1] if d else 1.0
        a = r[d] / prev if prev > 0 else rho[0]
        rest = sum(rho[1:])
        scale = min(a / rho[0] if rho[0] > 0 else 1.0, (1 - a) / rest if rest > 0 else 0.0)
        probs.append([a] + [x * scale for x in rho[1:]])
    logs = [[(math.log(x) if x > 0 else -math.inf, m) for m, x in enumerate(row)] for row in probs]
    children = [[sorted(row, key=lambda e: -e[0])] for row in logs]          # best first, ties by rank
    t = grow([list(range(len(row))) for row in probs], children, budget)
    p = [1.0]
    for i in range(1, len(t.tokens)):
        p.append(p[t.parents[i]] * probs[t.depths[i] - 1][t.tokens[i]])
    return 1 + sum(p[1:])


def label(shape) -> str:
    kind, n = shape
    return f"path of {n} draft{'s' * (n > 1)}" if kind == "path" else f"tree of {n} nodes"


def priced_sizes(B: int) -> list:
    """The target forwards `auto` prices: a plain step, every path (2..B tokens), every TREE_BUDGETS tree."""
    return sorted({*range(1, B + 1), *(n + 1 for n in TREE_BUDGETS)})


def plan(verify_tokens, tree_budget, draft, draft_path: str, mode: str, costs) -> list:
    """The values of --verify-tokens and --tree-budget (counts or "auto"; neither flag: --tree-budget auto)
    -> the verify shapes, ("path", k) or ("tree", n); each auto one is chosen now and said in one line.
    costs(sizes) -> ({n: ms of an n-token target forward}, the draft's ms): this machine's prices."""
    B = draft.config.block_size
    asked = [("path", v) for v in verify_tokens or []] + [("tree", v) for v in tree_budget or []]
    if any(kind == "path" and n != "auto" and n >= B for kind, n in asked):
        raise ValueError(f"--verify-tokens: at most {B - 1}, the drafts this draft proposes a cycle (block size {B})")
    shapes = []
    for kind, n in asked or [("tree", "auto")]:
        if n == "auto":
            (kind, n), why = auto(draft, draft_path, mode, costs, trees=kind == "tree")
            print(f"[{mode}] {why}", flush=True)
        shapes.append((kind, n))
    return shapes


def auto(draft, draft_path: str, mode: str, costs, trees: bool = True):
    """`auto`: this draft's held-out statistics for mode (selector or unary; export.read_acceptance) and
    this machine's costs -> choose(...)."""
    from export import read_acceptance
    B = draft.config.block_size
    stats = (read_acceptance(draft_path, B) or {}).get(mode)
    if stats is None:
        return choose(None, None, None, B, trees)
    sizes = [n for n in priced_sizes(B) if n <= B or trees and "rank" in stats]
    return choose(*costs(sizes, mode), stats, B, trees)


def choose(costs: dict, draft_ms: dict, stats, B: int, trees: bool = True):
    """The verify shape predicted fastest on this machine -> ((kind, n), one line saying why).

    costs {n: ms of a target forward of n tokens} (cost.py's decode table), draft_ms {L: ms of the draft's
    forward, its head over slots 1..L and its proposal} for L = 1..B-1, stats: one mode's acceptance
    statistics (expected_tau), or None. A cycle that verifies n drafts, L = min(n, B-1) slots deep, costs
    costs[n + 1] + draft_ms[L] and commits expected_tau tokens. Candidates: the paths of
    1..B-1 drafts and, with trees, a tree of every budget the table prices. A tree is taken only where
    it beats the best path: a budget that cannot pay here falls back to the path. Without statistics
    the choice is the path of B-1 drafts, as before `auto` existed. Speculation stays on even where the
    prediction loses to plain decoding (the line says so): generate.py --compare measures that."""
    if stats is None:
        return ("path", B - 1), f"auto: {label(('path', B - 1))} (no acceptance statistics recorded with this draft)"
    shapes = [("path", k) for k in range(1, B) if k + 1 in costs]
    if not shapes or 1 not in costs:
        raise ValueError(f"the cost table prices {sorted(costs)} tokens: a path needs 1 and 2..{B}")
    if trees and "rank" in stats:
        shapes += [("tree", n - 1) for n in sorted(costs) if n >= 3]
    taus = {s: expected_tau(stats, s[1], s[0] == "tree") for s in shapes}
    drafting = {s: draft_ms[min(s[1], B - 1)] for s in shapes}               # the slots it scores: its depth
    rate = {s: taus[s] / (costs[s[1] + 1] + drafting[s]) for s in shapes}    # tokens per ms
    path = max((s for s in shapes if s[0] == "path"), key=rate.get)
    best = max(shapes, key=lambda s: (rate[s], s[0] == "path"))               # a tie goes to the path
    plain = 1 / costs[1]
    why = (f"auto: {label(best)}: expected tau {taus[best]:.2f} per {costs[best[1] + 1] + drafting[best]:.1f} ms cycle "
           f"({best[1] + 1}-token target forward {costs[best[1] + 1]:.1f} + draft {drafting[best]:.1f}) = "
           f"{1000 * rate[best]:.1f} tok/s predicted, {rate[best] / plain:.2f}x plain ({1000 * plain:.1f} tok/s)")
    if best != path:
        why += f"; best path: {path[1]} drafts, tau {taus[path]:.2f}, {1000 * rate[path]:.1f} tok/s"
    elif any(s[0] == "tree" for s in shapes):
        why += "; no tree beats it here"
    return best, why + ("; speculation does not pay here by this prediction" if rate[best] <= plain else "")
