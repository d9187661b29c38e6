"""Regeneration through a serving engine: `prepare.py --regenerate --server URL` asks any
OpenAI-compatible server (vLLM, SGLang, llama.cpp's llama-server) for each answer, one chat
completion per prompt (POST URL/v1/chat/completions), from a pool of threads, with the standard
library's HTTP client. docs/data.md, "Regeneration on a serving engine", says how the answers are
made as the in-process ones are (the chat template kwargs, plain sampling from softmax(logits / T),
a seed per prompt), how the generated token ids are kept, and which failures are tried again.
"""

import json
import queue
import threading
import time
import urllib.error
import urllib.request

from support.common import UsageError, count, nonneg, positive, whole
from support.conversations import render, retokenized_differs


class ServerError(UsageError):
    """A server that is down or answers with errors (common.run prints it as one line)."""


class Transient(Exception):
    """A failure worth another try."""


# ----------------------------------------------------------------------------- HTTP
def base_url(url: str) -> str:
    """The server's root: "http://host:8000", "http://host:8000/" and ".../v1" are one server."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def call(url: str, body=None, timeout: float = 600.0) -> dict:
    """GET (body None) or POST body as JSON -> the JSON reply. Raises Transient for what may pass,
    ServerError for a refusal."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace").strip().replace("\n", " ")[:200]
        if e.code == 429 or e.code >= 500:
            raise Transient(f"HTTP {e.code}: {text}") from None
        raise ServerError(f"{url}: HTTP {e.code}: {text}") from None
    except (OSError, ValueError) as e:  # refused, reset, timed out; a reply that is not JSON
        raise Transient(str(getattr(e, "reason", e))) from None


def with_retries(servers: list, first: int, what: str, ask, retries: int, wait: float):
    """ask(server) on servers[first], then on the next ones, retries times more with waits of
    wait, 2 wait, 4 wait... seconds; ServerError naming the last server and error after that."""
    for k in range(retries + 1):
        server = servers[(first + k) % len(servers)]
        try:
            return ask(server)
        except Transient as e:
            last = e
        if k < retries:
            time.sleep(wait * 2**k)
    raise ServerError(f"{server}: {what}: no answer after {retries + 1} tries (last: {last})")


def model_name(server: str, timeout: float) -> str:
    """The name the server serves its model under: the first of GET /v1/models."""
    reply = call(f"{server}/v1/models", timeout=timeout)
    try:
        return reply["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise Transient(f"/v1/models lists no model: {str(reply)[:100]}") from None


# ----------------------------------------------------------------------------- one answer
def request_body(messages, model: str, settings: dict, max_new_tokens: int, index: int) -> dict:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_new_tokens,
        "temperature": settings["temperature"],
        "seed": settings["seed"] * 1_000_003 + index,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "chat_template_kwargs": settings["chat_template_kwargs"],
        "logprobs": True,
        "top_logprobs": 1,
        "return_token_ids": True,
    }


def generated_ids(choice: dict):
    """The answer's token ids where the reply holds them, else None."""
    if isinstance(choice.get("token_ids"), list):
        return choice["token_ids"]
    content = (choice.get("logprobs") or {}).get("content") or []
    if content and all(isinstance(t.get("id"), int) for t in content):
        return [t["id"] for t in content]
    if content and all(str(t.get("token", "")).startswith("token_id:") for t in content):
        return [int(t["token"].removeprefix("token_id:")) for t in content]
    return None


