"""Candidate selector: DFlash2's second addition (docs/semantics.md, section 2.2).

A DFlash draft scores every block slot on its own ("unary" logits u_j), so its greedy proposal can
pick tokens that are each likely but do not fit together. The selector keeps the K best unary
candidates per slot and adds a low-rank score for the transition from the previous token:

    s_j(p -> c) = u_j[c] + < A[p] * (P h_j), Bs[c] >          A, Bs: [V, r] codebooks, P: H -> r

then walks the block from the anchor, choosing one candidate per slot given the previous choice.
The draft forward stays one parallel pass; only this tiny walk over K x K scores is sequential.
Because Bs starts at zero, a fresh selector walks exactly the unary argmax path.
"""

import torch
import torch.nn as nn

# The default K of the unary top-K: the published DFlash2 drafts' selector_top_k (Z Lab's Qwen3-8B
# config), used where a draft has none of its own (a plain DFlash draft's metrics, its tree).
TOP_K = 16


def unary_transform(z: torch.Tensor, output_multiplier=None, softcap=None) -> torch.Tensor:
    """The draft's unary scores from raw lm_head logits: u = m * z, then u = c * tanh(u / c)."""
    if output_multiplier is not None:
        z = z * output_multiplier
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def top_k_candidates(u: torch.Tensor, k: int):
    """u [..., V] -> (scores [..., K], ids [..., K]), sorted by unary score, best first."""
    return torch.topk(u, k, dim=-1, sorted=True)


class CandidateSelector(nn.Module):
    def __init__(
        self, hidden_size: int, vocab_size: int, rank: int, top_k: int, initializer_range: float
    ):
        super().__init__()
        self.top_k, self.initializer_range = top_k, initializer_range
        # Bare parameters: their checkpoint keys carry no ".weight" suffix (docs/semantics.md,
        # section 3).
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # A
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # Bs
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)  # P
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        nn.init.normal_(self.predecessor_codebook, std=self.initializer_range)
        nn.init.normal_(self.hidden_projection.weight, std=self.initializer_range)
        self.successor_codebook.zero_()  # a fresh selector reproduces the unary argmax exactly

    def edge_scores(self, h, prev_ids, cand_ids, cand_scores):
        """Scores of every (predecessor, candidate) pair at each slot.

        h [..., H] final draft hidden state; prev_ids [..., P]; cand_ids, cand_scores [..., K]
        -> [..., P, K] with [..., p, c] = cand_scores[c] + < A[prev p] * P h, Bs[cand c] >.
        """
        g = self.hidden_projection(h)  # [..., r]
        left = self.predecessor_codebook[prev_ids] * g.unsqueeze(-2)  # [..., P, r]
        right = self.successor_codebook[cand_ids]  # [..., K, r]
        return cand_scores.unsqueeze(-2) + left @ right.transpose(-1, -2)

    def teacher_forced_scores(self, h, prev_ids, cand_ids, cand_scores):
        """K-way scores given one known predecessor per slot: prev_ids [...] -> [..., K]."""
        return self.edge_scores(h, prev_ids.unsqueeze(-1), cand_ids, cand_scores).squeeze(-2)

    def lattice(self, h, anchor, cand_ids, cand_scores):
        """All edge scores of a block at once.

        h [N, B-1, H], anchor [N], cand_ids / cand_scores [N, B-1, K] -> [N, B-1, K, K], where
        [n, j, p, c] scores candidate c of slot j+1 after candidate p of slot j. Slot 1's only
        predecessor is the anchor, so all K rows of [n, 0] are the anchor's row.
        """
        K = cand_ids.shape[-1]
        # [N, B-1, K]
        prev = torch.cat([anchor[:, None, None].expand(-1, 1, K), cand_ids[:, :-1]], dim=1)
        return self.edge_scores(h, prev, cand_ids, cand_scores)

    def walk(self, lattice, cand_ids, temperature: float = 0.0, generator=None):
        """Walk the lattice from the anchor, one slot at a time.

        Greedy (temperature 0): c_j = argmax_c s_j(c_{j-1} -> c). Otherwise sample from
        softmax(s_j(c_{j-1} -> .) / temperature) and record that distribution q_j over the K
        candidates, which lossless verification needs. Returns (ids [N, B-1], q [N, B-1, K]);
        greedy rows of q are one-hot.
        """
        N, L, K, _ = lattice.shape
        rows = torch.arange(N, device=lattice.device)
        # slot 1: any row (all equal)
        prev = torch.zeros(N, dtype=torch.long, device=lattice.device)
        picks, qs = [], []
        for j in range(L):
            s = lattice[rows, j, prev].float()  # [N, K] scores after prev
            if temperature > 0:
                q = torch.softmax(s / temperature, dim=-1)
                prev = torch.multinomial(q, 1, generator=generator).squeeze(-1)
            else:
                prev = s.argmax(dim=-1)
                q = torch.nn.functional.one_hot(prev, K).float()
            picks.append(prev)
            qs.append(q)
        picks = torch.stack(picks, dim=1)  # [N, B-1] indices into K
        return cand_ids.gather(-1, picks[..., None]).squeeze(-1), torch.stack(qs, dim=1)

    def propose(self, h, u, anchor, temperature: float = 0.0, generator=None, walk="sequential"):
        """One block's proposal: h [N, B-1, H], unary u [N, B-1, V], anchor [N] -> (ids, q,
        cand_ids). walk: a name in WALKS (generate.py --walk)."""
        cand_scores, cand_ids = top_k_candidates(u, self.top_k)
        lattice = self.lattice(h, anchor, cand_ids, cand_scores)
        ids, q = WALKS[walk](self, lattice, cand_ids, temperature, generator)
        return ids, q, cand_ids


# The walks a proposal can take: a walk of your own is a function with walk's arguments (the
# selector first) and its name here; generate.py --walk takes every name (docs/speculation.md).
WALKS = {"sequential": CandidateSelector.walk}
