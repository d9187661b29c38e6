"""Training data: from conversations to the batch a training step reads (docs/semantics.md, section
4).

    JSONL lines: turns, preformatted text or token ids (4 formats)  ->  read_conversations
    -> the target's chat template; loss_mask = 1 on assistant tokens    tokenize_conversation
    -> where a block may start                                          anchor_positions
    -> rows (one conversation, or with --pack several), anchors, padding   plan_rows, collate
    -> static shapes for compiled steps; made ahead by DataLoader workers  static_shapes, loader

prepare.py makes the data (on-policy answers, offline features: features.py); train.py reads it back
with load_samples and turns rows into batches with collate.

A row is one conversation, or with `train.py --pack` several of them (documents) filled greedily up
to --max-length tokens, so that a batch of conversations of mixed lengths is not mostly padding. A
packed row trains exactly as its documents would one per row (a test checks hidden states, loss,
metrics and gradients):

    positions   restart at 0 in every document (RoPE sees each conversation as it was)
    anchors     a block starts at p only if p and p+1 are supervised and in the same document
    labels      a block's labels end at its document's end (loss.block_labels, docs)
    attention   a block reads the context of its own document only (attention.attention_rule)
    target      online, the target reads each conversation on its own (per_document)
"""

import json
import os

import torch

from features import load_features, read_manifest

# ----------------------------------------------------------------------------- conversations
# One JSONL line is one sample, in one of four formats (docs/training.md, "Data formats"):
#   {"messages": [turn]}            OpenAI, UltraChat
#   {"conversations": [turn]}       SpecForge (role / content turns), ShareGPT (from / value turns)
#   {"text": "..."}                 SpecForge's preformatted: already through the chat template
#   {"input_ids", "loss_mask"}      pre-tokenized, supervised where loss_mask is 1
# A turn is {"role", "content"} or {"from", "value"}; its role one of ROLES, never guessed.
ROLES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "system": "system",
}
FORMATS = ("messages", "conversations", "text", "input_ids")
TURN_KEYS = (("role", "content"), ("from", "value"))


def to_turn(t) -> dict:
    """One turn -> {"role", "content"}, plus "token_ids" where given (the ids the target generated
    for an answer: prepare.py --regenerate keeps them). Raises ValueError saying what is wrong."""
    keys = [k for k in TURN_KEYS if isinstance(t, dict) and (k[0] in t or k[1] in t)]
    if len(keys) != 1 or not all(isinstance(t.get(k), str) for k in keys[0]):
        raise ValueError(
            "each turn needs strings 'role' and 'content' (OpenAI, SpecForge) or 'from' and "
            f"'value' (ShareGPT); got {str(t)[:80]}"
        )
    (role_key, text_key) = keys[0]
    if t[role_key] not in ROLES:
        raise ValueError(f"unknown role {t[role_key]!r} (known: {', '.join(sorted(ROLES))})")
    turn = {"role": ROLES[t[role_key]], "content": t[text_key]}
    if "token_ids" in t:
        turn["token_ids"] = int_list(t["token_ids"], "token_ids")
    return turn


def int_list(values, name: str) -> list:
    if not isinstance(values, list) or not all(type(v) is int and v >= 0 for v in values):
        raise ValueError(f"{name!r} must be a list of token ids (integers >= 0)")
    return values


def to_messages(record) -> list:
    """A "messages" or "conversations" record -> [{"role", "content"}]. Raises ValueError saying
    what is wrong."""
    turns = record.get("messages", record.get("conversations"))
    if not isinstance(turns, list):
        raise ValueError("the conversation must be a list of turns")
    out = [to_turn(t) for t in turns]
    with_ids = [i for i, m in enumerate(out) if "token_ids" in m]
    if with_ids and (with_ids != [len(out) - 1] or out[-1]["role"] != "assistant"):
        raise ValueError("'token_ids' belong to the last turn, an answer, only")
    return out


