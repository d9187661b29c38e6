"""Break the method on purpose, one rule at a time, and check that `pytest -m method` notices
(docs/mutants.md: what a break is, the CI subset, the last full run).

    python -m tools.mutants                  # every break: caught / survived / equivalent, per file
    python -m tools.mutants --ci             # the CI subset (a few minutes on 2 cores)

A break (Break below) replaces a snippet that occurs exactly once in a mechanism file, and names the
rule of docs/semantics.md it breaks and the tests that pin that rule. Exit status 1 if a
non-equivalent break survives, or is caught only by tests other than the ones it names; 2 on a
usage error. The tests run in forked children of one process that has imported torch and
transformers once, so a break costs its tests, not a fresh interpreter; the property tests draw the
examples of -m method without shrinking a failing one (test_all.py's "mutants" profile).
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ("conv.py", "selector.py", "attention.py", "model.py", "loss.py", "decoding.py", "tree.py")


@dataclass
class Break:
    file: str
    old: str  # must occur exactly once in file
    new: str
    rule: str  # a key of RULES
    tests: tuple  # the pinning tests, at least one of which must fail
    why: str  # what the break means
    source: str = "rule"  # rule, "exercise N" (docs/walkthrough.md), mutmut
    equivalent: str = None  # why no test can tell it from the original
    ci: bool = False  # part of the --ci subset


# The rules: docs/semantics.md section, and a phrase of the rule's text (up to its Pinned by line).
RULES = {
    "input": ("1", "the embedded block is multiplied by it"),
    "rope": ("1", "RoPE uses absolute positions"),
    "attention rule": ("1", "may read key k if"),
    "output": ("1", "The final `norm`, then the target's frozen `lm_head`"),
    "slot 0": ("1", "Slot 0 is input only"),
    "two paths": ("1", "The training path (many blocks flattened"),
    "fresh = DFlash": ("2", "Both modules start as exact no-ops"),
    "conv": ("2.1", "conv(x, beta, d)[i, c]"),
    "selector": ("2.2", "C_j = TopK(u_j), sorted best first"),
    "selector init": ("2.2", "With Bs = 0 the transition term vanishes"),
    "feature layers": ("3", "are 0-based decoder layers whose"),
    "packed rows": ("4", "Several conversations share a row"),
    "labels": ("4", "Slot j of the block at anchor a is labelled"),
    "position weights": ("4", "Either a fixed decay"),
    "base loss": ("4", "on the unary distribution q = softmax(u)"),
    "selector loss": ("4", "the teacher-forced predecessor"),
    "total": ("4", "One denominator, D = sum w"),
    "schedule": ("4", "Over the optimizer steps t"),
    "cycle": ("5", "The acceptance length of a cycle"),
    "trees": ("5", "a cycle may verify a tree of N nodes"),
}

T_TRAIN_INF = "test_training_forward_equals_inference_per_block"
T_RULE = "test_block_equals_the_rule_written_out"
T_CONV = "test_conv_equals_explicit_loop"
T_SEL = "test_selector_scores_equal_formula"
T_LATTICE = "test_lattice_rows_match_the_sequential_walk"
T_BASE = "test_base_losses_worked_example"
T_SELLOSS = "test_selector_loss_strict_and_replace"
T_LOSSLESS = "test_greedy_speculative_equals_target_greedy"
T_SCRIPTED = "test_always_right_always_wrong_and_partial_drafts"
T_CONTEXT = "test_draft_context_equals_a_fresh_prefill_every_cycle"
T_GROW = "test_grow_best_first_by_hand"
T_TREE_MASK = "test_tree_mask_gives_each_node_its_path_and_keeps_only_the_accepted_rows"

# One break per entry, its snippets side by side: not reflowed by ruff format.
# fmt: off
BREAKS = [
    # ------------------------------------------------------------------------------------ conv.py
    Break("conv.py", "inside = (slot >= t)", "inside = (slot >= 0)", "conv",
          ("test_conv_never_crosses_block_boundary",), "taps cross the block boundary",
          "exercise 1", ci=True),
    Break("conv.py", "\n        self.kernel_projection.weight.zero_()", "", "fresh = DFlash",
          ("test_conv_identity_at_init_is_exact",), "the projection keeps nn.Linear's init",
          "exercise 2", ci=True),
    Break("conv.py", "self.base_kernel[:, 0, :] = 1.0", "self.base_kernel[:, -1, :] = 1.0",
          "fresh = DFlash", ("test_conv_identity_at_init_is_exact",),
          "the identity tap is the last one"),
    Break("conv.py", "delta.repeat_interleave(self.group_size, dim=-1)",
          "delta.repeat(1, 1, 1, 1, self.group_size)", "conv", (T_CONV,),
          "channel c reads group c mod (H/G), not c // G", ci=True),
    Break("conv.py", ".view(N, S, 2, T, Gn)", ".view(N, S, 2, Gn, T).transpose(-1, -2)", "conv",
          (T_CONV,), "the projection's flat index is side, group, tap"),
    Break("conv.py",
          "self.convolve(a, k[0]), *args), k[1])",
          "self.convolve(a, k[1]), *args), k[0])",
          "conv", (T_CONV,), "pre and post kernels swapped"),
    Break("conv.py", "pad(x, (0, 0, t, 0))[:, :S]", "pad(x, (0, 0, 0, t))[:, t:]", "conv",
          (T_CONV,), "taps read later slots, x[i + t]"),
    Break("conv.py", "return self.base_kernel[:, None, None] + delta",
          "return self.base_kernel[:, None, None].detach() + delta", "conv",
          ("test_conv_gradients_reach_both_parameters",), "base_kernel gets no gradient"),
    # -------------------------------------------------------------------------------- selector.py
    Break("selector.py", "return cand_scores.unsqueeze(-2) + left @ right.transpose(-1, -2)",
          "return left @ right.transpose(-1, -2)", "selector", (T_SEL,),
          "the edge score loses its unary term", "exercise 3", ci=True),
    Break("selector.py", "lattice[rows, j, prev]", "lattice[rows, j, 0]", "selector", (T_LATTICE,),
          "the walk ignores the previous pick", "exercise 4", ci=True),
    Break("selector.py", "self.successor_codebook.zero_()",
          "nn.init.normal_(self.successor_codebook, std=self.initializer_range)", "selector init",
          ("test_fresh_selector_is_exactly_the_unary_scores",),
          "Bs starts random, as Speculators 0.9.0 does", "exercise 5", ci=True),
    Break("selector.py", "z = softcap * torch.tanh(z / softcap)", "z = torch.tanh(z / softcap)",
          "output", ("test_unary_transform_formula",), "softcap without its scale"),
    Break("selector.py", "z = z * output_multiplier", "z = z / output_multiplier", "output",
          ("test_unary_transform_formula",), "the multiplier divides"),
    Break("selector.py", "torch.topk(u, k, dim=-1, sorted=True)",
          "torch.topk(u, k, dim=-1, largest=False, sorted=True)", "selector",
          ("test_fresh_selector_walk_is_unary_argmax",), "the K worst candidates"),
    Break("selector.py", "anchor[:, None, None].expand(-1, 1, K)", "cand_ids[:, :1]", "selector",
          (T_LATTICE,), "slot 1's predecessor is its own best candidate, not the anchor"),
    Break("selector.py", "cand_ids[:, :-1]], dim=1)", "cand_ids[:, 1:]], dim=1)", "selector",
          (T_LATTICE,), "slot j+1's predecessors are slot j+2's candidates"),
    Break("selector.py", "torch.softmax(s / temperature, dim=-1)", "torch.softmax(s, dim=-1)",
          "selector", ("test_sampling_walk_distribution",), "sampling ignores the temperature"),
    Break("selector.py", "self.predecessor_codebook[prev_ids] * g.unsqueeze(-2)",
          "self.predecessor_codebook[prev_ids]", "selector", (T_SEL,),
          "the transition ignores the draft's state P h"),
    Break("selector.py", "right = self.successor_codebook[cand_ids]",
          "right = self.predecessor_codebook[cand_ids]", "selector", (T_SEL,),
          "the candidate side reads A, not Bs"),
    # selector.py and conv.py: the mutants of mutmut 3.8 that survived -m method and are real breaks
    # (docs/mutants.md lists the equivalent ones, with reasons)
    Break("conv.py", "torch.arange(S, device=x.device) % self.block_size",
          "torch.arange(S) % self.block_size", "conv", ("test_conv_runs_on_its_inputs_device",),
          "the slot index is built on the CPU, whatever the input's device", "mutmut"),
    Break("selector.py", "torch.topk(u, k, dim=-1, sorted=True)",
          "torch.topk(u, k, dim=-1, sorted=False)", "selector",
          ("test_top_k_candidates_sorted_best_first",),
          "the K candidates in no particular order", "mutmut"),
    Break("selector.py", "prev = torch.multinomial(q, 1, generator=generator)",
          "prev = torch.multinomial(q, 1, generator=None)", "selector",
          ("test_selector_samples_from_the_generator_it_is_given",),
          "the walk samples from the global generator", "mutmut"),
    Break("selector.py", "cand_ids, temperature, generator\n",
          "cand_ids, temperature, None\n", "selector",
          ("test_selector_samples_from_the_generator_it_is_given",),
          "propose drops the caller's generator", "mutmut"),
    # ------------------------------------------------------------------------------- attention.py
    Break("attention.py", "k_pos < q_anchor", "k_pos <= q_anchor", "attention rule",
          (T_TRAIN_INF, T_RULE), "blocks see their anchor's features", "exercise 6", ci=True),
    Break("attention.py", "blk = blk & (k_pos <= q_pos)", "blk = blk", "attention rule",
          (T_RULE,), "every layer bidirectional in the block", "exercise 7", ci=True),
    Break("attention.py", "see & (k_pos > q_pos - window)", "see & (k_pos >= q_pos - window)",
          "attention rule", (T_RULE,), "the window holds W + 1 positions", ci=True),
    Break("attention.py", "(k_doc == q_doc) & ", "", "packed rows",
          ("test_packed_row_equals_its_documents",), "context of other documents is read",
          ci=True),
    Break("attention.py", "blk = blk & (k_pos <= q_pos)", "blk = blk & (k_pos < q_pos)",
          "attention rule", (T_RULE,), "a causal query does not read itself"),
    Break("attention.py", "blk = k_block == q_block", "blk = k_block >= 0", "attention rule",
          (T_TRAIN_INF,), "blocks read each other"),
    Break("attention.py", "torch.full_like(ctx_pos, -1)", "torch.zeros_like(ctx_pos)",
          "attention rule", (T_TRAIN_INF,), "context rows count as rows of block 0"),
    # ----------------------------------------------------------------------------------- model.py
    Break("model.py",
          "q_pos = (anchor_pos[:, :, None] + j)",
          "q_pos = (anchor_pos[:, :, None] + j + 1)",
          "two paths", (T_TRAIN_INF,), "training blocks shifted by one position", "exercise 8",
          ci=True),
    Break("model.py", "return sliding if self.is_causal is None else self.is_causal",
          "return (not sliding) if self.is_causal is None else self.is_causal", "attention rule",
          (T_RULE,), "unset is_causal: full layers causal, sliding ones not", ci=True),
    Break("model.py", "h = x if c.input_embedding_scale is None else x * c.input_embedding_scale",
          "h = x", "input", (T_RULE,), "input_embedding_scale ignored", ci=True),
    Break("model.py", "torch.cat([-x2, x1], -1)", "torch.cat([x2, -x1], -1)", "rope", (T_RULE,),
          "RoPE rotates the other way", ci=True),
    Break("model.py", "torch.arange(0, D, 2, dtype=torch.int64).float() / D",
          "torch.arange(0, D, 2, dtype=torch.int64).float() / (2 * D)", "rope", (T_RULE,),
          "RoPE frequencies of the wrong base"),
    Break("model.py",
          "k = self.k_norm(self.k_proj(x).view(N, L, self.nkv, self.hd)).transpose(1, 2)",
          "k = self.k_proj(x).view(N, L, self.nkv, self.hd).transpose(1, 2)", "two paths",
          (T_RULE,), "keys without k_norm"),
    Break("model.py", "ctx = self.hidden_norm(self.fc(features.to(dtype)))",
          "ctx = self.fc(features.to(dtype))", "two paths", (T_RULE,),
          "the context skips hidden_norm"),
    Break("model.py", "q_anchor = anchor_pos.repeat_interleave(block_size, dim=1)",
          "q_anchor = q_pos", "two paths", (T_TRAIN_INF,),
          "training queries read context up to their own position"),
    Break("model.py", "block_ids[:, 0] = anchor_ids", "block_ids[:, 0] = c.mask_token_id",
          "two paths", (T_TRAIN_INF,), "the inference block has no anchor token"),
    Break("model.py", "if isinstance(m, (GroupedDynamicCausalConv, CandidateSelector)):",
          "if isinstance(m, CandidateSelector):", "fresh = DFlash",
          ("test_conv_identity_at_init_is_exact", "test_dflash2_at_init_equals_plain_dflash"),
          "the generic init pass overwrites the conv's identity"),
    Break("model.py", "grabbed[key] = out[0] if isinstance(out, tuple) else out",
          "grabbed[key] = args[0]", "feature layers",
          ("test_capture_features_reads_layer_outputs_in_list_order",),
          "features are the layers' inputs, hidden_states[id]", ci=True),
    Break("model.py", "torch.cat([grabbed[i] for i in layer_ids], dim=-1)",
          "torch.cat([grabbed[i] for i in sorted(layer_ids)], dim=-1)", "feature layers",
          ("test_capture_features_reads_layer_outputs_in_list_order",),
          "features in layer order, not list order"),
    Break("model.py", "(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))",
          "(torch.cat([k1, k0], 2), torch.cat([v1, v0], 2))", "two paths", (T_TRAIN_INF,),
          "the cache appends keys before the old ones, positions after"),
    Break("model.py", "return h + self.mlp_conv(", "return self.mlp_conv(", "two paths",
          (T_RULE,), "the MLP's residual is dropped"),
    Break("model.py", "q_anchor = anchor_pos[:, None].expand(N, B)",
          "q_anchor = anchor_pos[:, None] + torch.arange(B, device=anchor_ids.device)",
          "two paths", (T_TRAIN_INF,), "inference queries read context up to their position",
          equivalent="the cache holds context before the anchor only, so at inference k_pos < "
          "q_anchor and k_pos < q_pos select the same rows"),
    # ------------------------------------------------------------------------------------ loss.py
    Break("loss.py", "w0 = anchor_valid[..., None].float() * inside.float() * mask",
          "w0 = anchor_valid[..., None].float() * inside.float()", "labels",
          ("test_block_labels_by_hand",), "unsupervised labels count", "exercise 11", ci=True),
    Break("loss.py", "torch.exp(-j / gamma)", "torch.exp(-(j + 1) / gamma)", "position weights",
          (T_BASE,), "decay starts at slot 0"),
    Break("loss.py", "{16: 7.0, 10: 5.0, 8: 4.0}", "{16: 7.0, 10: 5.0, 8: 5.0}",
          "position weights", ("test_default_gamma_by_block_size",),
          "B = 8 decays with gamma 5, not 4", ci=True),
    Break("loss.py", "(1 - alpha) * q + alpha", "alpha * q + (1 - alpha)", "position weights",
          ("test_dpace_weights_formula", "test_dpace_weights_with_alpha_not_one_half"),
          "D-PACE's alpha weighs q (the same at alpha 0.5)", ci=True),
    Break("loss.py", "(P * w0).flip(-1).cumsum(-1).flip(-1)", "(P * w0).cumsum(-1)",
          "position weights", ("test_dpace_weights_formula",),
          "D-PACE credit summed over past slots, not future ones"),
    Break("loss.py", "w0 > 0, (1 - alpha) * q + alpha, torch.ones_like(q)",
          "w0 > 0, (1 - alpha) * q + alpha, torch.zeros_like(q)", "position weights",
          ("test_dpace_weights_formula",), "an unsupervised slot ends the block's survival"),
    Break("loss.py",
          "base = (w * BASE_LOSSES[cfg.loss](s, w0)).sum()",
          "base = (w0 * BASE_LOSSES[cfg.loss](s, w0)).sum()",
          "base loss", (T_BASE,), "ce without position weights"),
    Break("loss.py", "torch.minimum(logp.exp(), logq.exp()).sum(-1)",
          "torch.maximum(logp.exp(), logq.exp()).sum(-1)", "base loss", (T_BASE,),
          "accepted mass is sum max(p, q)"),
    Break("loss.py", "kl = (logp.exp() * (logp - logq)).sum(-1)",
          "kl = (logq.exp() * (logq - logp)).sum(-1)", "base loss",
          ("test_kl_is_target_to_draft_by_hand",), "KL(q || p) instead of KL(p || q)", ci=True),
    Break("loss.py", "lam * ce(s, w0) + (1 - lam) * tv(s, w0)",
          "(1 - lam) * ce(s, w0) + lam * tv(s, w0)", "base loss", (T_BASE,),
          "lk's lambda weighs tv"),
    Break("loss.py", "BASE_LOSSES[cfg.loss](s, w0)).sum()", "BASE_LOSSES[cfg.loss](s, w)).sum()",
          "base loss", (T_BASE,), "lk's lambda from position-weighted accepted mass"),
    Break("loss.py", "(anchors[..., None] + torch.arange(L, device=anchors.device))",
          "(anchors[..., None] + 1 + torch.arange(L, device=anchors.device))", "base loss",
          (T_BASE,), "the target's state at a+j, which predicts x[a+j+1]"),
    Break("loss.py", "counted = hit.any(-1) & (w0 > 0)", "counted = w0 > 0", "selector loss",
          (T_SELLOSS,), "strict counts uncovered labels too"),
    Break("loss.py", "torch.arange(K, device=cand_ids.device) == K - 1",
          "torch.arange(K, device=cand_ids.device) == 0", "selector loss", (T_SELLOSS,),
          "replace takes the best candidate's place"),
    Break("loss.py",
          "cand_scores = torch.where(replaced, label_score[..., None], cand_scores)",
          "cand_scores = cand_scores", "selector loss", (T_SELLOSS,),
          "a replaced label keeps the weakest candidate's score"),
    Break("loss.py",
          "hidden, cand_scores = h.detach(), cand_scores.detach()",
          "hidden, cand_scores = h.detach(), cand_scores",
          "selector loss", ("test_selector_gradients_and_stop_gradient",),
          "stop-gradient lets the selector's CE reach the backbone through u"),
    Break("loss.py", "s.label_score.detach() if cfg.stop_gradient",
          "s.label_score if cfg.stop_gradient", "selector loss",
          ("test_selector_gradients_and_stop_gradient",),
          "stop-gradient lets a replaced label's score reach the backbone"),
    Break("loss.py", "w_sel = w if", "w_sel = w0 if", "total", (T_SELLOSS,),
          "the selector term without the position weights", ci=True),
    Break("loss.py", "alpha_t * (out.selector * scale)", "alpha_t * (out.selector)",
          "total", ("test_selector_weighting_exp_and_uniform",),
          "uniform's selector term divided by the shared D, not its own D_sel", ci=True),
    Break("loss.py", "else (w0 > 0).float()", "else w", "total",
          ("test_selector_weighting_exp_and_uniform",), "uniform keeps the exp weights"),
    Break("loss.py", "return tokens[..., 1:], tokens[..., :-1], w0[..., 1:]",
          "return tokens[..., 1:], tokens[..., 1:], w0[..., 1:]", "selector loss",
          ("test_block_labels_by_hand",), "the teacher predecessor is the label itself"),
    Break("loss.py", "h = h[:, :, 1:]", "h = h[:, :, :-1]", "slot 0",
          (T_BASE,), "slot j's hidden state scores label x[a+j+1]"),
    Break("loss.py", "out.numerator = base + alpha_t * (",
          "out.numerator = base + (", "total",
          ("test_selector_gradients_and_stop_gradient",), "alpha_t ignored"),
    Break("loss.py", "alpha * min((step - W + 1) / R, 1.0)", "alpha * min((step - W) / R, 1.0)",
          "schedule", ("test_selector_alpha_schedule",), "the ramp starts a step late"),
    Break("loss.py",
          "W, R = math.floor(total_steps * warmup)",
          "W, R = math.ceil(total_steps * warmup)",
          "schedule", ("test_selector_alpha_schedule_rounds_down",),
          "warmup rounds up (the same when T_tot * warmup is whole)", ci=True),
    Break("loss.py",
          "t[:, s : s + chunk] for t in (h, labels, target_hidden)",
          "t[:, s : s + chunk][:, :-1] for t in (h, labels, target_hidden)",
          "total", ("test_property_chunked_objective_equals_unchunked",),
          "each chunk drops its last anchor (the slots' numbers no longer line up with w)"),
    # -------------------------------------------------------------------------------- decoding.py
    Break("decoding.py", "return r / r.sum() if r.sum() > 0 else p", "return p", "cycle",
          ("test_rejection_sampling_reproduces_target_distribution",),
          "the correction is drawn from p, not the residual", "exercise 12", ci=True),
    Break("decoding.py", "min(1.0, float(p[d] / q[d]))", "min(1.0, float(q[d] / p[d]))", "cycle",
          ("test_acceptance_rule_hand_computed",), "accept with q / p"),
    Break("decoding.py", "r = (p - q).clamp_min(0)", "r = (p - q).abs()", "cycle",
          ("test_acceptance_rule_hand_computed",), "the residual keeps |p - q|"),
    Break("decoding.py", "int(torch.multinomial(p[-1], 1, generator=generator))",
          "int(torch.multinomial(p[0], 1, generator=generator))", "cycle",
          ("test_acceptance_rule_hand_computed",), "the bonus after all drafts comes from row 0"),
    Break("decoding.py", "if d != best[j]), len(drafts))", "if d != best[j]), len(drafts) - 1)",
          "cycle", (T_SCRIPTED,), "a fully accepted block drops its last draft"),
    Break("decoding.py", "crop(cache, s + a + 1)", "crop(cache, s + a + 2)", "cycle",
          (T_LOSSLESS, T_SCRIPTED), "the target keeps a rejected draft's cache row", ci=True),
    Break("decoding.py", "feats[:, : a + 1], s)", "feats[:, : a + 2], s)", "cycle", (T_CONTEXT,),
          "the draft's context gains a rejected draft's features", ci=True),
    Break("decoding.py", "torch.arange(start, start + feats.shape[1]",
          "torch.arange(start + 1, start + 1 + feats.shape[1]", "cycle", (T_CONTEXT,),
          "context rows one position late"),
    Break("decoding.py", "new = new[: stop + 1]", "new = new[:stop]", "cycle", (T_LOSSLESS,),
          "the stop token itself is not committed"),
    Break("decoding.py", "q = probs(u, temperature)", "q = probs(u, 1.0)", "cycle",
          ("test_proposal_q_is_the_distribution_drafts_are_drawn_from",),
          "unary drafts sampled at temperature 1"),
    Break("decoding.py", "u = draft.unary_logits(h[:, : L + 1], head)[:, 1:]",
          "u = draft.unary_logits(h[:, :L], head)", "slot 0",
          ("test_cycle_scores_slots_one_to_k",), "the cycle scores slots 0..k-1", ci=True),
    # ------------------------------------------------------------------------------------ tree.py
    Break("tree.py", "anc[i] |= anc[self.parents[i]]", "anc[i, self.parents[i]] = True", "trees",
          (T_GROW,), "ancestors are only parents", "exercise 9", ci=True),
    Break("tree.py", "score = parent_score + row[rank][0]", "score = row[rank][0]", "trees",
          (T_GROW,), "a node scores its last edge only", "exercise 10", ci=True),
    Break("tree.py",
          "(s + depth[:, None]) - past[None] < W",
          "(s + depth[:, None]) - past[None] <= W",
          "trees", (T_TREE_MASK,), "the tree's window holds W + 1 positions"),
    Break("tree.py", "push(node.parent_score, node.parent, node.depth, node.p, node.rank + 1)",
          "push(-node.neg_score, node.parent, node.depth, node.p, node.rank + 1)", "trees",
          (T_GROW,), "a sibling scores from its elder sibling's path"),
    Break("tree.py", "node = child.get((node, token))", "node = child.get((0, token))", "trees",
          ("test_tree_walk_by_hand",), "the walk looks for the token among the anchor's children "
          "(with a scripted draft, decoding loops forever)"),
    Break("tree.py", "if rows == list(range(len(rows))):", "if True:", "trees", (T_TREE_MASK,),
          "accepted rows are not moved to the front"),
    Break("tree.py", "extend_context(draft, ctx, feats[:, rows], s)",
          "extend_context(draft, ctx, feats[:, : len(rows)], s)", "trees",
          ("test_tree_cycle_draft_context_is_the_accepted_path",),
          "the draft's context takes the first rows, not the accepted nodes'", ci=True),
    Break("tree.py", "logp = torch.log_softmax(s, dim=-1)", "logp = s", "trees",
          ("test_draft_tree_scores_by_hand",), "a DFlash2 tree ranks by raw edge scores"),
    Break("tree.py", "logp = torch.log_softmax(u[0].float(), dim=-1).gather(",
          "logp = u[0].float().gather(", "trees", ("test_draft_tree_scores_by_hand",),
          "a DFlash tree ranks paths by summed raw logits"),
]
# fmt: on


# ------------------------------------------------------------------------------------ the checks
def pinned_names(rule: str) -> set:
    """The tests named on a rule's Pinned by line in docs/semantics.md: the first Pinned by at or
    after the paragraph of its section that holds its phrase."""
    section, phrase = RULES[rule]
    text = open(os.path.join(HERE, "docs", "semantics.md")).read()
    heading = re.compile(r"^#+ (\d+(?:\.\d+)?)\.? ", re.M)
    starts = [(m.group(1), m.start()) for m in heading.finditer(text)] + [("end", len(text))]
    span = next((a, b) for (s, a), (_, b) in zip(starts, starts[1:]) if s == section)
    paragraphs = [" ".join(p.split()) for p in text[span[0] : span[1]].split("\n\n")]
    phrase = " ".join(phrase.split())
    at = next((i for i, p in enumerate(paragraphs) if phrase in p), None)
    pinned = next((p for p in paragraphs[at or 0 :] if "**Pinned by**" in p), None)
    if at is None or pinned is None:
        raise SystemExit(
            f"error: rule {rule!r}: no paragraph of section {section} holds {phrase!r}"
        )
    return set(re.findall(r"`(test_\w+)`", pinned.split("**Pinned by**", 1)[1]))


def check(breaks) -> list:
    """Every break's snippet occurs once in its file; every rule is in docs/semantics.md. Returns
    the problems, one line each."""
    problems = []
    for n, b in enumerate(breaks, 1):
        text = open(os.path.join(HERE, b.file)).read()
        count = text.count(b.old)
        if count != 1:
            problems.append(
                f"break {n} ({b.file}: {b.why}): its snippet occurs {count} times: {b.old!r}"
            )
        if b.rule not in RULES:
            problems.append(f"break {n} ({b.file}: {b.why}): unknown rule {b.rule!r}")
    return problems


# ------------------------------------------------------------------------------------ the runner
def copy_repo(dest: str):
    """The repository's tracked and untracked (not ignored) files, without __pycache__."""
    names = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=HERE,
        capture_output=True,
        check=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, names):
        src = os.path.join(HERE, name)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, name))


