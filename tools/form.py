"""The repository's form, checked: how it is laid out and whether its docs name what exists (what
the code computes is test_all.py's and the packages' test_*.py's).

    python -m pytest -q tools/form.py

Its name is not test_*.py, so `python -m pytest -q` leaves it out: a learner's edit to the method
fails a behaviour test or none. .ci/run runs it right after the test suite.

The map: each "# ====" banner (a check holds it equal to the banners):
    imports                         one way, no reading-path function rebound, none idle
    the reading path                the method runs without the pipeline
    cited names and paths           each cited module.name is defined there; no absolute folder
    the docs against the code       .ci/run, the walkthrough's exercises, the flags, the figures
    maps and budgets                the reading order, the test files' and packages' maps, the
                                    line budgets
"""

import ast
import glob
import graphlib
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
    """{module as imported ("model", "speed.cost"): its path}: the project's .py files."""
    files = {}
    for folder in ("", "speed", "tools", "prompts", "compat", "support"):
        for name in sorted(os.listdir(os.path.join(root, folder))):
            if name.endswith(".py") and name != "__init__.py":
                module = ".".join(filter(None, [folder, name[:-3]]))
                files[module] = os.path.join(root, folder, name)
    files["speed"] = os.path.join(root, "speed", "__init__.py")
    return files


def imports(path) -> list:
    """[(line, names, indented: inside a block)] of each import: `from m import x` names m, m.x."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            m = getattr(node, "module", None)
            names = [m] * bool(m) + [f"{m}.{a.name}" if m else a.name for a in node.names]
            found.append((node.lineno, names, node.col_offset > 0))
    return found


def project_imports(root=HERE) -> tuple:
    """-> ({module: the project modules it imports}, [project imports inside a function])."""
    files, graph, inside_functions = project_files(root), {}, []
    for module, path in files.items():
        found, package = set(), module.rpartition(".")[0]
        for line, names, indented in imports(path):
            # a project module by its full name, or by its name within the importer's package
            hits = {m for n in names for m in (n, f"{package}.{n}".lstrip(".")) if m in files}
            found |= hits
            if hits and indented and not module.rpartition(".")[2].startswith("test_"):
                inside_functions.append(f"{module}:{line}")
        graph[module] = found - {module}
    return graph, inside_functions


def reachable(graph: dict, start: str) -> set:
    seen = set(graph[start])
    while more := set().union(*(graph[m] for m in seen)) - seen:
        seen |= more
    return seen


def test_imports_flow_one_way_and_none_is_idle():
    """No import cycle, no project import inside a function; train.py reaches neither decoding nor
    speed/'s timings (tools/served.py does); data.py stands without prepare.py; speed/ is reached
    through machine.py, tune.py and bench.py only; the mechanism imports torch and itself. Each
    package module is imported by another file (a test counts), run by run.sh or .ci/run, or
    started by another module (`-m package.name`, or "name.py")."""
    graph, inside_functions = project_imports()
    assert {"decoding", "speed.cost", "tools.served", "prompts.word_problems"} <= set(graph)
    graphlib.TopologicalSorter(graph).prepare()  # a cycle: CycleError, naming it
    assert inside_functions == []
    assert "train" in graph["tools.served"] and "decoding" in reachable(graph, "tools.served")
    training = reachable(graph, "train")
    assert {"model", "loss", "support.metrics", "data", "speed.machine"} <= training
    no = {"tools.served", "decoding", "tree", "generate", "prepare", "speed.cost", "speed.tune"}
    assert not training & no
    assert "prepare" not in reachable(graph, "data") and "decoding" not in reachable(graph, "data")
    doors = {"speed", "speed.machine", "speed.tune", "speed.bench"}
    top = [m for m in graph if "." not in m and m not in ("test_all", "speed")]
    assert [(m, n) for m in top for n in graph[m] - doors if n.startswith("speed")] == []
    mechanism = ("conv", "selector", "attention", "model", "loss", "decoding", "tree")
    for m in mechanism:
        names = {n for _, names, _ in imports(os.path.join(HERE, f"{m}.py")) for n in names}
        # transformers only for the target's own KV cache (decoding.new_cache)
        allowed = {"transformers", "transformers.DynamicCache"} if m == "decoding" else set()
        roots = {n.split(".")[0] for n in names - allowed}
        assert roots <= {"torch", *mechanism} | sys.stdlib_module_names, (m, roots)
    files, imported = project_files(), set().union(*graph.values())
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
    assert idle == []


# What a learner edits is what runs: nothing outside the tests rebinds a name of these.
READING_PATH = ("conv", "selector", "attention", "model", "loss", "decoding", "tree", "data")
READING_PATH += ("train", "prepare", "export", "generate")


def rebindings(source: str) -> list:
    """Where source assigns, deletes or setattr's (monkeypatch's too) an attribute of a reading-path
    module, named as an import bound it (`m`, `t.loss`) -> ["line: code"]."""
    nodes = list(ast.walk(ast.parse(source)))
    bound = {}  # every name an import binds -> what it names (import a.b: a)
    for node in nodes:
        for a in node.names if isinstance(node, (ast.Import, ast.ImportFrom)) else []:
            full = a.asname or isinstance(node, ast.ImportFrom)
            bound[a.asname or a.name.split(".")[0]] = a.name if full else a.name.split(".")[0]

    def reading(e) -> bool:  # e names a reading-path module
        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name):  # t.loss
            return e.attr in READING_PATH and e.value.id in bound
        return isinstance(e, ast.Name) and bound.get(e.id) in READING_PATH

    found, imports_reading = [], any(m in READING_PATH for m in bound.values())
    for node in nodes:
        # what an assignment, del, augmented assignment or for loop binds
        targets = getattr(node, "targets", [getattr(node, "target", None)])
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
    """The function a learner edits is the one generate.py, --show and the tools run, never one put
    in its place at run time. The scan catches each kind of rebinding, planted."""
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


# ============================================================================ the reading path
# a pytest plugin, first on the import path: refuses NAMES and their modules, says which it met
UNIMPORTABLE = """
import sys
NAMES = {"data", "train", "prepare", "export", "generate", "support", "compat", "speed", "tools"}
refused = set()
class Unimportable:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in NAMES:
            refused.add(name)
            raise ModuleNotFoundError(f"{name}: made unimportable")
