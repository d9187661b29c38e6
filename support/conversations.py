"""Conversations: JSONL lines in four formats (read_conversations) -> chat-template text (render)
-> token ids with a loss mask on the assistant's tokens (tokenize_conversation).
"""

import json
import os

import torch

from support.common import UsageError

# One JSONL line is one sample, in one of four formats (docs/training.md, "Data formats"):
#   {"messages": [turn]}            OpenAI, UltraChat
#   {"conversations": [turn]}       SpecForge (role / content turns), ShareGPT (from / value turns)
#   {"text": "..."}                 SpecForge's preformatted: already through the chat template
#   {"input_ids", "loss_mask"}      pre-tokenized, supervised where loss_mask is 1
# A turn is {"role", "content"} or {"from", "value"}; its role one of ROLES, never guessed.
ROLES = dict(user="user", human="user", assistant="assistant", gpt="assistant", system="system")
FORMATS = ("messages", "conversations", "text", "input_ids")
TURN_KEYS = (("role", "content"), ("from", "value"))


def to_turn(t) -> dict:
    """One turn -> {"role", "content"}, plus the "token_ids" a regenerated answer keeps."""
    keys = [k for k in TURN_KEYS if isinstance(t, dict) and (k[0] in t or k[1] in t)]
    if len(keys) != 1 or not all(isinstance(t.get(k), str) for k in keys[0]):
        raise UsageError(
            "each turn needs strings 'role' and 'content' (OpenAI, SpecForge) or 'from' and "
            f"'value' (ShareGPT); got {str(t)[:80]}"
        )
    (role_key, text_key) = keys[0]
    if t[role_key] not in ROLES:
        raise UsageError(f"unknown role {t[role_key]!r} (known: {', '.join(sorted(ROLES))})")
    turn = {"role": ROLES[t[role_key]], "content": t[text_key]}
    if "token_ids" in t:
        turn["token_ids"] = int_list(t["token_ids"], "token_ids")
    return turn


def int_list(values, name: str) -> list:
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        raise UsageError(f"{name!r} must be a list of token ids (integers >= 0)")
    return values


def to_conversation(record):
    """One JSONL record -> turns, {"text"} or {"input_ids", "loss_mask"}; nothing is guessed."""
    found = [k for k in FORMATS if isinstance(record, dict) and k in record]
    if len(found) != 1:
        raise UsageError(
            f"has both {found[0]!r} and {found[1]!r}: one format a line"
            if found
            else 'expected an object with "messages" (OpenAI), "conversations" (SpecForge, '
            'ShareGPT), "text" (preformatted) or "input_ids" + "loss_mask" (pre-tokenized)'
        )
    if found[0] == "text":
        if not isinstance(record["text"], str) or not record["text"]:
            raise UsageError("'text' must be a non-empty string, the conversation as rendered")
        return {"text": record["text"]}
    if found[0] == "input_ids":
        ids = int_list(record["input_ids"], "input_ids")
        mask = record.get("loss_mask")
        if not isinstance(mask, list) or len(mask) != len(ids) or set(mask) - {0, 1}:
            raise UsageError("'loss_mask' must be a list of 0 / 1, one per input id")
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "loss_mask": torch.tensor(mask, dtype=torch.long),
        }
    turns = record[found[0]]
    if not isinstance(turns, list):
        raise UsageError("the conversation must be a list of turns")
    out = [to_turn(t) for t in turns]
    with_ids = [i for i, m in enumerate(out) if "token_ids" in m]
    if with_ids and (with_ids != [len(out) - 1] or out[-1]["role"] != "assistant"):
        raise UsageError("'token_ids' belong to the last turn, an answer, only")
    return out


def check_template_kwargs(made, wanted):
    """Data rendered with template kwargs `made` is read with the same (None: not recorded): a
    Qwen3 answer with and without thinking are different texts."""
    if made is not None and wanted is not None and made != wanted:
        raise UsageError(
            f"made with --chat-template-kwargs '{json.dumps(made)}', this run asks for "
            f"'{json.dumps(wanted)}'; pass the same"
        )


