"""Support: the code around the method that a reader learning DFlash2 can skip. The top level holds
the method and the pipeline (README.md, "Reading order"); these files serve them.

    conversations.py  JSONL conversations in four formats, chat templates, loss-mask spans
    features.py       the offline feature shards prepare.py writes and train.py streams
    target.py         load the target (the embedded SmolLM2 too), check a draft fits it, prompts
    kernels.py        attention kernels: dense SDPA (memory-safe on CUDA), FlexAttention, compile
    loader.py         data.py's batches made ahead (DataLoader workers, pinned), static shapes
    metrics.py        acceptance statistics beside the loss; acceptance.json
    show.py           the cycle's watch: --show, --show-svg, --compare, the statistics and clock
    draw.py           hand-written SVG: the walkthrough's figures, --show-svg (tools/plot.py too)
    promptsets.py     the built-in prompt sets, read from files inside PyPI wheels
    regen.py          prepare.py --regenerate's records: resume, rank merge, fidelity report
    regen_server.py   regeneration through OpenAI-compatible servers (prepare.py --server)
    distributed.py    torchrun's ranks: start them, end them, agree on a number
    fsdp.py           FSDP2 sharding of the draft and the online target; the whole state to save
    compiling.py      train.py's attention choice, the guard where something compiles, graphs
    flops.py          tokens, anchors and FLOPs a second; MFU on a GPU; compile time apart
    tracking.py       train.py's log.jsonl and final report; read_log for the tools
    common.py         dtypes, atomic writes, bounded argparse types, --help, UsageError and run()
"""
