"""Compatibility: what keeps this project's drafts exchangeable with the public implementations. A
reader learning DFlash2 can skip this package; compat/config_json.py and export.py call into it.

    config_checks.py  every rule a config.json must satisfy (docs/semantics.md, section 3), the
                      refusals of fields this code does not implement, and the RoPE rules.
    speculators.py    the second public checkpoint format, vllm-project/speculators' config.json,
                      read and written (`export.py --format speculators`).
"""
