"""The repository's form, checked: how it is laid out and whether its docs name what exists, not
what the code computes (test_all.py and the packages' test_*.py check that).

    python -m pytest -q tools/form.py

Its name is not test_*.py, so `python -m pytest -q` leaves it out: a learner's edit to the method
(a line added above a rule, a flag for an experiment) fails a behaviour test or none. These checks
are the developers' step: .ci/run runs it right after the test suite, and of them only the line
budget speaks when a file grows (LINE_BUDGET keeps a margin for a variant or two).

The map: each "# ====" banner (a check holds it equal to the banners):
    imports                         they flow one way, nothing rebinds a reading-path function,
                                    every module of the packages is imported or run
    the reading path                the top level is README.md's reading order; the method runs
                                    without the pipeline
    cited names and paths           each cited module.name is defined there; no absolute folder
    the docs against the code       .ci/run starts with the README's commands; the walkthrough's
                                    exercises quote their functions; the flags table names real
                                    flags; the committed figures are today's
    maps and budgets                the test files' maps, the packages' maps, the line budgets
"""

import ast
import glob
import io
import os
import re
import subprocess
import sys
import tokenize

import pytest
import torch

import train
from tools import figures

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ============================================================================ imports
def project_files(root=HERE) -> dict:
    """{module, named as imported ("model", "speed.cost", "tools.plot"): its path}: the .py files of
    the top level, speed/, tools/, prompts/, compat/ and support/, and speed/__init__.py."""
    files = {}
    for folder in ("", "speed", "tools", "prompts", "compat", "support"):
        for name in sorted(os.listdir(os.path.join(root, folder))):
            if name.endswith(".py") and name != "__init__.py":
                module = ".".join(filter(None, [folder, name[:-3]]))
                files[module] = os.path.join(root, folder, name)
    files["speed"] = os.path.join(root, "speed", "__init__.py")
    return files


def project_imports(root=HERE) -> tuple:
    """-> ({module: the project modules it imports}, [function-level imports of project modules])
    over project_files."""
    files = project_files(root)

    def resolve(name, here):
        """The project module an import names, seen from module `here` (None: not the project's)."""
        for candidate in (name, f"{here.rpartition('.')[0]}.{name}".lstrip(".")):
            if candidate in files:
                return candidate
        return None

    graph, inside_functions = {}, []
    for module, path in files.items():
        tree_ = ast.parse(open(path).read())
        found = set()
        for node in ast.walk(tree_):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            hits = {m for m in (resolve(n, module) for n in names) if m}
            found |= hits
            if hits and node.col_offset > 0 and not module.rpartition(".")[2].startswith("test_"):
                inside_functions.append(f"{module}:{node.lineno}")
        graph[module] = found - {module}
    return graph, inside_functions


