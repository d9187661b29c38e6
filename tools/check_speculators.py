"""Cross-check with the real speculators library: its DFlash2DraftModel.from_pretrained loads this
project's `export.py --format speculators` output and computes the same block.

It needs speculators==0.9.0, which pins transformers<=5.19, so it runs in a virtual environment of
its own and never in the test run (test_all.py tests the format without speculators):

    python3 -m venv /work/venv-spec && /work/venv-spec/bin/pip install torch==2.13.0
    echo 'torch==2.13.0' > /tmp/c.txt
    /work/venv-spec/bin/pip install -c /tmp/c.txt speculators==0.9.0
    # their operator registration breaks transformers:
    /work/venv-spec/bin/pip uninstall -y torchvision torchaudio
    /work/venv-spec/bin/python tools/check_speculators.py

A tiny random Qwen3 target is saved to a temporary directory and named as the verifier, so
speculators reloads embed_tokens / lm_head from it as it does from a hub model. A random DFlash2
draft (every parameter non-trivial, convolutions and selector included) is exported in fp32 with
`export.py`. One block at one anchor then runs through this project's inference and training paths,
and through speculators' `_backbone_forward` (its training forward up to the logits) with a loss
mask that admits only that anchor. Printed: the largest absolute difference of the final hidden
states and of the unary logits, per layout. The last layout uses a sliding window shorter than the
context, where the two definitions differ on purpose (speculators counts the window from the anchor,
this project from the query).
"""

import contextlib
import io
import os
import sys
import tempfile
import warnings

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on a hub
# the project's modules
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import export  # noqa: E402
import model  # noqa: E402
from model import DraftConfig  # noqa: E402

S, ANCHOR = 24, 13  # sequence length; the block sits at positions 13..20
LAYOUTS = {  # name -> draft config fields
    "sliding + full layers, is_causal false": dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=64,
        is_causal=False,
    ),
    "all sliding, is_causal unset (causal)": dict(
        layer_types=["sliding_attention"] * 3, sliding_window=64
    ),
    "all full, yarn rope_parameters": dict(
        layer_types=["full_attention"] * 3,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "window 8 < context (differs by definition)": dict(
        layer_types=["sliding_attention"] * 3, sliding_window=8
    ),
}


def tiny_target(path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            initializer_range=0.2,
        )
    ).eval()
    target.save_pretrained(path)
    return target


def random_draft(**kw):
    c = DraftConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=96,
        num_target_layers=4,
        target_layer_ids=[0, 2, 3],
        mask_token_id=95,
        block_size=8,
        rope_theta=10000.0,
        max_position_embeddings=256,
        conv_kernel_size=2,
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=5,
        **kw,
    )
    draft, g = model.DraftModel(c), torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return draft.eval()


def ours(draft, target, ids, feats):
    """This project's block at ANCHOR: hidden states of the inference and training paths, unary
    logits."""
    embed, head = target.get_input_embeddings(), target.lm_head
    cache = model.ContextCache()
    cache.append(draft, feats[:, :ANCHOR], torch.arange(ANCHOR)[None])
    h_inf = model.forward_inference(draft, embed, cache, ids[:, ANCHOR], torch.tensor([ANCHOR]))[0]
    h_train = model.forward_training(draft, embed, ids, feats, torch.tensor([[ANCHOR]]))[0, 0]
    return h_inf, h_train, draft.unary_logits(h_inf, head)


def theirs(spec, ids, feats, hidden):
    """speculators' block at ANCHOR: its training forward up to the logits, one anchor admitted."""
    loss_mask = torch.zeros(1, S, dtype=torch.long)
    loss_mask[0, ANCHOR] = 1
    h, logits, *_ = spec._backbone_forward(
        feats,
        ids,
        loss_mask,
        torch.zeros(1, S, hidden),
        torch.zeros(1, S, dtype=torch.long),
        max_anchors=1,
    )
    return h[0], logits[0]


def main():
    from loguru import logger  # speculators logs every verifier file it opens
    from speculators.models.dflash2 import DFlash2DraftModel
    from transformers.utils import logging

    logger.disable("speculators")
    logging.disable_progress_bar()
    # CPU: unfused, same math
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        target = tiny_target(os.path.join(tmp, "target"))
        ids = torch.randint(0, 95, (1, S), generator=torch.Generator().manual_seed(2))
        out = target(ids, output_hidden_states=True)
        print(
            "speculators DFlash2DraftModel.from_pretrained vs this project, fp32, block 8 at "
            f"anchor {ANCHOR}"
        )
        for name, kw in LAYOUTS.items():
            draft = random_draft(**kw)
            feats = torch.cat([out.hidden_states[i + 1] for i in draft.config.target_layer_ids], -1)
            src, dst = os.path.join(tmp, "zlab"), os.path.join(tmp, "spec")
            export.save_draft(draft, src)
            with contextlib.redirect_stdout(io.StringIO()):
                export.main(
                    [
                        src,
                        "--out-dir",
                        dst,
                        "--dtype",
                        "fp32",
                        "--format",
                        "speculators",
                        "--verifier",
                        os.path.join(tmp, "target"),
                    ]
                )
            spec = DFlash2DraftModel.from_pretrained(dst).eval()
            h_inf, h_train, u = ours(draft, target, ids, feats)
            h_spec, u_spec = theirs(spec, ids, feats, draft.config.hidden_size)
            print(
                f"  {name}: hidden max |diff| inference {(h_inf - h_spec).abs().max():.2e}, "
                f"training {(h_train - h_spec).abs().max():.2e}; unary logits "
                f"{(u - u_spec).abs().max():.2e} (logits up to {u.abs().max():.1f})"
            )


if __name__ == "__main__":
    main()
