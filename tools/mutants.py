"""Break the method on purpose, one rule at a time, and check that `pytest -m method` notices
(docs/mutants.md: what a break is, the CI subset, the last full run).

    python -m tools.mutants                  # every break: caught / survived / equivalent, per file
    python -m tools.mutants --ci             # the CI subset (a few minutes on 2 cores)

The breaks are data, tools/mutants.toml. Exit status 1 if a non-equivalent break survives or is
caught only by tests other than the ones it names; 2 on a malformed or stale entry. The tests run in
forked children of one process that imported torch and transformers once.
"""

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import MISSING, dataclass

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ("conv.py", "selector.py", "attention.py", "model.py", "loss.py", "decoding.py", "tree.py")
DATA = os.path.join(HERE, "tools", "mutants.toml")


@dataclass
class Break:
    """One [[break]] of tools/mutants.toml; its header says what each field means."""

    file: str
    old: str
    new: str
    rule: str
    tests: list
    why: str
    source: str = "rule"
    equivalent: str = None
    ci: bool = False


# ---------------------------------------------------------------------------------- the checks
def load(path: str) -> tuple:
    """path (tools/mutants.toml) -> (rules, breaks, problems). A problem, one line each: the file
    is not TOML, a break has an unknown or missing field or a field of the wrong type, names a file
    that is not a mechanism file or a rule that is not in [rules], or its snippet does not occur
    exactly once in its file."""
    name = os.path.relpath(path, HERE)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        return {}, [], [f"{name}: {e}"]
    problems = [f"{name}: unknown table {k!r}" for k in data if k not in ("rules", "break")]
    rules = data.get("rules", {})
    for key, rule in rules.items():
        if not isinstance(rule, dict) or sorted(rule) != ["phrase", "section"]:
            problems.append(f"{name}: rule {key!r}: wants a section and a phrase, and nothing else")
    fields = {f.name: f for f in dataclasses.fields(Break)}
    breaks = []
    for n, entry in enumerate(data.get("break", []), 1):
        at = f"{name}: break {n} ({entry.get('file')}: {entry.get('why')})"
        wrong = [f"unknown field {k!r}" for k in entry if k not in fields]
        wrong += [f"no {k!r}" for k, f in fields.items() if k not in entry and f.default is MISSING]
        wrong += [
            f"{k!r} is not a {fields[k].type.__name__}"
            for k, v in entry.items()
            if k in fields and not isinstance(v, fields[k].type)
        ]
        if not wrong and not all(t.startswith("test_") for t in entry["tests"] or [""]):
            wrong = ["'tests' wants one test name or more, each test_..."]
        if not wrong and entry["file"] not in FILES:
            wrong = [f"{entry['file']!r} is not a mechanism file ({', '.join(FILES)})"]
        if not wrong and entry["rule"] not in rules:
            wrong = [f"unknown rule {entry['rule']!r}"]
        if not wrong:
            b = Break(**entry)
            count = open(os.path.join(HERE, b.file)).read().count(b.old)
            wrong = [f"its snippet occurs {count} times: {b.old!r}"] * (count != 1)
            breaks.append(b)
        problems += [f"{at}: {w}" for w in wrong]
    return rules, breaks, problems


def pinned_names(rules: dict, rule: str) -> set:
    """The tests named on a rule's Pinned by line in docs/semantics.md: the first Pinned by at or
    after the paragraph of its section that holds its phrase."""
    section, phrase = rules[rule]["section"], rules[rule]["phrase"]
    text = open(os.path.join(HERE, "docs", "semantics.md")).read()
    heading = re.compile(r"^#+ (\d+(?:\.\d+)?)\.? ", re.M)
    starts = [(m.group(1), m.start()) for m in heading.finditer(text)] + [("end", len(text))]
    span = next(((a, b) for (s, a), (_, b) in zip(starts, starts[1:]) if s == section), (0, 0))
    paragraphs = [" ".join(p.split()) for p in text[span[0] : span[1]].split("\n\n")]
    phrase = " ".join(phrase.split())
    at = next((i for i, p in enumerate(paragraphs) if phrase in p), None)
    pinned = next((p for p in paragraphs[at or 0 :] if "**Pinned by**" in p), None)
    if at is None or pinned is None:
        raise SystemExit(
            f"error: rule {rule!r}: no paragraph of section {section} holds {phrase!r}"
        )
    return set(re.findall(r"`(test_\w+)`", pinned.split("**Pinned by**", 1)[1]))


# ------------------------------------------------------------------------------------ the runner
def copy_repo(dest: str):
    """The repository's tracked and untracked (not ignored) files, without __pycache__."""
    names = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=HERE,
        capture_output=True,
        check=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, names):
        src = os.path.join(HERE, name)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, name))


class Failures:
    """A pytest plugin that writes the failing tests' names to a file, one a line."""

    def __init__(self, path):
        self.path = path

    def pytest_runtest_logreport(self, report):
        if report.failed:
            with open(self.path, "a") as f:
                f.write(report.nodeid.split("::")[-1].split("[")[0] + "\n")