def import_cycle(graph: dict):
    """A cycle of the import graph as a list of modules, or None: depth-first search."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        state[m] = "done"
        stack.pop()
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


def reachable(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        for n in graph.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_imports_flow_one_way():
    """No import cycle, no project import hidden inside a function, train.py reaches neither
    decoding nor speed/'s timings (tools/served.py does, and runs after it), the data path stands
    without prepare.py, and the CPU machinery (speed/) is reached only through its two doors,
    machine.py and tune.py (and bench.py, which is generate.py --bench)."""
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    graph, inside_functions = project_imports()
    assert {"decoding", "speed.cost", "tools.served", "prompts.word_problems"} <= set(graph)
    assert import_cycle(graph) is None
    assert inside_functions == []
    # training reaches no decoding: the served evaluation is tools/served.py's, which imports
    # train.py
    assert "train" in graph["tools.served"] and "decoding" in reachable(graph, "tools.served")
    training = reachable(graph, "train")
    assert {"model", "loss", "support.metrics", "data", "speed.machine"} <= training
    no = {"tools.served", "decoding", "tree", "generate", "prepare", "speed.cost", "speed.tune"}
    assert not training & no
    assert "prepare" not in reachable(graph, "data") and "decoding" not in reachable(graph, "data")
    core = [m for m in graph if "." not in m and m not in ("test_all", "speed")]
    doors = {"speed", "speed.machine", "speed.tune", "speed.bench"}
    assert {
        m: graph[m] - doors for m in core if {n for n in graph[m] if n.startswith("speed")} - doors
    } == {}
    # the mechanism is the ground floor: its files import torch, the standard library and one
    # another, nothing of support/, compat/, speed/ or tools/. transformers only for the target's
    # own KV cache (decoding.new_cache); a scaled RoPE's frequencies come with the config
    # (compat/config_json.py computes them where it reads one)
    mechanism = ("conv", "selector", "attention", "model", "loss", "decoding", "tree")
    for m in mechanism:
        names = set()
        for node in ast.parse(open(os.path.join(HERE, f"{m}.py")).read()).body:
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names |= {f"{node.module}.{a.name}" for a in node.names}
        allowed = {"transformers.DynamicCache"} if m == "decoding" else set()
        roots = {n.split(".")[0] for n in names - allowed}
        assert roots <= {"torch", *mechanism} | sys.stdlib_module_names, (m, roots)


# What a learner edits is what runs (issue 64): nothing outside the tests rebinds a name of these.
READING_PATH = ("conv", "selector", "attention", "model", "loss", "decoding", "tree", "data")
READING_PATH += ("train", "prepare", "export", "generate")


def rebindings(source: str) -> list:
    """Where source assigns to or deletes an attribute of a reading-path module, or sets one with
    setattr / delattr (monkeypatch's too) -> ["line: code"]. The module is a name an import bound to
    it (`import model as m`: m) or an attribute of such a name (`t.loss`, t the imported train)."""
    nodes = list(ast.walk(ast.parse(source)))
    bound = {}  # every name an import binds -> what it names (import a.b: a)
    for node in nodes:
        for a in node.names if isinstance(node, (ast.Import, ast.ImportFrom)) else []:
            full = a.asname or isinstance(node, ast.ImportFrom)
            bound[a.asname or a.name.split(".")[0]] = a.name if full else a.name.split(".")[0]

    def reading(e) -> bool:  # e names a reading-path module
        if isinstance(e, ast.Name):
            return bound.get(e.id) in READING_PATH
        return (
            isinstance(e, ast.Attribute)
            and e.attr in READING_PATH
            and isinstance(e.value, ast.Name)
            and e.value.id in bound
        )

    found, imports_reading = [], any(m in READING_PATH for m in bound.values())
    for node in nodes:
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        targets = [t for e in targets for t in (e.elts if isinstance(e, ast.Tuple) else [e])]
        hit = any(isinstance(t, ast.Attribute) and reading(t.value) for t in targets)
        if isinstance(node, ast.Call) and node.args:
            f, first = node.func, node.args[0]
            name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
            # a variable, where the file imports the reading path, may hold one of its modules
            # (support/show.py's `wrapped` set decoding's steps through a loop's variable)
            maybe = isinstance(first, ast.Name) and first.id not in bound and imports_reading
            hit = name in ("setattr", "delattr") and (reading(first) or maybe)
        if hit:
            found.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {code}" for line, code in sorted(found)]


def test_nothing_rebinds_a_reading_path_function():
    """No module outside the tests assigns to an attribute of a reading-path module (conv.py ..
    generate.py): the function a learner edits is the one generate.py, --show and the tools run,
    never one put in its place at run time. The scan catches each kind of rebinding, planted."""
    planted = (
        "import decoding\nimport model as m\nimport train as t\nimport tree\nimport show\n"
        "decoding.draft_proposal = print\n"
        "m.rope_frequencies, x = print, 1\n"
        "t.loss.objective += 1\n"
        "setattr(tree, 'draft_tree', print)\n"
        "mp.setattr(decoding, 'accept', print)\n"
        "del m.sdpa\n"
        "[setattr(step, 'x', 1) for step in (tree, decoding)]\n"
        "show.speculate = print\nself.model.x = 1\nmodel = 1\nsetattr(show, 'x', 1)\n"
    )
    assert [r.split(":")[0] for r in rebindings(planted)] == [str(n) for n in range(6, 13)]
    found = []
    for module, path in project_files().items():
        if not module.rpartition(".")[2].startswith(("test_", "conftest")):
            found += [f"{module}:{r}" for r in rebindings(open(path).read())]
    assert found == []


def test_every_package_module_is_imported_or_run():
    """Nothing is imported by nothing and tested by nothing: each module of the packages is
    imported by another project file (a test file counts), run by run.sh or .ci/run, or started by
    another module (`-m package.name`, or its file name in a subprocess's command)."""
    graph, _ = project_imports()
    files = project_files()
    imported = set().union(*graph.values())
    scripts = "".join(open(os.path.join(HERE, f)).read() for f in ("run.sh", ".ci/run"))
    idle = []
    for module, path in files.items():
        name = module.rpartition(".")[2]
        if "." not in module or name.startswith("test_") or name == "conftest":
            continue  # the reading path, the tests
        code = "".join(open(p).read() for m, p in files.items() if m != module)
        started = f"-m {module}" in scripts + code or f'"{name}.py"' in code
        if module not in imported and not started and os.path.relpath(path, HERE) not in scripts:
            idle.append(module)


# ============================================================================ the reading path
def test_the_top_level_is_the_reading_path():
    """Every top-level .py file is one README.md's reading order names, and every file it names is
    there: the mechanism, the pipeline, the walkthrough and test_all.py, in that order."""
    readme = open(os.path.join(HERE, "README.md")).read()
    order = readme[readme.index("### Reading order") : readme.index("What a learner can skip")]
    named = list(dict.fromkeys(re.findall(r"`(\w+\.py)`", order)))
    assert sorted(named) == sorted(f for f in os.listdir(HERE) if f.endswith(".py"))
    mechanism = ["conv.py", "selector.py", "attention.py", "model.py", "loss.py", "decoding.py"]
    assert named[:7] == mechanism + ["tree.py"] and named[-2:] == ["walkthrough.py", "test_all.py"]


UNIMPORTABLE = """
import sys

NAMES = {"data", "train", "prepare", "export", "generate", "support", "compat", "speed", "tools"}
refused = set()


class Unimportable:  # first on the import path: refuses NAMES and their modules
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in NAMES:
            refused.add(name)
            raise ModuleNotFoundError(f"{name}: made unimportable")


sys.meta_path.insert(0, Unimportable())


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line("refused: " + " ".join(sorted(refused)))
"""


def test_the_method_runs_without_the_pipeline(tmp_path):
    """python -m pytest -m method -q test_all.py collects and passes with data, train, prepare,
    export, generate, support/, compat/, speed/ and tools/ made unimportable (a plugin refuses
    them): Part 1 needs only the mechanism, and no method test is skipped for want of the rest."""
    (tmp_path / "unimportable.py").write_text(UNIMPORTABLE)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "unimportable", "-p", "no:cacheprovider"]
        + ["-m", "method", "-q", "-rs", "test_all.py"],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "refused: data" in run.stdout  # the guarded block met the plugin
    skipped = re.findall(r"^SKIPPED \[\d+\] test_all.py:\d+: (.*)$", run.stdout, re.M)
    assert not [why for why in skipped if "import" in why], run.stdout[-3000:]
    assert re.search(r"\b\d{2,} passed", run.stdout), run.stdout[-3000:]


# ============================================================================ cited names and paths
# A cited name: a project module, dotted or by its last part as the code imports it ("machine" for
# speed/machine.py), "." or "/" between the parts, then the name; one letter is a placeholder.
CITED = re.compile(r"(?<![\w./-])(?:[a-z_][a-z0-9_]*[./])+[A-Za-z_][A-Za-z0-9_]+(?!\w)")


FILE_ENDINGS = set("py md json jsonl safetensors pt svg txt gguf sh toml".split())


TEXT_TOKENS = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)}


