"""The TOY target of `bash run.sh --toy`: a tiny Llama-style causal LM with a word-level vocabulary,
trained here in a minute or two on the toy word problems with worked answers
(prompts/toy_problems.py); nothing is downloaded. The main job's target stays SmolLM2-135M.

    python -m tools.toy_target OUT_DIR        # writes a Hugging Face directory: --target OUT_DIR

Its chat template is <|user|>QUESTION<|assistant|>ANSWER<|end|>. Token ids 0-5 are <|pad|> <|end|>
<|user|> <|assistant|> <|mask|> <|unk|>; <|mask|> is in no training text, so the target never emits
it: configs/toy-dflash2.json takes it as mask_token_id, and VOCAB rows as vocab_size.
"""

import argparse
import math
import os
import shutil
import tempfile
import time

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from prompts.toy_problems import toy_split
from support.common import HelpTable, run
from support.conversations import tokenize_conversation

SPECIALS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|mask|>", "<|unk|>"]
VOCAB = 384  # the model's rows; configs/toy-dflash2.json's vocab_size
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The layout configs/toy-dflash2.json is sized for: 4 layers of width 64 (0.22 M parameters).
LAYOUT = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, head_dim=16)
LAYOUT.update(num_attention_heads=4, num_key_value_heads=2)


def build_tokenizer(texts) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words of texts: a word with its leading space ("▁Anna"), a
    number ("▁12"), or one other character (".", "▁$") is one token; decoding restores the text."""
    tok = Tokenizer(models.WordLevel(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(),
            pre_tokenizers.Split(Regex(r"▁?[A-Za-z]+|▁?[0-9]+|▁?[^▁A-Za-z0-9]"), "isolated"),
        ]
    )
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    if tok.get_vocab_size() > VOCAB:
        raise ValueError(f"the toy texts have {tok.get_vocab_size()} words, more than {VOCAB}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        unk_token="<|unk|>",
        additional_special_tokens=SPECIALS[2:5],
        chat_template=CHAT_TEMPLATE,
    )


def conversation(question, answer=None) -> list:
    turns = [{"role": "user", "content": question}]
    return turns + ([{"role": "assistant", "content": answer}] if answer is not None else [])


def train_target(target, seqs, steps: int, batch_size: int, lr: float, seed: int, log=print):
    """Next-token cross-entropy on the answers' tokens (loss_mask 1: the answer and <|end|>), AdamW
    with a cosine schedule. seqs: [(input_ids [S], loss_mask [S])]."""
    opt = torch.optim.AdamW(target.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    g, t0 = torch.Generator().manual_seed(seed), time.time()
    target.train()
    for step in range(steps):
        batch = [seqs[i] for i in torch.randint(len(seqs), (batch_size,), generator=g)]
        S = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(batch_size, S, dtype=torch.long)  # right-padded with <|pad|>
        labels = torch.full((batch_size, S), -100)  # ignored where unsupervised
        for r, (x, m) in enumerate(batch):
            ids[r, : len(x)] = x
            labels[r, : len(x)] = torch.where(m.bool(), x, -100)
        logits = target(input_ids=ids).logits  # [N, S, V]; padding only follows real tokens
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 100 == 0 or step + 1 == steps:
            took = time.time() - t0
            log(f"toy target: step {step + 1}/{steps}, loss {loss.item():.4f}, {took:.0f} s")
    return target.eval()


@torch.no_grad()
def greedy_answers(target, tok, questions, max_new_tokens=80) -> list:
    """The target's greedy answers (batched, left-padded) as text."""
    tok.padding_side = "left"
    texts = [
        tok.apply_chat_template(conversation(q), tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    out = target.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, **ids)
    return tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def build(out_dir, num_problems=None, steps=1000, batch_size=32, lr=1e-2, seed=0, log=print):
    """Train the toy target on the first num_problems training pairs (all by default) and save it
    to out_dir (atomically: a temporary directory, renamed). -> (target, tokenizer)."""
    pairs, held_out = toy_split()
    pairs = pairs[:num_problems]
    # every number up to 200 in the vocabulary, whatever the problems drawn
    words = [q + " " + a for q, a in pairs + held_out] + [" ".join(map(str, range(201)))]
    tok = build_tokenizer(words)
    torch.manual_seed(seed)
    kw = dict(max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True)
    kw.update(pad_token_id=0, eos_token_id=1, bos_token_id=None)  # <|pad|>, <|end|>, none
    target = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, **kw, **LAYOUT))
    seqs = [tokenize_conversation(tok, conversation(q, a), 256) for q, a in pairs]
    log(
        f"toy target: {sum(p.numel() for p in target.parameters()):,} parameters, "
        f"{len(tok)} words, {len(seqs)} problems, {steps} steps of {batch_size}"
    )
    train_target(target, seqs, steps, batch_size, lr, seed, log)
    target.generation_config.eos_token_id = tok.eos_token_id
    target.generation_config.pad_token_id = tok.pad_token_id
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out_dir)), prefix=".toy-")
    target.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)
    return target, tok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpTable)
    p.add_argument("out_dir")
    args = p.parse_args(argv)
    t0 = time.time()
    target, tok = build(args.out_dir)
    held_out = toy_split()[1][:50]
    got = greedy_answers(target, tok, [q for q, _ in held_out])
    right = sum(g == a for g, (_, a) in zip(got, held_out))
    print(
        f"toy target: {args.out_dir} in {time.time() - t0:.0f} s; its greedy answer is the worked "
        f"answer on {right} of {len(held_out)} held-out problems"
    )


if __name__ == "__main__":
    run(main)