def to_conversation(record):
    """One JSONL record -> a conversation: turns (to_messages), or for the two formats that are
    already rendered {"text"} (preformatted) or {"input_ids", "loss_mask"} (long tensors [S]).
    A record in none of the formats, or in two of them, is refused: nothing is guessed."""
    found = [k for k in FORMATS if isinstance(record, dict) and k in record]
    if len(found) != 1:
        raise ValueError(
            f"has both {found[0]!r} and {found[1]!r}: one format a line"
            if found
            else 'expected an object with "messages" (OpenAI), "conversations" (SpecForge, '
            'ShareGPT), "text" (preformatted) or "input_ids" + "loss_mask" (pre-tokenized)'
        )
    if found[0] == "text":
        if not isinstance(record["text"], str) or not record["text"]:
            raise ValueError("'text' must be a non-empty string, the conversation as rendered")
        return {"text": record["text"]}
    if found[0] == "input_ids":
        ids = int_list(record["input_ids"], "input_ids")
        mask = record.get("loss_mask")
        if not isinstance(mask, list) or len(mask) != len(ids) or set(mask) - {0, 1}:
            raise ValueError("'loss_mask' must be a list of 0 / 1, one per input id")
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "loss_mask": torch.tensor(mask, dtype=torch.long),
        }
    return to_messages(record)


def check_template_kwargs(made, wanted):
    """Data that says which chat template kwargs rendered it (`made`: prepare.py records them)
    must be read with the same: the draft learns the text it is trained on, and a Qwen3 answer with
    and without thinking are different texts. None: not recorded / not rendered here."""
    if made is not None and wanted is not None and made != wanted:
        raise ValueError(
            f"made with --chat-template-kwargs '{json.dumps(made)}', this run asks for "
            f"'{json.dumps(wanted)}'; pass the same"
        )


def nothing_to_learn(conv, require_assistant: bool) -> bool:
    """An empty conversation or, with require_assistant, one in which nothing is supervised."""
    if isinstance(conv, list):
        return not conv or (require_assistant and all(m["role"] != "assistant" for m in conv))
    if "text" in conv:
        return False  # its answers are found when it is tokenized (preformatted_spans)
    return not len(conv["input_ids"]) or (require_assistant and not conv["loss_mask"].any())


def read_conversations(
    path: str, require_assistant: bool = True, chat_template_kwargs=None, need_turns=False
):
    """JSONL -> (conversations, skipped), each as to_conversation gives it. A malformed line raises
    ValueError naming file and line; empty conversations, and when require_assistant those with
    nothing supervised (no assistant turn, a loss_mask of zeros), are skipped and counted.
    need_turns (--regenerate: the prompts are needed as turns) refuses the two rendered formats.
    With chat_template_kwargs (the answers will be rendered with them), a line regenerated with
    other kwargs is refused too (check_template_kwargs). A rendered line keeps where it came from
    ("where": file and line), for the errors found when it is tokenized."""
    conversations, skipped = [], 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                conv = to_conversation(record)
                check_template_kwargs(record.get("chat_template_kwargs"), chat_template_kwargs)
                if need_turns and isinstance(conv, dict):
                    raise ValueError(
                        '--regenerate needs the prompts as turns ("messages" or '
                        '"conversations"); this line is already rendered'
                    )
            except ValueError as e:  # json.JSONDecodeError is a ValueError too
                raise ValueError(f"{path}, line {n}: {e}") from None
            if nothing_to_learn(conv, require_assistant):
                skipped += 1
            elif isinstance(conv, dict):
                conversations.append({**conv, "where": f"{path}, line {n}"})
            else:
                conversations.append(conv)
    return conversations, skipped


# ----------------------------------------------------------------------------- tokenisation
def render(tokenizer, messages, generation_prompt=False, chat_template_kwargs=None) -> str:
    """The one place a chat template is applied (regeneration prompts, loss masks, online
    training, generate.py's prompts), so that its keyword arguments (Qwen3's enable_thinking)
    reach every one of them."""
    return tokenizer.apply_chat_template(
        [{k: v for k, v in m.items() if k != "token_ids"} for m in messages],
        tokenize=False,
        add_generation_prompt=generation_prompt,
        **(chat_template_kwargs or {}),
    )