def cited_texts(root=HERE):
    """(file, line, text): every comment and string of the project's .py files (an f-string without
    its {expressions}, which are code), and every line of README.md and docs/*.md."""
    for path in project_files(root).values():
        for tok in tokenize.generate_tokens(io.StringIO(open(path).read()).readline):
            text = tok.string
            if tok.type == tokenize.STRING and re.match(r"[rbRB]?[fF]", text):
                text = re.sub(r"\{[^{}]*\}", "", text)
            if tok.type == tokenize.STRING and re.fullmatch(r"([\'\"])[\w.]+\1", text):
                continue  # a key such as "model.norm.weight" names a tensor, not a module's name
            if tok.type in TEXT_TOKENS:
                yield os.path.relpath(path, root), tok.start[0], text
    for path in ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=root)):
        for i, line in enumerate(open(os.path.join(root, path)), 1):
            yield path, i, line


def test_every_cited_module_name_resolves():
    """Each `module.name` that the docstrings, comments, messages, README.md and docs/*.md cite is
    defined at that module's top level: an import does not count (a citation names the name's
    home), and an attribute every tensor or nn.Module has (`loss.item`) is a variable's. A stale
    citation sends a reader to a name that moved or never was."""
    defined = {}  # module, as imported -> the names its top level binds
    for module, path in project_files().items():
        body = ast.parse(open(path).read()).body
        nodes = [n for s in body if not hasattr(s, "name") for n in ast.walk(s)]
        defined[module] = {s.name for s in body if hasattr(s, "name")} | {  # def, class, =
            n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        }
    last = [m.rpartition(".")[2] for m in defined]
    short = {name: m for name, m in zip(last, defined) if last.count(name) == 1}
    stale = []
    for file, line, text in cited_texts():
        for found in CITED.finditer(text):
            parts, seps = re.split(r"[./]", found.group(0)), re.findall(r"[./]", found.group(0))
            k = next((k for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in defined), 0)
            module, at = ".".join(parts[:k]) if k else short.get(parts[0]), max(k, 1)
            if not module or at == len(parts) or "/" in seps[at - 1 :]:
                continue  # not a project module, the module itself, or a file's path
            name = parts[at]
            if name in FILE_ENDINGS or name in defined[module] or "__mutmut_" in name:
                continue  # a file, a name defined there, a mutant (docs/mutants.md)
            if hasattr(torch.Tensor, name) or hasattr(torch.nn.Module, name):
                continue
            where = line + text[: found.start()].count("\n")
            stale.append(f"{file}:{where}: {found.group(0)}")
    assert stale == []


