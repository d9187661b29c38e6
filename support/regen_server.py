"""prepare.py --regenerate --server URL: each answer one chat completion from an OpenAI-compatible
server (vLLM, SGLang, llama-server), from a pool of threads; docs/data.md, "Regeneration on a
serving engine", says how the answers are made as the in-process ones are.
"""

import json
import queue
import threading
import time
import urllib.error
import urllib.request

from support.common import UsageError, count, nonneg, positive, whole
from support.conversations import generated_answer, render, retokenized_differs


class ServerError(UsageError):
    """A server that is down or answers with errors (common.run prints it as one line)."""


class Transient(Exception):
    """A failure worth another try."""


# ----------------------------------------------------------------------------- HTTP
def call(url: str, body=None, timeout: float = 600.0) -> dict:
    """GET (body None) or POST JSON -> JSON; Transient for what may pass, else ServerError."""
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
    """ask(server), retried on the next servers with doubling waits; then ServerError."""
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
    body = dict(model=model, messages=messages, max_tokens=max_new_tokens)
    # sampled as in-process: one seed a prompt, the whole distribution (no top-p, top-k, min-p)
    body.update(temperature=settings["temperature"], seed=settings["seed"] * 1_000_003 + index)
    body.update(top_p=1.0, top_k=-1, min_p=0.0)
    body["chat_template_kwargs"] = settings["chat_template_kwargs"]
    # the answer's token ids, asked for in each engine's way (generated_ids reads them)
    return body | dict(logprobs=True, top_logprobs=1, return_token_ids=True)


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
    """A server's reply -> regen.answer_record's record, plus server and prompt_tokens_differ."""
    try:
        choice = reply["choices"][0]
        message, finished = choice["message"], choice["finish_reason"] == "stop"
    except (KeyError, IndexError, TypeError):
        raise Transient(f"a reply without choices[0].message: {str(reply)[:100]}") from None
    ids, usage = generated_ids(choice), reply.get("usage") or {}
    eos, kw = tokenizer.eos_token_id, settings["chat_template_kwargs"]
    if ids is not None:
        if finished and (not ids or ids[-1] != eos):  # a server that leaves out its stop token:
            ids = ids + [eos]  # the answer ends as in-process (and as llama-server's)
        answer = generated_answer(tokenizer, ids)
        differs = retokenized_differs(tokenizer, prompt + [answer], kw)
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
        generated = usage.get("completion_tokens")
        differs = None if generated is None else n != generated
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
    """prompts {index: turns} -> their records (to_record) as they arrive, from `concurrency`
    threads, the k-th prompt first on servers[k % len(servers)]. The first failure that retries do
    not cure is raised (ServerError) and the prompts not yet sent are dropped."""
    if not prompts:  # all done: no server is asked anything, nor needs to be up
        return
    servers = [s.rstrip("/").removesuffix("/v1") for s in servers]  # ".../v1/" names the same one
    models = {
        s: model
        or with_retries([s], 0, "GET /v1/models", lambda s: model_name(s, timeout), retries, wait)
        for s in servers
    }

    todo, results, stopped = queue.SimpleQueue(), queue.SimpleQueue(), threading.Event()
    for job in enumerate(prompts):  # (k, index): the k-th prompt starts on servers[k % n]
        todo.put(job)

    def answer(k: int, i: int) -> dict:
        def ask(server):
            if stopped.is_set():  # a failure elsewhere ended the run: no more tries
                raise ServerError(f"{server}: prompt {i}: stopped")
            body = request_body(prompts[i], models[server], settings, max_new_tokens, i)
            reply = call(f"{server}/v1/chat/completions", body, timeout)
            return to_record(i, prompts[i], reply, tokenizer, settings, server)

        return with_retries(servers, k, f"the answer to prompt {i}", ask, retries, wait)

    def worker():
        while not stopped.is_set():
            try:
                k, i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results.put(answer(k, i))
            except Exception as e:  # ServerError, or a bug: raised in the caller's thread
                results.put(e)
                return

    # daemon threads: a failure ends the process at once, not after the requests still in flight
    # (each may take --request-timeout)
    for _ in range(min(concurrency, len(prompts))):
        threading.Thread(target=worker, daemon=True).start()
    try:
        for _ in prompts:
            got = results.get()
            if isinstance(got, Exception):
                raise got
            yield got
    finally:  # a failure or an early stop: no new request
        stopped.set()


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
