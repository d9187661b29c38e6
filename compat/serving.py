"""What the serving engines ask of an exported draft, said when it is exported rather than when an
engine refuses it or, worse, runs it wrong.

llama.cpp's DFlash2 loader (src/models/dflash.cpp at b11434) refuses a draft whose hidden size H is
not divisible by conv_group_size G, or is below K (K + 1), K = selector_top_k (the selector
lattice). export.py warns, tools/llamacpp.py refuses.

SGLang's --speculative-num-draft-tokens must be the draft's block size B, vLLM's
num_speculative_tokens B - 1 (slot 0 is the anchor); a mismatch "runs silently wrong" (a public
DFlash2 model card, SGLang 0.5.23). export.py prints both.
"""


def llamacpp_refusal(c):
    """Why llama.cpp's DFlash2 loader would refuse a draft of config c, in one line; None where it
    loads it (a plain DFlash draft has no selector and no such rule)."""
    if not c.dflash2:
        return None
    H, G, K = c.hidden_size, c.conv_group_size, c.selector_top_k
    why = []
    if H % G:
        why.append(f"hidden_size {H} is not divisible by conv_group_size {G}")
    if H < K * (K + 1):
        why.append(
            f"hidden_size {H} is below K (K + 1) = {K * (K + 1)} for selector_top_k K = {K} "
            "(too small for the selector lattice)"
        )
    if not why:
        return None
    return f"llama.cpp's DFlash2 loader refuses this draft: {'; '.join(why)}"


def serving_flags(c) -> str:
    """The serving flags that must match the draft's block size B."""
    B = c.block_size
    return (
        f"serve it with block size {B}: SGLang --speculative-num-draft-tokens {B}, "
        f"vLLM num_speculative_tokens {B - 1}"
    )
