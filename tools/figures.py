"""The walkthrough's figures: sections 1, 2, 4 and 5 of walkthrough.py, the same seeded numbers
it prints, drawn as SVG by support/draw.py (docs/walkthrough.md shows them).

    python -m tools.figures docs/figures
"""

import argparse
import os

import torch

import attention
import tree
import walkthrough as W
from selector import top_k_candidates
from support import draw
from support.common import run


@torch.no_grad()
def pictures(out_dir: str) -> list:
    """Sections 1, 2, 4 and 5 drawn from the walkthrough's seeded objects -> the files written."""
    quiet = lambda line: None
    ids, loss_mask, _ = W.training_row(quiet, W.tiny_target())
    _, queries, context = W.blocks(quiet, ids)
    _, q_pos, q_block, q_doc = queries
    keys = attention.attention_keys(q_pos, q_block, q_doc, *context)
    masks = {
        f"{kind} layer": attention.block_attention_mask(queries, keys, causal=causal)[0, 0].tolist()
        for kind, causal in (("a full-attention", False), ("a causal", True))
    }
    row = [x[0].tolist() for x in (ids, loss_mask, q_pos, q_block)]
    reads = W.convolution(quiet)  # [out row, in row]
    sel, h, u, anchor = W.selector_story()
    cand_scores, cand_ids = top_k_candidates(u, sel.top_k)  # [1, L, K]
    lattice = sel.lattice(h, anchor, cand_ids, cand_scores)  # [1, L, K, K]
    walk, _ = sel.walk(lattice, cand_ids)
    cands = cand_ids[0].tolist()
    index = lambda ids: [cands[j].index(x) for j, x in enumerate(ids)]  # into each slot's K
    words = [[W.WORDS[c] for c in r] for r in cands]  # [L][K]
    scores = cand_scores[0].tolist(), lattice[0].tolist()  # unary [L][K], edges [L][K][K]
    paths = index(walk[0].tolist()), index(u.argmax(-1)[0].tolist())  # the walk, the unary path
    t = W.story_tree(quiet, lattice, cand_ids, int(anchor))
    # a scripted target, which continues "New Jersey Devils Times" after any prefix of it
    says = {"": "Jersey", "Jersey": "Devils", "Jersey Devils": "Times"}
    logits, above = torch.zeros(len(t.tokens), len(W.WORDS)), t.ancestors()  # [node, V], [n, n]
    for i in range(len(t.tokens)):
        prefix = [x for j, x in enumerate(t.tokens) if j > 0 and above[i, j]]  # node i's path
        logits[i, W.WORDS.index(says.get(W.words(prefix), "Times"))] = 1.0
    path, bonus = tree.follow_target(t, logits, lambda r: int(r.argmax()))
    lattice_title = (
        'The selector\'s lattice (K = 2, rank 1), anchor "New": the walk and the unary path'
    )
    tree_title = 'The tree of 4 nodes (tree.grow), walked by a target that says "New Jersey Devils"'
    texts = [W.WORDS[x] for x in t.tokens]
    drawn = {
        "blocks.svg": draw.blocks(*row, W.B, masks),
        "conv.svg": draw.conv_taps(reads.tolist(), W.B, T=int(reads.sum(1).max())),
        "selector.svg": draw.lattice("New", words, *scores, *paths, lattice_title),
        "tree.svg": draw.story_tree(
            t, texts, path, W.WORDS[bonus], edge_probs(t, lattice[0], cands), tree_title
        ),
    }
    os.makedirs(out_dir, exist_ok=True)
    for name, svg in drawn.items():
        svg.save(os.path.join(out_dir, name))
    return [os.path.join(out_dir, name) for name in drawn]


def edge_probs(t, lattice, cands) -> list:
    """Each node's edge probability softmax_K(s(parent -> .)) at its own candidate (the anchor: 1):
    lattice [L, K, K], cands [L][K] token ids; tree.grow scores a node by their product's log."""
    q = torch.softmax(lattice, dim=-1)  # [slot, parent's candidate, K]
    k = lambda i: 0 if i == 0 else cands[t.depths[i] - 1].index(t.tokens[i])  # among K
    return [1.0] + [
        q[t.depths[i] - 1, k(t.parents[i]), k(i)].item() for i in range(1, len(t.tokens))
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description="Draw the walkthrough's figures as SVG.")
    ap.add_argument("dir", help="the folder to write them to (docs/figures holds today's)")
    args = ap.parse_args(argv)
    for path in pictures(args.dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    run(main)