class Failures:
    """A pytest plugin that writes the failing tests' names to a file, one a line."""

    def __init__(self, path):
        self.path = path

    def pytest_runtest_logreport(self, report):
        if report.failed:
            with open(self.path, "a") as f:
                f.write(report.nodeid.split("::")[-1].split("[")[0] + "\n")


def run_tests(repo: str, select, stop_first: bool, log: str, limit: int = 0) -> set:
    """pytest -m method [-k select, unless None] [-x] in a forked child that imports the project
    from repo -> the names of the failing tests (empty: all passed). With limit, the child is
    stopped after limit seconds, and the answer says so."""
    failed = os.path.join(repo, ".failed")
    if os.path.exists(failed):
        os.remove(failed)
    pid = os.fork()
    if pid == 0:  # the child: the project's modules are imported fresh, from the copy
        try:
            os.chdir(repo)
            sys.path[:] = [repo] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
            sys.dont_write_bytecode = True
            signal.alarm(limit)  # 0: none; else SIGALRM ends the child
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            import pytest

            args = ["-m", "method", "-q", "-p", "no:cacheprovider", "test_all.py"]
            args += ["-k", select] * bool(select) + ["-x"] * stop_first
            rc = pytest.main(args, plugins=[Failures(failed)])
            os._exit(0 if rc in (0, 5) else 1)  # 5: no test selected
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    names = set(open(failed).read().split()) if os.path.exists(failed) else set()
    if rc == -signal.SIGALRM:
        return names | {f"<timed out after {limit} s>"}
    if rc != 0 and not names:  # crashed before any test reported (an import error, a segfault)
        names = {f"<exit {rc}: {open(log).read()[-300:].strip()}>"}
    return names