sys.meta_path.insert(0, Unimportable())
def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line("refused: " + " ".join(sorted(refused)))
"""


def test_the_method_runs_without_the_pipeline(tmp_path):
    """test_all.py -m method passes, none skipped for an import, with the pipeline and the packages
    made unimportable (a plugin refuses them): Part 1 needs only the mechanism."""
    (tmp_path / "unimportable.py").write_text(UNIMPORTABLE)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    cmd = "-m pytest -p unimportable -p no:cacheprovider -m method -q -rs test_all.py".split()
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, *cmd], cwd=HERE, capture_output=True, text=True, env=env)
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
# an absolute path of two parts or more, not the system's (/proc/cpuinfo, /dev/shm, /usr/bin/env) or
# a server's (/v1/models); ~/.cache/dflash2, the documented cache, is not one
OUTSIDE = re.compile(
    r"(?<![\w.~}$:/-])/(?!(?:proc|dev|sys|usr|bin|etc|v1)/)[A-Za-z][\w.-]*/[\w.-]+"
)
FSTRING_MIDDLE = getattr(tokenize, "FSTRING_MIDDLE", -1)  # Python 3.12+: an f-string's pieces


def cited_texts(root=HERE):
    """(file, line, text): every comment and string of the project's .py files (an f-string's
    {expressions}, which are code, as {}), and every line of README.md and docs/*.md."""
    for path in project_files(root).values():
        for tok in tokenize.generate_tokens(io.StringIO(open(path).read()).readline):
            text = tok.string
            if tok.type == tokenize.STRING and re.match(r"[rbRB]?[fF]", text):
                text = re.sub(r"\{[^{}]*\}", "{}", text)
            elif tok.type == FSTRING_MIDDLE:  # a piece, perhaps after an {expression}
                text = "{}" + text
            if tok.type == tokenize.STRING and re.fullmatch(r"([\'\"])[\w.]+\1", text):
                continue  # a key such as "model.norm.weight" names a tensor, not a module's name
            if tok.type in (tokenize.COMMENT, tokenize.STRING, FSTRING_MIDDLE):
                yield os.path.relpath(path, root), tok.start[0], text
    for path in ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=root)):
        for i, line in enumerate(open(os.path.join(root, path)), 1):
            yield path, i, line


def test_every_cited_name_and_path_resolves():
    """Each `module.name` the comments, strings and docs cite is defined at that module's top level
    (not imported there), and none names a folder outside the repository by its absolute path."""
    defined = {}  # module, as imported -> the names its top level binds
    for module, path in project_files().items():
        body = ast.parse(open(path).read()).body
        nodes = [n for s in body if not hasattr(s, "name") for n in ast.walk(s)]
        defined[module] = {s.name for s in body if hasattr(s, "name")} | {  # def, class, =
            n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        }
    last = [m.rpartition(".")[2] for m in defined]
    short = {name: m for name, m in zip(last, defined) if last.count(name) == 1}

    def unresolved(cited: str) -> bool:
        parts, seps = re.split(r"[./]", cited), re.findall(r"[./]", cited)
        k = next((k for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in defined), 0)
        module, at = ".".join(parts[:k]) if k else short.get(parts[0]), max(k, 1)
        if not module or at == len(parts) or "/" in seps[at - 1 :]:
            return False  # not a project module, the module itself, or a file's path
        name = parts[at]
        if name in FILE_ENDINGS or name in defined[module] or "__mutmut_" in name:
            return False  # a file, a name defined there, a mutant (docs/mutants.md)
        return not hasattr(torch.Tensor, name) and not hasattr(torch.nn.Module, name)

    stale = []
    for file, line, text in cited_texts():
        found = [*OUTSIDE.finditer(text), *(m for m in CITED.finditer(text) if unresolved(m[0]))]
        stale += [f"{file}:{line + text[: m.start()].count(chr(10))}: {m[0]}" for m in found]
    assert stale == []


# ======================================================================== the docs against the code
def test_ci_runs_the_readme_commands_first():
    """.ci/run starts with the README's set-up, test and form commands as written there: CI fails
    where a fresh machine that follows the README would."""
    readme = open(os.path.join(HERE, "README.md")).read()
    wanted = (r"python3 -m venv .*", r"python -m pytest -q", r"python -m pytest -q tools/form.py")
    written = [re.search(rf"\n    ({w})\n", readme).group(1) for w in wanted]
    run = open(os.path.join(HERE, ".ci", "run")).read().splitlines()
    commands = [line for line in run if line and not line.startswith(("#", "set ", "cd "))]
    assert commands[:3] == written


def test_walkthrough_exercises_name_the_code_they_change():
    """Each of docs/walkthrough.md's twelve exercises names a file and a function and quotes the
    code to change (Replace `X` / Delete `X`): X occurs once in that function."""
    text = open(os.path.join(HERE, "docs", "walkthrough.md")).read()
    pattern = r"\*\*(\d+)\. [^*]+\*\* \((\w+\.py),\s+`([\w.]+)`\).*?(?:Replace|Delete)\s+`([^`]+)`"
    found = re.findall(pattern, text, re.S)
    assert [int(n) for n, *_ in found] == list(range(1, 13))
    for n, file, function, code in found:
        source = open(os.path.join(HERE, file)).read()
        nodes = [ast.parse(source)]
        for name in function.split("."):  # "Tree.ancestors": the class, then its method
            nodes = [
                c for p in nodes for c in ast.iter_child_nodes(p) if getattr(c, "name", 0) == name
            ]
        bodies = [ast.get_source_segment(source, d) for d in nodes]
        assert [b.count(code) for b in bodies] == [1], f"exercise {n}: {file}, {function}: {code!r}"


def test_the_training_docs_name_only_real_flags(capsys):
    """Each flag of docs/training.md's flags table is one train.py --help prints (a flag added for
    an experiment needs no row)."""
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    flags = set(re.findall(r"^ +(--[a-z][\w-]*)", capsys.readouterr().out, re.M))
    doc = open(os.path.join(HERE, "docs", "training.md")).read()
    table = doc[doc.index("| flag | default | meaning |") :].split("\n\n")[0]
    first_column = "".join(row.split("|")[1] for row in table.splitlines())
    named = set(re.findall(r"`(--[a-z][\w-]*)", first_column))
    assert "--data" in named and named - flags == set()


def test_the_committed_figures_are_todays(tmp_path):
    """docs/figures holds, byte for byte, what python -m tools.figures draws today."""
    for f in figures.pictures(str(tmp_path)):
        old = os.path.join(HERE, "docs", "figures", os.path.basename(f))
        assert open(f).read() == open(old).read(), "stale: python -m tools.figures docs/figures"


# ============================================================================ maps and budgets
def banners_and_map(path) -> tuple:
    """-> (the map in path's docstring, its banners), each [(level, title)]: level 1 for "# ===="
    (4 spaces in the map), 2 for "# ----" (8 spaces)."""
    text = open(path).read()
    doc = text.split('"""')[1]
    mapped = re.finditer(r"^( {4}| {8})(\S.*?)(?:  |$)", doc[doc.index("The map:") :], re.M)
    banners = re.finditer(r"^# (={4,}|-{4,}) (.+)$", text, re.M)
    return [(len(m[1]) // 4, m[2]) for m in mapped], [(1 + (m[1][0] == "-"), m[2]) for m in banners]


def test_the_maps_name_what_is_there():
    """README.md's reading order names every top-level .py file and no other, the mechanism first,
    the walkthrough and test_all.py last; each test file's docstring maps its banners in order
    (test_all.py: its helpers, then the method); each package's __init__.py maps its modules, a
    line each at 4 spaces, and no other."""
    readme = open(os.path.join(HERE, "README.md")).read()
    order = readme[readme.index("### Reading order") : readme.index("What a learner can skip")]
    named = list(dict.fromkeys(re.findall(r"`(\w+\.py)`", order)))
    assert sorted(named) == sorted(glob.glob("*.py", root_dir=HERE))
    mechanism = ["conv.py", "selector.py", "attention.py", "model.py", "loss.py", "decoding.py"]
    assert named[:7] == mechanism + ["tree.py"] and named[-2:] == ["walkthrough.py", "test_all.py"]
    machinery = glob.glob("*/test_*.py", root_dir=HERE)
    assert sorted(p.split("/")[0] for p in machinery) == ["compat", "speed", "support", "tools"]
    for path in ["test_all.py", "tools/form.py"] + machinery:
        listed, found = banners_and_map(os.path.join(HERE, path))
        assert found and listed == found, path
    listed, _ = banners_and_map(os.path.join(HERE, "test_all.py"))
    assert listed[:3] == [(1, "helpers"), (1, "the method, by hand"), (2, "conv.py")]
    modules_of = lambda names: {m for m in names if not m.startswith("test_") and m != "conftest"}
    for package in ("support", "compat", "speed", "tools"):
        folder = os.path.join(HERE, package)
        doc = ast.get_docstring(ast.parse(open(os.path.join(folder, "__init__.py")).read()))
        mapped = set(re.findall(r"^ {4}(\w+)\.py ", doc, re.M)) - {"__init__"}
        modules = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")} - {"__init__"}
        assert modules_of(mapped) == modules_of(modules), package


# The weight is a decision, not a drift: each part's non-test Python (this file is a test), in
# lines, stays under its budget: what is left (issue 71) and a little room, at the top level for a
# learner's variant or two. A change that needs more raises the budget in the same commit and says
# why.
LINE_BUDGET = {
    ".": 3300,
    "prompts": 295,
    "support": 2720,
    "compat": 630,
    "speed": 830,
    "tools": 1850,
}


def test_each_part_keeps_its_line_budget():
    lines = {}
    for part in LINE_BUDGET:
        names = glob.glob("*.py", root_dir=os.path.join(HERE, part))
        names = [
            f for f in names if not f.startswith("test_") and f not in ("conftest.py", "form.py")
        ]
        lines[part] = sum(len(open(os.path.join(HERE, part, f)).read().splitlines()) for f in names)
    assert {p: (n, LINE_BUDGET[p]) for p, n in lines.items() if n > LINE_BUDGET[p]} == {}
    assert sum(lines.values()) <= sum(LINE_BUDGET.values())