def nothing_to_learn(conv, require_assistant: bool) -> bool:
    if isinstance(conv, list):
        return not conv or (require_assistant and all(m["role"] != "assistant" for m in conv))
    if "text" in conv:
        return False  # its answers are found when it is tokenized (preformatted_spans)
    return not len(conv["input_ids"]) or (require_assistant and not conv["loss_mask"].any())


def read_conversations(
    path: str, require_assistant: bool = True, chat_template_kwargs=None, need_turns=False
):
    """JSONL -> (conversations, how many had nothing to learn); rendered lines keep "where"."""
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such file (a conversations JSONL)")
    conversations, skipped = [], 0
    with open(path, "rb") as f:  # decoded line by line, so a line that is not UTF-8 is named
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
                conv = to_conversation(record)
                check_template_kwargs(record.get("chat_template_kwargs"), chat_template_kwargs)
                if need_turns and isinstance(conv, dict):
                    raise UsageError(
                        '--regenerate needs the prompts as turns ("messages" or '
                        '"conversations"); this line is already rendered'
                    )
            except (UnicodeDecodeError, json.JSONDecodeError, UsageError) as e:
                raise UsageError(f"{path}, line {n}: {e}") from None
            if nothing_to_learn(conv, require_assistant):
                skipped += 1
            elif isinstance(conv, dict):
                conversations.append({**conv, "where": f"{path}, line {n}"})
            else:
                conversations.append(conv)
    return conversations, skipped


# ----------------------------------------------------------------------------- tokenisation
def render(tokenizer, messages, generation_prompt=False, chat_template_kwargs=None) -> str:
    """The one place a chat template is applied, so that its kwargs reach every use."""
    return tokenizer.apply_chat_template(
        [{k: v for k, v in m.items() if k != "token_ids"} for m in messages],
        tokenize=False,
        add_generation_prompt=generation_prompt,
        **(chat_template_kwargs or {}),
    )


def assistant_spans(tokenizer, messages, chat_template_kwargs=None):
    """(text, [(start, end)]): each answer's span is what rendering it adds after the generation
    prompt, trailing whitespace left out; a template that renders a prefix otherwise (Qwen3 drops
    earlier thinking) cannot be split."""
    kw = chat_template_kwargs
    text, spans = render(tokenizer, messages, chat_template_kwargs=kw), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:  # an opening assistant turn answers nothing
            continue
        head = render(tokenizer, messages[:i], True, kw)
        turn = render(tokenizer, messages[: i + 1], chat_template_kwargs=kw)
        if not (turn.startswith(head) and text.startswith(turn)):
            raise UsageError(
                f"the chat template renders the conversation up to message {i} differently "
                "from the whole conversation; use single-turn data (--regenerate does)"
            )
        spans.append((len(head), len(head) + len(turn[len(head) :].rstrip())))
    return text, spans


PROBE = "PROBE-ANSWER"  # an answer's content, to find what a chat template writes around it


def assistant_markers(tokenizer, chat_template_kwargs=None) -> tuple:
    """(header, end): what the chat template writes around an answer, from a probe answer."""
    kw, user = chat_template_kwargs, [{"role": "user", "content": "PROBE-QUESTION"}]
    before, prompt = render(tokenizer, user, False, kw), render(tokenizer, user, True, kw)
    whole = render(tokenizer, user + [{"role": "assistant", "content": PROBE}], False, kw)
    header, end = prompt[len(before) :], whole[len(prompt) + len(PROBE) :].rstrip()
    if not (prompt.startswith(before) and whole.startswith(prompt + PROBE) and header and end):
        raise UsageError(
            "this chat template's assistant header and end-of-turn marker cannot be found (a probe "
            "answer is not rendered as header + content + marker): preformatted text cannot be "
            "split into turns; give the conversations as 'messages'"
        )
    return header, end