def try_break(repo: str, b: Break, log: str, limit: int) -> tuple:
    """Apply b in repo, run its tests, then (if none failed) all of -m method; restore ->
    (failed tests, stage: 1 its own tests, 2 the whole subset, 0 survived)."""
    path = os.path.join(repo, b.file)
    original = open(path).read()
    try:
        with open(path, "w") as f:
            f.write(original.replace(b.old, b.new, 1))
        own = " or ".join(b.tests)
        failed = run_tests(repo, own, False, log, limit)
        if failed:
            return failed, 1
        failed = run_tests(repo, None, True, log, limit)
        return failed, (2 if failed else 0)
    finally:
        with open(path, "w") as f:
            f.write(original)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ci", action="store_true", help="only the CI subset")
    args = ap.parse_args(argv)
    breaks = [b for b in BREAKS if not args.ci or b.ci]
    problems = check(BREAKS)
    if problems:
        print("error: " + "\n       ".join(problems), file=sys.stderr)
        return 2
    stale = stale_pinned_lines(breaks)
    for line in stale:
        print(f"stale Pinned by: {line}")

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the property tests draw the examples of -m method, but a failing one is not shrunk
    os.environ.setdefault("DFLASH2_HYPOTHESIS", "mutants")
    import torch  # noqa: F401  imported once, before the forks: the children share it
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.mistral.modeling_mistral  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401
    from tqdm import tqdm

    results = []
    with tempfile.TemporaryDirectory(prefix="dflash2-mutants-") as repo:
        copy_repo(repo)
        log = os.path.join(repo, ".log")
        t0 = time.time()
        failed = run_tests(repo, None, False, log)
        if failed:
            print(
                f"error: -m method fails without any break: {', '.join(sorted(failed))}; "
                f"see its log:\n{open(log).read()[-2000:]}",
                file=sys.stderr,
            )
            return 1
        baseline = time.time() - t0
        limit = max(60, round(5 * baseline))
        print(f"baseline: -m method passes ({baseline:.0f} s); a run is stopped after {limit} s")
        for b in tqdm(breaks, desc="breaks", unit="break", file=sys.stdout):
            failed, stage = try_break(repo, b, log, limit)
            results.append((b, failed, stage))
    return report(results) or int(bool(stale))