def assistant_spans(tokenizer, messages, chat_template_kwargs=None):
    """(text, [(start, end)]): the rendered conversation and the character span of each answer.

    An answer's span is what rendering it adds after the generation prompt (the role header):
    its content and end-of-turn marker. Whitespace after the marker (ChatML's newline) belongs to
    no turn. Templates that render a prefix differently from the whole conversation (e.g.
    Qwen3 dropping earlier thinking) cannot be split this way and raise.
    """
    kw = chat_template_kwargs
    text, spans = render(tokenizer, messages, chat_template_kwargs=kw), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:  # an opening assistant turn answers nothing
            continue
        head = render(tokenizer, messages[:i], True, kw)
        turn = render(tokenizer, messages[: i + 1], chat_template_kwargs=kw)
        if not (turn.startswith(head) and text.startswith(turn)):
            raise ValueError(
                f"the chat template renders the conversation up to message {i} differently "
                "from the whole conversation; use single-turn data (--regenerate does)"
            )
        spans.append((len(head), len(head) + len(turn[len(head) :].rstrip())))
    return text, spans


PROBE = "PROBE-ANSWER"  # an answer's content, to find what a chat template writes around it


def assistant_markers(tokenizer, chat_template_kwargs=None) -> tuple:
    """(header, end): what the chat template writes before an answer (its generation prompt, the
    role header) and after the answer's content (the end-of-turn marker), found by rendering a
    one-question probe. The same split as assistant_spans: header unsupervised, end supervised."""
    kw, user = chat_template_kwargs, [{"role": "user", "content": "PROBE-QUESTION"}]
    before, prompt = render(tokenizer, user, False, kw), render(tokenizer, user, True, kw)
    whole = render(tokenizer, user + [{"role": "assistant", "content": PROBE}], False, kw)
    header, end = prompt[len(before) :], whole[len(prompt) + len(PROBE) :].rstrip()
    if not (prompt.startswith(before) and whole.startswith(prompt + PROBE) and header and end):
        raise ValueError(
            "this chat template's assistant header and end-of-turn marker cannot be found (a probe "
            "answer is not rendered as header + content + marker): preformatted text cannot be "
            "split into turns; give the conversations as 'messages'"
        )
    return header, end


