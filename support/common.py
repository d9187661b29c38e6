"""What several scripts share and no mechanism owns, each once (as nanochat's common.py): dtypes,
files, commands, recipes, and the command line's rules (a user's mistake ends in one line).
"""

import argparse
import io
import json
import math
import os
import platform
import subprocess
import sys
from contextlib import contextmanager, redirect_stderr

import torch


class UsageError(Exception):
    """A mistake the user can fix, named in its message; run() prints it as one line."""


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dtype_name(dtype) -> str:
    """A torch dtype -> its DTYPES name, as the flags spell it."""
    return {v: k for k, v in DTYPES.items()}[dtype]


@contextmanager
def atomic_write(path: str):
    """`with atomic_write(path) as tmp:` write tmp, which then replaces path in one rename: a crash
    never leaves half a file."""
    tmp = path + ".tmp"
    yield tmp
    os.replace(tmp, path)


def read_json(file: str):
    """A JSON file's content; a missing file or invalid JSON is a UsageError naming the file."""
    if not os.path.isfile(file):
        raise UsageError(f"no file at {file}")
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise UsageError(f"{file}: not valid JSON (line {e.lineno}): {e.msg}") from None


def write_json(path: str, obj):
    with atomic_write(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=2)


def cpu_name() -> str:
    """The CPU, as a speed number names it: model, family and model numbers, its widest vectors."""
    info = open("/proc/cpuinfo").read() if os.path.isfile("/proc/cpuinfo") else ""
    fields = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = fields.get("flags", "").split()
    widest = {"amx_tile": "AMX", "avx512_bf16": "AVX-512 with bf16", "avx512f": "AVX-512"}
    kind = next((name for flag, name in widest.items() if flag in flags), "AVX2 only")
    model = fields.get("model name", platform.processor())
    numbers = f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    return f"{model} ({numbers}), {kind}, {os.cpu_count()} cores"


def run_logged(cmd, log: str, what=None, env=None, cwd=None):
    """Run cmd, its command line and output appended to the file log; a failure is a UsageError
    naming what (default: cmd's program), its exit status, its last line and the log."""
    cmd, env = [str(c) for c in cmd], env or {}
    with open(log, "a") as out:
        out.write(f"$ {''.join(f'{k}={v} ' for k, v in env.items())}{' '.join(cmd)}\n")
        start = out.tell()
        out.flush()
        # unbuffered: a Python child's last words (its error) stay last in the log
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        done = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=out)
    if done.returncode:
        with open(log) as f:
            f.seek(start)
            why = last_line(f.read())
        name = what or os.path.basename(cmd[0])
        raise UsageError(f"{name} failed (exit {done.returncode}): {why}; its output: {log}")


def last_line(text: str) -> str:
    """A command's output -> the last line that says something (why it failed, usually)."""
    return (text.strip().splitlines() or ["no output"])[-1][:300]


def recipe(name: str, script: str) -> list:
    """configs/NAME.flags's flags for script (prepare or train), as run.sh reads them too."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    with open(os.path.join(path, f"{name}.flags")) as f:
        return next(line.split()[1:] for line in f if line.startswith(script + ":"))


# ----------------------------------------------------------------------------- command lines
class HelpTable(argparse.RawDescriptionHelpFormatter):
    """--help as a table: a line a flag, a short value name, the default after the help."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=40)

    def _get_default_metavar_for_optional(self, action):
        return action.dest.split("_")[-1].upper()  # --selector-warmup-ratio RATIO

    def _get_help_string(self, action):
        unset = any(action.default is v for v in (None, False, argparse.SUPPRESS))
        return action.help + ("" if unset else " [%(default)s]")


def bounded(kind, low=None, high=None, above=None):
    """An argparse type: kind(text) with low <= value <= high and value > above."""

    def parse(text):
        value = kind(text)  # a ValueError here: argparse says "invalid int value"
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        for ok, rule in (
            (low is None or value >= low, f">= {low}"),
            (high is None or value <= high, f"<= {high}"),
            (above is None or value > above, f"> {above}"),
        ):
            if not ok:
                raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


# the flags' usual bounds, one name each
count, whole = bounded(int, low=1), bounded(int, low=0)
nonneg, positive = bounded(float, low=0.0), bounded(float, above=0.0)
ratio = bounded(float, low=0.0, high=1.0)


def template_kwargs(text):
    """--chat-template-kwargs' argparse type: a JSON object, without what conversations.render sets
    itself."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}), got {text}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{...}}, got {text}")
    named = ", ".join(sorted({"tokenize", "add_generation_prompt"} & set(value)))
    if named:
        raise argparse.ArgumentTypeError(f"{named}: set by conversations.render itself, got {text}")
    return value


def add_chat_template_kwargs(add):
    """The one --chat-template-kwargs flag of prepare.py, train.py and generate.py."""
    add(
        "--chat-template-kwargs",
        type=template_kwargs,
        default="{}",  # argparse applies the type to a string default: a fresh dict per parse
        metavar="JSON",
        help="keyword arguments for the target's chat template, e.g. "
        "'{\"enable_thinking\": false}' (Qwen3); the same when regenerating, training and serving",
    )


def add_target_flags(add, auto="bf16 where native, else fp32"):
    """--target and --target-dtype, one definition for prepare.py, train.py and generate.py."""
    add("--target", help="HF directory or hub name; default: the embedded SmolLM2-135M-Instruct")
    add("--target-dtype", choices=["auto", *DTYPES], default="auto", help=f"auto: {auto}")


def flags_checked(parse_args, argv, script: str):
    """parse_args(argv), for a shell script that checks script's flags before any work: argparse's
    refusal as a one-line UsageError naming script."""
    said = io.StringIO()
    try:
        with redirect_stderr(said):
            return parse_args(argv)
    except SystemExit as e:
        if e.code != 2:  # --help: printed, a success
            raise
        raise UsageError(f"{script}: {said.getvalue().split(': error: ', 1)[-1].strip()}") from None


def run(main):
    """Run a script's main(): a UsageError ends in one line `error: ...` and exit status 2; any
    other exception is a bug and keeps its traceback."""
    try:
        main()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
