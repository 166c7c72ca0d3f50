"""The package keeps the shape docs/architecture.md describes.

Static checks on src/labutils (no module is imported for them): function length, the
layers between packages, the import graph, private names, old module paths, and where
code comments point.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from labutils import compat

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "labutils"
# Modules are split by concern, not by size; a function's body (its docstring aside)
# is held to this many lines. Today's longest are sbatch_script and find_failure.
MAX_FUNCTION_LINES = 75
# package -> the packages it may import, functions' imports included (docs/architecture.md
# draws the same table). labutils.errors and labutils.compat are leaves any layer uses;
# the top (labutils/__init__.py, __main__) may import anything.
LAYERS = {
    "labutils.runtime": set(),
    "labutils.dist": {"labutils.runtime"},
    "labutils.run": {"labutils.runtime"},
    "labutils.notebook": {"labutils.runtime", "labutils.run"},
    "labutils.cluster": {"labutils.runtime", "labutils.run"},
    "labutils.course": {"labutils.runtime", "labutils.run", "labutils.dist"},
    "labutils.grading": {"labutils.runtime", "labutils.run", "labutils.course", "labutils.dist"},
}
LEAVES = {"labutils.errors", "labutils.compat"}
# Imports against the layers still in the code, each to be moved (none today). None
# may be added; one removed from the code must be removed here too.
KNOWN_AGAINST_LAYERS: set[str] = set()


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module in the package."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = modules()


def imports_of(path: Path) -> set[str]:
    """The labutils modules a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("labutils")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("labutils"):
            for alias in node.names:  # `from labutils.run import follow` imports a module
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return {compat.MOVED.get(name, name) for name in found} - {"labutils"}


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def imports_against_layers() -> set[str]:
    found = set()
    for name, path in MODULES.items():
        allowed = LAYERS.get(package_of(name))
        if allowed is None:  # the top and the leaves
            continue
        for imported in imports_of(path) & set(MODULES):
            target = package_of(imported)
            if target != package_of(name) and target not in allowed | LEAVES:
                found.add(f"{name} -> {imported}")
    return found


def test_imports_follow_the_layers():
    found = imports_against_layers()
    assert not found - KNOWN_AGAINST_LAYERS, \
        f"imports against the layers (LAYERS): {sorted(found - KNOWN_AGAINST_LAYERS)}"
    assert not KNOWN_AGAINST_LAYERS - found, \
        f"gone from the code, remove from KNOWN_AGAINST_LAYERS: {sorted(KNOWN_AGAINST_LAYERS - found)}"


def test_the_layer_table_in_the_docs_is_this_one():
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(labutils\.\w+)` \|.*\| ([^|]*) \|$", text, re.M)
    documented = {pkg: {f"labutils.{p.strip()}" for p in imports.split("(")[0].split(",")
                        if f"labutils.{p.strip()}" in LAYERS}
                  for pkg, imports in rows}
    assert documented == {pkg: {p for p in allowed} for pkg, allowed in LAYERS.items()}


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    return body[-1].end_lineno - body[0].lineno + 1 if body and body[-1].end_lineno else 0


def test_no_function_is_too_long():
    long = {f"{name}.{node.name}": n for name, path in MODULES.items()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (n := body_lines(node)) > MAX_FUNCTION_LINES}
    assert not long, f"split these into steps: {long}"


def test_the_import_graph_has_no_cycle():
    graph = {name: imports_of(path) & set(MODULES) for name, path in MODULES.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"modules that import each other: {cycles}"


def test_the_runtime_needs_only_the_standard_library():
    """What runs in the keeper and in every rank before the script: nothing heavy."""
    for name, path in MODULES.items():
        if name.startswith("labutils.runtime"):
            outside = {m for m in imports_of(path) if not m.startswith("labutils.runtime")}
            assert not outside, f"{name} imports {outside}"
            third_party = {a.name.split(".")[0] for n in ast.walk(ast.parse(path.read_text()))
                           if isinstance(n, (ast.Import,)) for a in n.names} & {"torch", "psutil"}
            assert not third_party, f"{name} imports {third_party}"


def test_no_private_name_is_used_outside_its_module():
    pattern = re.compile(r"^\s*from (labutils[\w.]*) import (.*)$", re.M)
    offenders = []
    for path in [*SRC.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        for module, names in pattern.findall(path.read_text()):
            private = [n.strip() for n in names.strip("() \\").split(",")
                       if n.strip().startswith("_") and not n.strip().startswith("__")]
            if private:
                offenders.append(f"{path.relative_to(ROOT)}: {module} {private}")
    assert not offenders, offenders


def test_the_code_uses_the_new_module_paths():
    """Old paths are for learners' notebooks and scripts (compat.MOVED), not for us."""
    old = re.compile(r"\b(" + "|".join(re.escape(m) for m in compat.MOVED) + r")\b(?!\.)")
    offenders = []
    for path in [*SRC.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        if path.name in ("compat.py", "test_architecture.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"^\s*(from|import) ", line) and old.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, offenders


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the next test checks it
@pytest.mark.parametrize("old", sorted(compat.MOVED))
def test_every_old_module_path_is_the_moved_module(old):
    assert importlib.import_module(old) is importlib.import_module(compat.MOVED[old])


def test_comments_cite_files_in_the_repository():
    """Code points readers at docs/ in this repository, not at documents outside it."""
    outside = re.compile(r"\b(DESIGN|CURRICULUM|STYLE)\.md\b")
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in [*SRC.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
                 if p.name != "test_architecture.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line)]
    assert not offenders, offenders
    cited = {m for p in SRC.rglob("*.py") for m in re.findall(r"docs/[\w./-]+\.md", p.read_text())}
    missing = sorted(m for m in cited if not (ROOT / m).is_file())
    assert not missing, f"cited but not in the repository: {missing}"


def test_an_old_path_warns_once_with_its_new_path_and_the_release_that_drops_it():
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('always'); import labutils; "
            "import labutils.viz; import labutils.viz; from labutils.launcher import launch")
    stderr = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stderr
    warned = [line for line in stderr.splitlines() if "DeprecationWarning" in line]
    assert len(warned) == 2, stderr  # labutils.viz once, labutils.launcher once
    assert f"labutils.viz is labutils.course.viz now; the old path goes in labutils " \
        f"{compat.REMOVED_IN}" in warned[0]
    assert not any(name.split(".")[1].startswith("_") for name in compat.MOVED)  # public only