# an absolute path of two parts or more, not the system's (/proc/cpuinfo, /dev/shm, /usr/bin/env) or
# a server's (/v1/models)
OUTSIDE = re.compile(
    r"(?<![\w.~}$:/-])/(?!(?:proc|dev|sys|usr|bin|etc|v1)/)[A-Za-z][\w.-]*/[\w.-]+"
)


def test_no_doc_names_a_folder_outside_the_repository():
    """README.md, docs/*.md and the docstrings and comments of the .py files name no folder outside
    the repository by its absolute path (one machine's /work or /tmp folder): it means nothing on
    another machine, and a command shown writing there is that machine's. Paths are relative to
    the repository's root; ~/.cache/dflash2 is the documented cache, not an absolute path."""
    texts = []
    for path in ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=HERE)):
        texts += [(path, i, line) for i, line in enumerate(open(os.path.join(HERE, path)), 1)]
    for path in project_files().values():
        source, file = open(path).read(), os.path.relpath(path, HERE)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                texts.append((file, tok.start[0], tok.string))
        for node in ast.walk(ast.parse(source)):
            kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            if isinstance(node, kinds) and ast.get_docstring(node):
                texts.append((file, node.body[0].lineno, ast.get_docstring(node)))
    found = [f"{f}:{n}: {m.group(0)}" for f, n, text in texts for m in OUTSIDE.finditer(text)]
    assert found == []


# ======================================================================== the docs against the code
def test_ci_runs_the_readme_commands_first():
    """.ci/run starts with the README's set-up command, test command and form command (this file)
    as written there, before it installs anything else: CI then fails where a fresh machine that
    follows the README would."""
    readme = open(os.path.join(HERE, "README.md")).read()
    setup = re.search(r"\n    (python3 -m venv .*)\n", readme).group(1)
    tests = re.search(r"\n    (python -m pytest -q)\n", readme).group(1)
    form = re.search(r"\n    (python -m pytest -q tools/form.py)\n", readme).group(1)
    run = [line.rstrip("\n") for line in open(os.path.join(HERE, ".ci", "run"))]
    commands = [line for line in run if line and not line.startswith(("#", "set ", "cd "))]
    assert commands[:3] == [setup, tests, form]


def test_walkthrough_exercises_name_the_code_they_change():
    """Each of docs/walkthrough.md's twelve exercises names a file and a function and quotes the
    code to change (Replace `X` / Delete `X`): X occurs once in that function, wherever the
    function's lines move."""
    text = open(os.path.join(HERE, "docs", "walkthrough.md")).read()
    pattern = r"\*\*(\d+)\. [^*]+\*\* \((\w+\.py),\s+`([\w.]+)`\).*?(?:Replace|Delete)\s+`([^`]+)`"
    found = re.findall(pattern, text, re.S)
    assert [int(n) for n, *_ in found] == list(range(1, 13))
    for n, file, function, code in found:
        source = open(os.path.join(HERE, file)).read()
        bodies = [ast.get_source_segment(source, d) for d in definitions(source).get(function, [])]
        assert [b.count(code) for b in bodies] == [1], f"exercise {n}: {file}, {function}: {code!r}"