def stale_pinned_lines(breaks) -> list:
    """A break's tests that its rule's Pinned by line in docs/semantics.md does not name."""
    out = []
    for b in breaks:
        missing = [t for t in b.tests if t not in pinned_names(b.rule)]
        if missing and not b.equivalent:
            out.append(f"{b.file}: {b.why}: rule {b.rule!r} does not name {', '.join(missing)}")
    return out


def report(results) -> int:
    bad = []
    print(
        "\nbreak by break (caught: the tests that failed; stage 2: caught by the rest of -m method)"
    )
    for b, failed, stage in results:
        if b.equivalent:
            status = "equivalent" if not failed else "CAUGHT, listed as equivalent"
        else:
            status = ("caught" if stage == 1 else "caught at stage 2") if failed else "SURVIVED"
        if status != "caught" and status != "equivalent":
            bad.append(b)
        tests = ", ".join(sorted(failed)) if failed else "-"
        print(f"  {b.file:12} {status:28} {b.why}  [{tests}]")
    print(f"\n  {'file':12} {'breaks':>6} {'caught':>6} {'survived':>8} {'equivalent':>10}")
    for name in (*FILES, "all"):
        mine = [(b, f) for b, f, _ in results if name in (b.file, "all")]
        if mine:
            caught = sum(1 for b, f in mine if f and not b.equivalent)
            surv = sum(1 for b, f in mine if not f and not b.equivalent)
            eq = sum(1 for b, f in mine if b.equivalent)
            print(f"  {name:12} {len(mine):6} {caught:6} {surv:8} {eq:10}")
    if bad:
        print(f"\n{len(bad)} break(s) not caught as listed: see above")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
