"""Compatibility: what keeps this project's drafts exchangeable with the public implementations,
called by whatever reads or writes a config.json or a draft's tensors, never by the mechanism files.

    config_json.py    config.json <-> DraftConfig, the one door of the mechanism's config
    config_checks.py  every rule a config.json must satisfy (docs/semantics.md, section 3)
    serving.py        what SGLang, vLLM and llama.cpp need of an export, said at export time
    shards.py         a draft's safetensors: one file written; one, or shards and their index, read
    speculators.py    vllm-project/speculators' checkpoint format, read and written
"""