def preformatted_spans(tokenizer, conversation, chat_template_kwargs=None):
    """assistant_spans of a {"text"}: each header to the next end-of-turn marker (or the end)."""
    header, end = assistant_markers(tokenizer, chat_template_kwargs)
    text, spans = conversation["text"], []
    at = text.find(header)
    if at < 0:
        raise UsageError(
            f"{conversation.get('where', 'preformatted text')}: no {header!r} in the text: it was "
            "not rendered with this target's chat template (and --chat-template-kwargs), or holds "
            "no answer"
        )
    while at >= 0:
        stop = text.find(end, at + len(header))
        spans.append((at + len(header), len(text) if stop < 0 else stop + len(end)))
        at = text.find(header, spans[-1][1])
    return text, spans


def spans_to_tokens(tokenizer, text, spans):
    """Rendered text and its answers' character spans -> input_ids [S], loss_mask [S] (long)."""
    # no BOS added: the template wrote any, and apply_chat_template tokenizes so too
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    starts = torch.tensor([a for a, _ in enc["offset_mapping"]], dtype=torch.long)
    mask = torch.zeros_like(ids)
    for a, b in spans:  # a token belongs to the turn its first character is in
        mask |= ((starts >= a) & (starts < b)).long()
    return ids, mask


def generated_tokens(tokenizer, messages, chat_template_kwargs=None):
    """The prompt, then the answer's token_ids: re-tokenizing its text could split a word."""
    *prompt, answer = messages
    if tokenizer.decode(answer["token_ids"], skip_special_tokens=True) != answer["content"]:
        raise UsageError(
            f"an answer's token_ids do not spell its content with this tokenizer (made for another "
            f"target?): {answer['content'][:60]!r}; drop its 'token_ids' to re-tokenize the text"
        )
    head = render(tokenizer, prompt, True, chat_template_kwargs)
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    ids = torch.tensor(head_ids + answer["token_ids"], dtype=torch.long)
    return ids, (torch.arange(len(ids)) >= len(head_ids)).long()


def tokenize_conversation(tokenizer, conversation, max_length: int, chat_template_kwargs=None):
    """A read_conversations item -> input_ids [S], loss_mask [S] (long), S <= max_length."""
    kw = chat_template_kwargs
    if isinstance(conversation, dict) and "input_ids" in conversation:
        ids, mask = conversation["input_ids"], conversation["loss_mask"]
        if len(ids) and int(ids.max()) >= len(tokenizer):
            raise UsageError(
                f"{conversation.get('where', 'pre-tokenized sample')}: token id {int(ids.max())} "
                f"is outside this target's vocabulary ({len(tokenizer)} ids): tokenized for "
                "another model?"
            )
    elif isinstance(conversation, dict):
        ids, mask = spans_to_tokens(tokenizer, *preformatted_spans(tokenizer, conversation, kw))
    elif "token_ids" in conversation[-1]:
        ids, mask = generated_tokens(tokenizer, conversation, kw)
    else:
        ids, mask = spans_to_tokens(tokenizer, *assistant_spans(tokenizer, conversation, kw))
    return ids[:max_length], mask[:max_length]


def generated_answer(tokenizer, ids: list) -> dict:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return {"role": "assistant", "content": text, "token_ids": ids}


def retokenized_differs(tokenizer, messages, chat_template_kwargs=None):
    """Whether re-tokenizing an answer's text changes its token_ids (compared as a prefix: a cut
    answer has no end-of-turn); None where the template splits no turn."""
    *prompt, answer = messages
    plain = [*prompt, {"role": "assistant", "content": answer["content"]}]
    try:
        text, spans = assistant_spans(tokenizer, plain, chat_template_kwargs)
    except UsageError:
        return None
    ids, mask = spans_to_tokens(tokenizer, text, spans[-1:])
    return ids[mask.bool()].tolist()[: len(answer["token_ids"])] != answer["token_ids"]