def to_record(index: int, prompt: list, reply: dict, tokenizer, settings: dict, server: str):
    """A server's reply -> the record prepare.py's regeneration writes: {"index", "messages",
    "finished", the settings, "server", "retokenized_differs", "prompt_tokens_differ"}."""
    try:
        choice = reply["choices"][0]
        message, finished = choice["message"], choice["finish_reason"] == "stop"
    except (KeyError, IndexError, TypeError):
        raise Transient(f"a reply without choices[0].message: {str(reply)[:100]}") from None
    ids, usage = generated_ids(choice), reply.get("usage") or {}
    eos = tokenizer.eos_token_id
    if ids is not None:
        if finished and (not ids or ids[-1] != eos):
            ids = ids + [eos]  # a server that leaves out the token it stopped at (llama-server
            # keeps it), so that the answer ends as in-process
        answer = {
            "role": "assistant",
            "content": tokenizer.decode(ids, skip_special_tokens=True),
            "token_ids": ids,
        }
        differs = retokenized_differs(
            tokenizer, prompt + [answer], settings["chat_template_kwargs"]
        )
    else:
        if message.get("reasoning_content") or message.get("reasoning"):
            raise ServerError(
                f"{server}: the server split the answer's reasoning off its text; start it without "
                "a reasoning parser (llama-server --reasoning-format none; vLLM / SGLang without "
                "--reasoning-parser), so that the answer is the text the model wrote"
            )
        if not isinstance(message.get("content"), str):
            raise ServerError(f"{server}: an answer without text: {str(message)[:100]}")
        answer = {"role": "assistant", "content": message["content"]}
        n = len(tokenizer(answer["content"], add_special_tokens=False)["input_ids"]) + finished
        count = usage.get("completion_tokens")
        differs = None if count is None else n != count
    kw = settings["chat_template_kwargs"]
    prompt_ids = tokenizer(render(tokenizer, prompt, True, kw), add_special_tokens=False)
    counted = usage.get("prompt_tokens")
    return {
        "index": index,
        "messages": prompt + [answer],
        "finished": finished,
        **settings,
        "server": server,
        "retokenized_differs": differs,
        "prompt_tokens_differ": None if counted is None else counted != len(prompt_ids.input_ids),
    }


# ----------------------------------------------------------------------------- all answers
def regenerate(
    prompts: dict,
    tokenizer,
    servers: list,
    settings: dict,
    max_new_tokens: int,
    concurrency: int = 8,
    retries: int = 5,
    wait: float = 1.0,
    timeout: float = 600.0,
    model: str = None,
):
    """prompts {index: turns} -> their records (to_record), as each answer arrives (in any
    order), from `concurrency` threads; thread k starts on servers[k % len(servers)]. The first
    failure that retries do not cure stops the threads and is raised (ServerError)."""
    if not prompts:  # all done: no server is asked anything, nor needs to be up
        return
    servers = [base_url(s) for s in servers]
    models = {
        s: model
        or with_retries([s], 0, "GET /v1/models", lambda s: model_name(s, timeout), retries, wait)
        for s in servers
    }
    jobs, results, stop = queue.Queue(), queue.Queue(), threading.Event()
    for i in prompts:
        jobs.put(i)

    def answer(i: int, server: str) -> dict:
        body = request_body(prompts[i], models[server], settings, max_new_tokens, i)
        reply = call(f"{server}/v1/chat/completions", body, timeout)
        return to_record(i, prompts[i], reply, tokenizer, settings, server)

    def worker(k: int):
        while not stop.is_set():
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                what = f"the answer to prompt {i}"
                rec = with_retries(servers, k, what, lambda s: answer(i, s), retries, wait)
                results.put(rec)
            except Exception as e:  # ServerError, or a bug: raised in the caller's thread
                results.put(e)
                return

    for k in range(min(concurrency, len(prompts))):
        threading.Thread(target=worker, args=(k,), daemon=True).start()
    for _ in range(len(prompts)):
        got = results.get()
        if isinstance(got, Exception):
            stop.set()
            raise got
        yield got


# ----------------------------------------------------------------------------- command line
def add_flags(add):
    """prepare.py's --server flags (add: a parser's add_argument); docs/data.md says more."""
    add("--server", action="append", metavar="URL", help="an OpenAI-compatible server; repeatable")
    add("--concurrency", type=count, default=8, help="requests in flight over all servers")
    add("--retries", type=whole, default=5, help="how often a failed request is tried again")
    add("--retry-wait", type=nonneg, default=1.0, help="seconds before a retry, doubled each time")
    add("--request-timeout", type=positive, default=600.0, help="seconds a request may take")
    add("--server-model", help="the model name sent; default: each server's first /v1/models")


def client(args) -> dict:
    """regenerate()'s client arguments from the flags add_flags made."""
    return {
        "concurrency": args.concurrency,
        "retries": args.retries,
        "wait": args.retry_wait,
        "timeout": args.request_timeout,
        "model": args.server_model,
    }
