"""Compatibility: what keeps this project's drafts exchangeable with the public implementations. A
reader learning DFlash2 can skip this package: what reads or writes a config.json or a draft's
tensors calls into it (train.py, prepare.py, export.py, tools/gpu_check.py, tools/llamacpp.py),
never the mechanism files.

    config_json.py    config.json <-> DraftConfig, the one door of the mechanism's config
    config_checks.py  every rule a config.json must satisfy (docs/semantics.md, section 3), the
                      refusals of fields this code does not implement, and the RoPE rules.
    serving.py        what SGLang, vLLM and llama.cpp need of an export, said at export time
    shards.py         a draft's safetensors: one file written; one, or shards and their index, read
    speculators.py    the second public checkpoint format, vllm-project/speculators' config.json,
                      read and written (`export.py --format speculators`).
"""
