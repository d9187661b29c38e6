"""prepare.py --regenerate's bookkeeping: the settings that shape an answer, the results files and
their resume, the answers from servers, the rank merge and the token-fidelity report.

    OUT/regenerated.rank{r}.jsonl   rank r's answers as they come, one record (answer_record) a line
    OUT/conversations.jsonl         every rank's answers in prompt order, usable as --data

A rerun asks only for the prompts with no answer yet, and refuses other settings than the done ones.
"""

import json
import os

from tqdm import tqdm

from support import regen_server
from support.common import UsageError, atomic_write
from support.conversations import generated_answer, retokenized_differs


# ----------------------------------------------------------------------------- settings
def settings(chat_template_kwargs=None, temperature=0.0, seed=0) -> dict:
    """What shapes a regenerated answer's text, as each record and conversations.jsonl keep it."""
    return dict(chat_template_kwargs=chat_template_kwargs or {}, temperature=temperature, seed=seed)


def settings_of(record) -> dict:
    """The settings a record was made with, as a resume compares them (older records: greedy)."""
    temperature = record.get("temperature", 0.0)
    return {
        "chat_template_kwargs": record.get("chat_template_kwargs", {}),
        "temperature": temperature,
        "seed": record.get("seed") if temperature > 0 else None,
    }


def answer_record(index: int, prompt: list, ids: list, finished: bool, tokenizer, made: dict):
    """One results line: the target's answer ids (finished: it ended its turn, else cut)."""
    messages = prompt + [generated_answer(tokenizer, ids)]
    return {
        "index": index,
        "messages": messages,
        "finished": finished,
        **made,
        "retokenized_differs": retokenized_differs(
            tokenizer, messages, made["chat_template_kwargs"]
        ),
    }


# ----------------------------------------------------------------------------- resume
def read_regenerated(out_dir: str, own: str = None) -> dict:
    """{index: record} from every rank's file (the world size may change between runs)."""
    done = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("regenerated.rank") and name.endswith(".jsonl"):
            with open(os.path.join(out_dir, name), "rb") as f:
                data = f.read()
            # a last line cut short by a crash is left out, and cut off this rank's own file
            complete = data[: data.rfind(b"\n") + 1]
            if name == own and len(complete) < len(data):
                os.truncate(os.path.join(out_dir, name), len(complete))
            done.update((r["index"], r) for r in map(json.loads, complete.splitlines()))
    return done


def pending(out_dir: str, n: int, rank: int, world: int, made: dict):
    """(this rank's unanswered prompt indices, its file); done ones must share made's settings."""
    own, wanted = f"regenerated.rank{rank}.jsonl", settings_of(made)
    done = read_regenerated(out_dir, own)
    for record in done.values():
        if settings_of(record) != wanted:  # the data would mix two distributions
            raise UsageError(
                f"{out_dir}: its regenerated.rank*.jsonl answers were made with "
                f"{settings_of(record)}, this run asks for {wanted}; use a new --out-dir or the "
                "same flags"
            )
    return [i for i in range(rank, n, world) if i not in done], own


# ----------------------------------------------------------------------------- servers
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
    """prepare.regenerate() on servers; a failure keeps the answers already written."""
    made = settings(chat_template_kwargs, temperature, seed)
    todo, own = pending(out_dir, len(prompts), rank, world, made)
    answers = regen_server.regenerate(
        {i: prompts[i] for i in todo}, tokenizer, servers, made, max_new_tokens, **client
    )
    path, kept, desc = os.path.join(out_dir, own), 0, f"regenerate on {len(servers)} server(s)"
    with (
        open(path, "a", encoding="utf-8") as f,
        tqdm(total=len(todo), desc=desc, disable=not todo) as bar,
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


# ----------------------------------------------------------------------------- merge and report
def merge_regenerated(out_dir: str, n: int) -> list:
    """All ranks' regenerated conversations, in prompt order."""
    done = read_regenerated(out_dir)
    missing = [i for i in range(n) if i not in done]
    if missing:
        raise RuntimeError(
            f"{len(missing)} prompts have no regenerated answer yet (first: {missing[:5]})"
        )
    return [done[i]["messages"] for i in range(n)]


def write_conversations(out_dir: str, conversations: list, made: dict):
    """All answers in one file, OUT/conversations.jsonl, readable by --data for later runs."""
    path = os.path.join(out_dir, "conversations.jsonl")
    with atomic_write(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(
            json.dumps({"index": i, "messages": m, **made}, ensure_ascii=False) + "\n"
            for i, m in enumerate(conversations)
        )


def fidelity(records) -> str:
    """How far the supervised tokens of regenerated records are the target's own, as lines."""
    records = list(records)
    with_ids = [r for r in records if "token_ids" in r["messages"][-1]]
    lines = []
    if with_ids:
        d = sum(bool(r.get("retokenized_differs")) for r in with_ids)
        n = sum(r.get("retokenized_differs") is None for r in with_ids)
        unknown = f"; {n} could not be compared (the template splits no turns)" if n else ""
        lines.append(
            f"{len(with_ids)} answers keep the target's generated token ids and are supervised as "
            f"those; re-tokenizing their text would change {d} ({100 * d / len(with_ids):.1f}%)"
            + unknown
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
