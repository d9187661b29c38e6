"""Scaled RoPE (rope_parameters with rope_type yarn, llama3 or linear), from transformers' own
initialisation functions, given the Qwen3 config a public loader builds from the same config.json:
so the frequencies are the ones Z Lab and speculators use. The one place the draft reads
transformers; model.py writes plain RoPE out and takes a scaled one from its config, whose
scaled_rope compat/config_json.py fills with this when it reads a config.json.
"""

import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import model


def scaled_rope(c: model.DraftConfig) -> tuple:
    """(inverse frequencies [head_dim / 2] fp32, factor on cos and sin) of c.rope_scaling."""
    # on the CPU: the same bits wherever the draft is built (`with torch.device("meta")`, a GPU)
    with torch.device("cpu"):
        hf = Qwen3Config(
            hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads,
            head_dim=c.head_dim,
            max_position_embeddings=c.max_position_embeddings,
            rope_parameters={"rope_theta": c.rope_theta, **c.rope_scaling},
        )
        inv_freq, scale = ROPE_INIT_FUNCTIONS[c.rope_scaling["rope_type"]](hf, torch.device("cpu"))
    return inv_freq.float(), float(scale)  # yarn's scale is its attention factor; 1 for the others