def preformatted_spans(tokenizer, conversation, chat_template_kwargs=None):
    """(text, [(start, end)]) of a preformatted {"text"}: each answer runs from the end of an
    assistant header to the end of the next end-of-turn marker (or of the text: an answer cut
    short), as assistant_spans splits a conversation it renders itself. A text without the
    header was not rendered with this target's template (or holds no answer) and is refused."""
    header, end = assistant_markers(tokenizer, chat_template_kwargs)
    text, spans = conversation["text"], []
    at = text.find(header)
    if at < 0:
        raise ValueError(
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
    # The template already wrote any BOS; add_special_tokens=False is what apply_chat_template does
    # too.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    starts = torch.tensor([a for a, _ in enc["offset_mapping"]], dtype=torch.long)
    mask = torch.zeros_like(ids)
    for a, b in spans:  # a token belongs to the turn its first character is in
        mask |= ((starts >= a) & (starts < b)).long()
    return ids, mask


def generated_tokens(tokenizer, messages, chat_template_kwargs=None):
    """A regenerated answer as the target generated it: the prompt turns with the generation
    prompt, rendered and tokenized, then the answer's token_ids (its end-of-turn token too when it
    stopped), supervised. Re-tokenizing the answer's text could give other ids (a word split
    otherwise, retokenized_differs); these are the ones the target produced."""
    *prompt, answer = messages
    if tokenizer.decode(answer["token_ids"], skip_special_tokens=True) != answer["content"]:
        raise ValueError(
            f"an answer's token_ids do not spell its content with this tokenizer (made for another "
            f"target?): {answer['content'][:60]!r}; drop its 'token_ids' to re-tokenize the text"
        )
    head = render(tokenizer, prompt, True, chat_template_kwargs)
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    ids = torch.tensor(head_ids + answer["token_ids"], dtype=torch.long)
    return ids, (torch.arange(len(ids)) >= len(head_ids)).long()


def pretokenized(tokenizer, conversation):
    """Pre-tokenized {"input_ids", "loss_mask"}, checked against the target's vocabulary."""
    ids = conversation["input_ids"]
    if len(ids) and int(ids.max()) >= len(tokenizer):
        raise ValueError(
            f"{conversation.get('where', 'pre-tokenized sample')}: token id {int(ids.max())} is "
            f"outside this target's vocabulary ({len(tokenizer)} ids): tokenized for another model?"
        )
    return ids, conversation["loss_mask"]


def tokenize_conversation(tokenizer, conversation, max_length: int, chat_template_kwargs=None):
    """A conversation as read_conversations gives it -> input_ids [S] long, loss_mask [S] long (1
    on assistant tokens incl. end-of-turn), S <= max_length. Turns are rendered with the chat
    template (assistant_spans), or where the answer carries the target's token_ids, taken as
    generated (generated_tokens); preformatted text is split at the template's own markers
    (preformatted_spans); pre-tokenized ids are taken as they are."""
    kw = chat_template_kwargs
    if isinstance(conversation, dict) and "input_ids" in conversation:
        ids, mask = pretokenized(tokenizer, conversation)
    elif isinstance(conversation, dict):
        ids, mask = spans_to_tokens(tokenizer, *preformatted_spans(tokenizer, conversation, kw))
    elif "token_ids" in conversation[-1]:
        ids, mask = generated_tokens(tokenizer, conversation, kw)
    else:
        ids, mask = spans_to_tokens(tokenizer, *assistant_spans(tokenizer, conversation, kw))
    return ids[:max_length], mask[:max_length]


def retokenized_differs(tokenizer, messages, chat_template_kwargs=None):
    """Whether re-tokenizing a regenerated answer's text gives other ids than the target generated
    (its last turn's token_ids): the answer's span in the rendered conversation, tokenized, must
    begin with them (an answer cut at --max-new-tokens has no end-of-turn token of its own).
    None where the template cannot be split into turns (assistant_spans): not known."""
    *prompt, answer = messages
    plain = [*prompt, {"role": "assistant", "content": answer["content"]}]
    try:
        text, spans = assistant_spans(tokenizer, plain, chat_template_kwargs)
    except ValueError:
        return None
    ids, mask = spans_to_tokens(tokenizer, text, spans[-1:])
    return ids[mask.bool()].tolist()[: len(answer["token_ids"])] != answer["token_ids"]


def anchor_positions(loss_mask):
    """Where a training block may start (docs/semantics.md, section 4): positions p with
    loss_mask[p] = loss_mask[p+1] = 1, so both the anchor and the first label are supervised.
    loss_mask [S] -> positions [n] long."""
    return ((loss_mask[:-1] > 0) & (loss_mask[1:] > 0)).nonzero().squeeze(-1)


# ----------------------------------------------------------------------------- what train.py reads
def load_samples(path: str, online: bool, tokenizer, max_length: int, chat_template_kwargs=None):
    """train.py's sequences: a conversations JSONL tokenised here with the chat template's
    chat_template_kwargs (online: the target computes features as it trains), or a feature
    directory (offline: streamed, features.FeatureSamples; tokenised by prepare.py, its manifest
    says with which kwargs). Dicts as load_features() gives, without the sequences that have no
    anchor (no two consecutive supervised tokens)."""
    if online:
        kw = chat_template_kwargs or {}
        pairs = [
            tokenize_conversation(tokenizer, m, max_length, kw)
            for m in read_conversations(path, chat_template_kwargs=kw)[0]
        ]
        return [
            {"input_ids": ids, "loss_mask": mask}
            for ids, mask in pairs
            if len(anchor_positions(mask))
        ]
    samples = load_features(path)
    # manifests from before prepare.py recorded the kwargs: rendered without any
    made = read_manifest(path).get("chat_template_kwargs", {})
    try:
        check_template_kwargs(made, chat_template_kwargs)
    except ValueError as e:
        raise ValueError(f"{os.path.join(path, 'manifest.json')}: {e}") from None
    # no features read
    masks = (samples.read(i, ["loss_mask"])["loss_mask"] for i in range(len(samples)))
    return samples[[i for i, mask in enumerate(masks) if len(anchor_positions(mask))]]


# ----------------------------------------------------------------------------- rows and batches
def plan_rows(lengths, max_length: int) -> list:
    """Sample indices per row, filled next-fit in the given order: a sample joins the open row if
    the row stays within max_length tokens, else it opens the next row. A sample longer than
    max_length gets a row of its own. Deterministic and independent of the seed and of the rank
    layout."""
    rows, used = [], 0
    for i, n in enumerate(lengths):
        if not rows or used + n > max_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def lengths(samples) -> list:
    """Token counts of samples; of a streamed feature directory (features.FeatureSamples) only the
    input_ids are read, not the features."""
    read = samples.read if hasattr(samples, "read") else lambda i, keys: samples[i]
    return [len(read(i, ["input_ids"])["input_ids"]) for i in range(len(samples))]


def join(docs) -> dict:
    """One row from a list of samples: their tensors concatenated, plus positions (restarting per
    document) and docs (the document's number), each [S]. A row of one document keeps its tensors
    (no copy: collate copies them once, into the batch)."""
    row = dict(docs[0]) if len(docs) == 1 else {k: torch.cat([d[k] for d in docs]) for k in docs[0]}
    row["positions"] = torch.cat([torch.arange(len(d["input_ids"])) for d in docs])
    row["docs"] = torch.cat([torch.full((len(d["input_ids"]),), i) for i, d in enumerate(docs)])
    return row


def sample_anchors(loss_mask, num_anchors: int, generator, docs=None, per_document=False):
    """Up to num_anchors of the anchor positions (anchor_positions), drawn uniformly without
    replacement, sorted (docs/semantics.md, section 4). docs [S]: an anchor and its first label
    share a document. per_document: each document of the row draws up to num_anchors of its own
    (the public trainers' contract: one conversation, num_anchors), so a long document cannot take
    the anchors of the short ones beside it; else the row draws num_anchors among all of them."""
    cand = anchor_positions(loss_mask)
    if docs is not None:
        cand = cand[docs[cand] == docs[cand + 1]]
    groups = [cand]
    if per_document and docs is not None:
        groups = [cand[docs[cand] == d] for d in docs[cand].unique()]
    picks = [g[torch.randperm(len(g), generator=generator)[:num_anchors]] for g in groups]
    return torch.cat(picks).sort().values if picks else cand


def collate(rows, keys, num_anchors, seed, device, per_document=False, anchors=None):
    """Right-pad rows (each a list of samples, its documents) into a batch on device; anchors are
    seeded per (seed, key) so that every rank / accumulation layout draws the same anchors for the
    same row (per_document: sample_anchors), or given: anchors[i] the positions of row i (the
    anchors serving visited, train.py's served evaluation). Padding has position 0 and document -1,
    no anchor and no label. features keep their stored dtype (the draft casts them,
    model.DraftModel.context_kv); target_hidden is fp32, as the objective reads it."""
    rows = [join(docs) for docs in rows]
    N, S = len(rows), max(len(r["input_ids"]) for r in rows)
    batch = {
        "input_ids": torch.zeros(N, S, dtype=torch.long),
        "loss_mask": torch.zeros(N, S, dtype=torch.long),
        "attention_mask": torch.zeros(N, S, dtype=torch.long),
        "positions": torch.zeros(N, S, dtype=torch.long),
        "docs": torch.full((N, S), -1, dtype=torch.long),
    }
    for name in ("features", "target_hidden"):
        if name in rows[0]:
            # features in their stored dtype (bf16: half the bytes to copy); target_hidden fp32
            dtype = rows[0][name].dtype if name == "features" else torch.float32
            batch[name] = torch.zeros(N, S, rows[0][name].shape[-1], dtype=dtype)
    given, anchors = anchors, []
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["attention_mask"][i, :n] = 1
        for name in ("input_ids", "loss_mask", "positions", "docs", "features", "target_hidden"):
            if name in batch:
                batch[name][i, :n] = r[name]
        if given is not None:
            anchors.append(torch.as_tensor(given[i], dtype=torch.long))
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + keys[i])
        anchors.append(sample_anchors(r["loss_mask"], num_anchors, gen, r["docs"], per_document))
    A = max(len(a) for a in anchors)
    batch["anchors"] = torch.zeros(N, A, dtype=torch.long)
    batch["anchor_valid"] = torch.zeros(N, A, dtype=torch.bool)
    for i, a in enumerate(anchors):
        batch["anchors"][i, : len(a)], batch["anchor_valid"][i, : len(a)] = a, True
    return {k: v.to(device) for k, v in batch.items()}


