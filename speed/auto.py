"""`auto`: the verify shape (a path of k drafts or a tree of N nodes) predicted fastest here."""

import math

from support.metrics import read_acceptance
from support.show import label
from tree import grow

TREE_BUDGETS = (8, 16, 24, 32)  # the tree budgets `auto` prices besides the paths (priced_sizes)


# ---------------------------------------------------------------- choose: a path or a tree, how big
def expected_tau(stats: dict, budget: int, branch: bool) -> float:
    """Expected tau (accepted drafts + 1) of a path of `budget` drafts (branch False) or of a
    best-first tree of `budget` nodes, from one mode's held-out statistics (acceptance.json, written
    by train.py): stats["accepted"][d-1] = r_d, the share of blocks whose greedy path was right up
    to slot d, and stats["rank"][d-1][m] = rho_d(m), the share of slot-d labels that were the
    draft's candidate m (0: best).

    Path: E = 1 + r_1 + ... + r_k, exactly (a path cut at k accepts min(run, k) drafts).
    Tree, a model: given a right prefix, slot d's label is candidate m with probability rho'_d(m):
    rho_d rescaled so that the best candidate has the measured conditional rate a_d = r_d / r_{d-1},
    the others scaled alike (their sum at most 1 - a_d); slots independent. A node reached through
    candidates m_1..m_d is then accepted with probability prod_i rho'_i(m_i); the tree of budget n
    holds the n most likely nodes (grown best-first, as the draft's own trees are) and E = 1 + the
    sum of their probabilities. The draft's real trees follow its per-cycle scores instead, so this
    is an estimate."""
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
    # best first, ties by rank
    children = [[sorted(row, key=lambda e: -e[0])] for row in logs]
    t = grow([list(range(len(row))) for row in probs], children, budget)
    p = [1.0]
    for i in range(1, len(t.tokens)):
        p.append(p[t.parents[i]] * probs[t.depths[i] - 1][t.tokens[i]])
    return 1 + sum(p[1:])


def priced_sizes(B: int) -> list:
    """The target forwards `auto` prices: a plain step, every path (2..B tokens), every TREE_BUDGETS
    tree."""
    return sorted({*range(1, B + 1), *(n + 1 for n in TREE_BUDGETS)})


def plan(verify_tokens, tree_budget, draft, draft_path: str, mode: str, costs) -> list:
    """The values of --verify-tokens and --tree-budget (counts or "auto"; neither flag:
    --tree-budget auto)
    -> the verify shapes, ("path", k) or ("tree", n); each auto one is chosen now and said in one
    line. costs(sizes) -> ({n: ms of an n-token target forward}, the draft's ms): this machine's
    prices."""
    B = draft.config.block_size
    asked = [("path", v) for v in verify_tokens or []] + [("tree", v) for v in tree_budget or []]
    if any(kind == "path" and n != "auto" and n >= B for kind, n in asked):
        raise ValueError(
            f"--verify-tokens: at most {B - 1}, the drafts this draft proposes a cycle (block size "
            f"{B})"
        )
    shapes = []
    for kind, n in asked or [("tree", "auto")]:
        if n == "auto":
            (kind, n), why = auto(draft, draft_path, mode, costs, trees=kind == "tree")
            print(f"[{mode}] {why}", flush=True)
        shapes.append((kind, n))
    return shapes


def auto(draft, draft_path: str, mode: str, costs, trees: bool = True):
    """`auto`: this draft's held-out statistics for mode (selector or unary;
    metrics.read_acceptance) and this machine's costs -> choose(...)."""
    B = draft.config.block_size
    stats = (read_acceptance(draft_path, B) or {}).get(mode)
    if stats is None:
        return choose(None, None, None, B, trees)
    sizes = [n for n in priced_sizes(B) if n <= B or trees and "rank" in stats]
    return choose(*costs(sizes, mode), stats, B, trees)


def choose(costs: dict, draft_ms: dict, stats, B: int, trees: bool = True):
    """The verify shape predicted fastest on this machine -> ((kind, n), one line saying why).

    costs {n: ms of a target forward of n tokens} (cost.py's decode table), draft_ms {L: ms of the
    draft's forward, its head over slots 1..L and its proposal} for L = 1..B-1, stats: one mode's
    acceptance statistics (expected_tau), or None. A cycle that verifies n drafts, L = min(n, B-1)
    slots deep, costs costs[n + 1] + draft_ms[L] and commits expected_tau tokens. Candidates: the
    paths of 1..B-1 drafts and, with trees, a tree of every budget the table prices. A tree is taken
    only where it beats the best path: a budget that cannot pay here falls back to the path. Without
    statistics the choice is the path of B-1 drafts, as before `auto` existed. Speculation stays on
    even where the prediction loses to plain decoding (the line says so): generate.py --compare
    measures that."""
    if stats is None:
        return (
            "path",
            B - 1,
        ), f"auto: {label(('path', B - 1))} (no acceptance statistics recorded with this draft)"
    shapes = [("path", k) for k in range(1, B) if k + 1 in costs]
    if not shapes or 1 not in costs:
        raise ValueError(f"the cost table prices {sorted(costs)} tokens: a path needs 1 and 2..{B}")
    if trees and "rank" in stats:
        shapes += [("tree", n - 1) for n in sorted(costs) if n >= 3]
    taus = {s: expected_tau(stats, s[1], s[0] == "tree") for s in shapes}
    # the slots it scores: its depth
    drafting = {s: draft_ms[min(s[1], B - 1)] for s in shapes}
    rate = {s: taus[s] / (costs[s[1] + 1] + drafting[s]) for s in shapes}  # tokens per ms
    path = max((s for s in shapes if s[0] == "path"), key=rate.get)
    # a tie goes to the path
    best = max(shapes, key=lambda s: (rate[s], s[0] == "path"))
    plain = 1 / costs[1]
    why = (
        f"auto: {label(best)}: expected tau {taus[best]:.2f} per "
        f"{costs[best[1] + 1] + drafting[best]:.1f} ms cycle ({best[1] + 1}-token target forward "
        f"{costs[best[1] + 1]:.1f} + draft {drafting[best]:.1f}) = {1000 * rate[best]:.1f} tok/s "
        f"predicted, {rate[best] / plain:.2f}x plain ({1000 * plain:.1f} tok/s)"
    )
    if best != path:
        why += f"; best path: {path[1]} drafts, tau {taus[path]:.2f}, {1000 * rate[path]:.1f} tok/s"
    elif any(s[0] == "tree" for s in shapes):
        why += "; no tree beats it here"
    return best, why + (
        "; speculation does not pay here by this prediction" if rate[best] <= plain else ""
    )