def run_tests(repo: str, select, stop_first: bool, log: str, limit: int = 0) -> set:
    """pytest -m method [-k select, unless None] [-x] in a forked child that imports the project
    from repo -> the names of the failing tests (empty: all passed). With limit, the child is
    stopped after limit seconds, and the answer says so."""
    failed = os.path.join(repo, ".failed")
    if os.path.exists(failed):
        os.remove(failed)
    pid = os.fork()
    if pid == 0:  # the child: the project's modules are imported fresh, from the copy
        try:
            os.chdir(repo)
            sys.path[:] = [repo] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
            sys.dont_write_bytecode = True
            signal.alarm(limit)  # 0: none; else SIGALRM ends the child
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            import pytest

            args = ["-m", "method", "-q", "-p", "no:cacheprovider", "test_all.py"]
            args += ["-k", select] * bool(select) + ["-x"] * stop_first
            rc = pytest.main(args, plugins=[Failures(failed)])
            os._exit(0 if rc in (0, 5) else 1)  # 5: no test selected
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    names = set(open(failed).read().split()) if os.path.exists(failed) else set()
    if rc == -signal.SIGALRM:
        return names | {f"<timed out after {limit} s>"}
    if rc != 0 and not names:  # crashed before any test reported (an import error, a segfault)
        names = {f"<exit {rc}: {open(log).read()[-300:].strip()}>"}
    return names


def try_break(repo: str, b: Break, log: str, limit: int) -> tuple:
    """Apply b in repo, run its tests, then (if none failed) all of -m method; restore ->
    (failed tests, stage: 1 its own tests, 2 the whole subset, 0 survived)."""
    path = os.path.join(repo, b.file)
    original = open(path).read()
    try:
        with open(path, "w") as f:
            f.write(original.replace(b.old, b.new, 1))
        own = " or ".join(b.tests)
        failed = run_tests(repo, own, False, log, limit)
        if failed:
            return failed, 1
        failed = run_tests(repo, None, True, log, limit)
        return failed, (2 if failed else 0)
    finally:
        with open(path, "w") as f:
            f.write(original)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ci", action="store_true", help="only the CI subset")
    args = ap.parse_args(argv)
    rules, breaks, problems = load(DATA)
    if problems:
        print("error: " + "\n       ".join(problems), file=sys.stderr)
        return 2
    breaks = [b for b in breaks if not args.ci or b.ci]
    stale = stale_pinned_lines(rules, breaks)
    for line in stale:
        print(f"stale Pinned by: {line}")

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the property tests draw the examples of -m method, but a failing one is not shrunk
    os.environ.setdefault("DFLASH2_HYPOTHESIS", "mutants")
    import torch  # noqa: F401  imported once, before the forks: the children share it
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.mistral.modeling_mistral  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401
    from tqdm import tqdm

    results = []
    with tempfile.TemporaryDirectory(prefix="dflash2-mutants-") as repo:
        copy_repo(repo)
        log = os.path.join(repo, ".log")
        t0 = time.time()
        failed = run_tests(repo, None, False, log)
        if failed:
            print(
                f"error: -m method fails without any break: {', '.join(sorted(failed))}; "
                f"see its log:\n{open(log).read()[-2000:]}",
                file=sys.stderr,
            )
            return 1
        baseline = time.time() - t0
        limit = max(60, round(5 * baseline))
        print(f"baseline: -m method passes ({baseline:.0f} s); a run is stopped after {limit} s")
        for b in tqdm(breaks, desc="breaks", unit="break", file=sys.stdout):
            failed, stage = try_break(repo, b, log, limit)
            results.append((b, failed, stage))
    return report(results) or int(bool(stale))


def stale_pinned_lines(rules: dict, breaks: list) -> list:
    """A break's tests that its rule's Pinned by line in docs/semantics.md does not name."""
    out = []
    for b in breaks:
        missing = [t for t in b.tests if t not in pinned_names(rules, b.rule)]
        if missing and not b.equivalent:
            out.append(f"{b.file}: {b.why}: rule {b.rule!r} does not name {', '.join(missing)}")
    return out


def report(results) -> int:
    bad = []
    print(
        "\nbreak by break (caught: the tests that failed; stage 2: caught by the rest of -m method)"
    )
    for b, failed, stage in results:
        if b.equivalent:
            status = "equivalent" if not failed else "CAUGHT, listed as equivalent"
        else:
            status = ("caught" if stage == 1 else "caught at stage 2") if failed else "SURVIVED"
        if status != "caught" and status != "equivalent":
            bad.append(b)
        tests = ", ".join(sorted(failed)) if failed else "-"
        print(f"  {b.file:12} {status:28} {b.why}  [{tests}]")
    print(f"\n  {'file':12} {'breaks':>6} {'caught':>6} {'survived':>8} {'equivalent':>10}")
    for name in (*FILES, "all"):
        mine = [(b, f) for b, f, _ in results if name in (b.file, "all")]
        if mine:
            caught = sum(1 for b, f in mine if f and not b.equivalent)
            surv = sum(1 for b, f in mine if not f and not b.equivalent)
            eq = sum(1 for b, f in mine if b.equivalent)
            print(f"  {name:12} {len(mine):6} {caught:6} {surv:8} {eq:10}")
    if bad:
        print(f"\n{len(bad)} break(s) not caught as listed: see above")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