# ----------------------------------------------------------------------------- static shapes
# A compiled step (train.py --compile, flex attention) specialises on its shapes: each new one
# compiles again. Rows are padded to LENGTH_UNIT tokens times a power of two and the anchors to
# --num-anchors times one, so that a run meets a handful of shapes (log2(longest / 64) + 1 lengths)
# instead of one per step.
LENGTH_UNIT = 64


def static_size(n: int, unit: int) -> int:
    """The smallest unit * 2^k >= n (k >= 0): static_size(100, 64) = 128, static_size(512, 512) =
    512."""
    return unit * (1 << (-(-n // unit) - 1).bit_length())


def pad_batch(batch, length: int, num_anchors: int) -> dict:
    """A batch right-padded to `length` tokens and `num_anchors` anchor slots, on its device.
    Padded tokens are collate's padding (no attention, no label, document -1, features 0); padded
    anchors are invalid (position 0, anchor_valid False), so the objective gives their blocks
    weight 0 and the loss, its gradients and the metrics are the unpadded batch's."""
    N, S = batch["input_ids"].shape
    A = batch["anchors"].shape[1]
    if length < S or num_anchors < A:
        raise ValueError(f"cannot pad {S} tokens, {A} anchors to {length}, {num_anchors}")
    out = {}
    for k, v in batch.items():
        size = num_anchors if k in ("anchors", "anchor_valid") else length
        out[k] = v.new_full((N, size, *v.shape[2:]), -1 if k == "docs" else 0)
        out[k][:, : v.shape[1]] = v
    return out


def static_shapes(batch, num_anchors: int) -> dict:
    """pad_batch to static_size: S up to 64 * 2^k tokens, the anchors to --num-anchors (with
    --anchors-per document, a power of two times it)."""
    S, A = batch["input_ids"].shape[1], batch["anchors"].shape[1]
    return pad_batch(batch, static_size(S, LENGTH_UNIT), static_size(A, num_anchors))


# ----------------------------------------------------------------------------- loading ahead
class MicroBatches(torch.utils.data.Dataset):
    """A run's micro-batches, made wherever the DataLoader runs them (its worker processes): item
    (epoch, row numbers) -> collate's batch of those rows on the CPU, anchors keyed by epoch and row
    as train.py keys them, with static shapes when `static`."""

    def __init__(self, samples, rows, num_anchors, seed, per_document=False, static=False):
        self.samples, self.rows, self.num_anchors = samples, rows, num_anchors
        self.seed, self.per_document, self.static = seed, per_document, static

    def __getitem__(self, item):
        epoch, batch_rows = item
        keys = [epoch * len(self.rows) + r for r in batch_rows]
        docs = [[self.samples[j] for j in self.rows[r]] for r in batch_rows]
        batch = collate(docs, keys, self.num_anchors, self.seed, "cpu", self.per_document)
        return static_shapes(batch, self.num_anchors) if self.static else batch


def loader(dataset, schedule, workers: int, pin: bool):
    """The items of `schedule` (an iterable of (epoch, row numbers), consumed once, in order) made
    ahead by `workers` processes, two each in flight (0: made here, when asked), and with pin (a
    CUDA device) copied into page-locked memory, from which to_device's copy runs asynchronously.
    Batches come in schedule order whatever the number of workers, equal to collate's bit for bit.
    Its own generator: the global RNG (the draft's initialisation) is left untouched."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,  # an item is a whole micro-batch
        sampler=schedule,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=2 if workers else None,
        generator=torch.Generator(),
    )


def to_device(batch, device) -> dict:
    """Copy a batch to device; from pinned memory the copy is queued behind the GPU's work instead
    of waiting for it (non_blocking), from pageable memory it is a plain copy."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ------------------------------------------------------------------ online: the target per document
def per_document(batch):
    """The documents of packed rows as rows of their own, for the target, whose causal attention
    would cross documents in a packed row: -> input_ids, attention_mask [D, L] (right-padded), and
    back(), which puts the target's outputs [D, L, F] where their tokens sit in the rows: [N, S, F],
    padding 0."""
    spans = []  # (row, start, length) per document
    for row, docs in enumerate(batch["docs"].tolist()):
        spans += [(row, docs.index(d), docs.count(d)) for d in range(max(docs) + 1)]
    ids = torch.zeros(
        len(spans), max(n for _, _, n in spans), dtype=torch.long, device=batch["input_ids"].device
    )
    mask = torch.zeros_like(ids)
    for d, (row, start, n) in enumerate(spans):
        ids[d, :n], mask[d, :n] = batch["input_ids"][row, start : start + n], 1

    def back(values):
        out = values.new_zeros(*batch["input_ids"].shape, values.shape[-1])
        for d, (row, start, n) in enumerate(spans):
            out[row, start : start + n] = values[d, :n]
        return out

    return ids, mask, back