def definitions(source: str) -> dict:
    """{qualified name ("Tree.ancestors", "grow"): [its def or class nodes]} of a module."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(prefix + child.name, []).append(child)
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_the_training_docs_name_only_real_flags(capsys):
    """Each flag in the first column of docs/training.md's flags table is one train.py --help
    prints. The other way is not asked: a flag added for an experiment needs no row."""
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    flags = set(re.findall(r"^ +(--[a-z][\w-]*)", capsys.readouterr().out, re.M))
    doc = open(os.path.join(HERE, "docs", "training.md")).read()
    table = doc[doc.index("| flag | default | meaning |") :].split("\n\n")[0]
    named = {
        f for row in table.splitlines() for f in re.findall(r"`(--[a-z][\w-]*)", row.split("|")[1])
    }
    assert "--data" in named and named - flags == set()


def test_the_committed_figures_are_todays(tmp_path):
    """docs/figures holds, byte for byte, what python -m tools.figures draws today (its toy-*.svg
    are a toy run's, docs/walkthrough.md section 5)."""
    for f in figures.pictures(str(tmp_path)):
        with (
            open(f) as new,
            open(os.path.join(HERE, "docs", "figures", os.path.basename(f))) as old,
        ):
            assert new.read() == old.read(), "stale: python -m tools.figures docs/figures"


# ============================================================================ maps and budgets
def banners_and_map(path) -> tuple:
    """-> (the map in path's module docstring, the banners in path), each a list of
    (level, title): level 1 for a "# ====" banner, 2 for a "# ----" one."""
    text = open(path).read()
    doc = text.split('"""')[1]
    listed = []
    for line in doc[doc.index("The map:") :].split("\n"):
        if m := re.match(r"( {4}| {8})(\S.*?)(  |$)", line):
            listed.append((len(m.group(1)) // 4, m.group(2)))
    found = [
        (1 if m.group(1)[0] == "=" else 2, m.group(2))
        for m in re.finditer(r"^# (={4,}|-{4,}) (.+)$", text, re.M)
    ]
    return listed, found


def test_the_docstrings_map_the_banners():
    """Each test file's docstring maps its banners in the file's order: a "# ====" banner at 4
    spaces, its "# ----" subsections at 8 under it. test_all.py starts with its helpers and then the
    method; the machinery's tests are beside their packages, one file each; this file too."""
    machinery = [
        os.path.join(folder, name)
        for folder in ("support", "compat", "speed", "tools")
        for name in sorted(os.listdir(os.path.join(HERE, folder)))
        if name.startswith("test_") and name.endswith(".py")
    ]
    assert len(machinery) == 4
    for path in ["test_all.py", "tools/form.py"] + machinery:
        listed, found = banners_and_map(os.path.join(HERE, path))
        assert listed == found, path
        assert found, path
    listed, _ = banners_and_map(os.path.join(HERE, "test_all.py"))
    assert listed[:3] == [(1, "helpers"), (1, "the method, by hand"), (2, "conv.py")]


# The weight is a decision, not a drift: each part's non-test Python (this file is a test), in
# lines, stays under its budget, set to what is left (issue 71). A change that needs more raises the
# budget in the same commit and says why. The top level holds the scaled RoPE (from compat/), the
# default-data check and the one objective; support/ the loader (from data.py), run_logged and
# --report-to; tools/ lost the study's runner and mutants' catalogue (now tools/mutants.toml), and
# took plot.py's charts (ticks, chart) from support/draw.py.
LINE_BUDGET = {
    ".": 3600,
    "prompts": 310,
    "support": 2850,
    "compat": 680,
    "speed": 960,
    "tools": 2250,
}


def non_test_lines(part: str) -> int:
    folder = os.path.join(HERE, part)
    names = [f for f in os.listdir(folder) if f.endswith(".py")]
    names = [f for f in names if not f.startswith("test_") and f not in ("conftest.py", "form.py")]
    return sum(len(open(os.path.join(folder, f)).read().splitlines()) for f in names)


def test_each_part_keeps_its_line_budget():
    lines = {part: non_test_lines(part) for part in LINE_BUDGET}
    assert {p: (n, LINE_BUDGET[p]) for p, n in lines.items() if n > LINE_BUDGET[p]} == {}
    assert sum(lines.values()) <= sum(LINE_BUDGET.values())


@pytest.mark.parametrize("package", ["support", "compat", "speed", "tools"])
def test_each_package_map_names_exactly_its_modules(package):
    """A package's __init__.py maps it: a line per module, its name at 4 spaces, then what it is
    for. Every module is on the map and the map names no other (tests and fixtures aside)."""
    folder = os.path.join(HERE, package)
    doc = ast.get_docstring(ast.parse(open(os.path.join(folder, "__init__.py")).read()))
    mapped = set(re.findall(r"^ {4}(\w+)\.py ", doc, re.M)) - {"conftest"}
    mapped = {m for m in mapped if not m.startswith("test_")}
    modules = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")}
    modules -= {"__init__", "conftest"} | {m for m in modules if m.startswith("test_")}
    assert mapped == modules
