"""The package's layers and size bars, read from the source (AST only: nothing is imported, so it runs in a second).

Layers, lowest first; a module imports only from its own layer or lower ones:
  core      autopar/ (IR, placements, cost model, solver, Plan, the pass manager)
  passes    passes/, installed as autopar.passes (each pass reads and annotates the pass manager's state)
  backends  backends/, installed as autopar.backends (they run a finished Plan)
  front     the user's entry points, which run the passes and pick a backend for the user (FRONT below)
Every import counts: at module level, inside functions (a lazy import is still a dependency), under
`if TYPE_CHECKING:` (a type annotation is one too) and `importlib.import_module("autopar...")` with a constant name;
a dynamic name (an f-string) is refused, since no reader or test could follow it. An import inside a function may
defer a heavy module (torch, a backend loaded by the front door), never close a cycle: the cycle test counts it.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass

import networkx as nx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# source folder -> installed package (pyproject.toml [tool.setuptools.package-dir], checked below)
PACKAGE_DIRS = {"autopar": "autopar", "passes": "autopar.passes", "backends": "autopar.backends"}
LAYERS = ("core", "passes", "backends", "front")
# The front layer: modules whose job is to run the pipeline of passes or a backend for the user. Each may import
# any layer. (A name matches the module and, for a subpackage, everything under it.)
FRONT = {
    "autopar": "the front door: autopar.plan, and parallelize(), which loads the chosen backend on first use",
    "autopar.api": "plan(): captures the model and runs the passes in order",
    "autopar.parallel": "parallelize(): plans (or takes a finished Plan) and hands it to the chosen backend",
    "autopar.cli": "the command line: plans, explains and reports for the user",
    "autopar.__main__": "`python -m autopar` / the `autopar` script",
    "autopar.report": "the HTML report of a plan",
    "autopar.testing": "helpers that plan and run a model for a test (ours or a user's)",
    "autopar.examples": "example training scripts: plan, parallelize, train",
}
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (the longest module name the import resolves to)
    line: int
    lazy: bool  # inside a function

    def __str__(self):
        return f"{self.source} -> {self.target} (line {self.line}{', inside a function' if self.lazy else ''})"


def _modules() -> dict[str, str]:
    """Installed module name -> source path, for every .py file of the three packages."""
    out = {}
    for folder, package in PACKAGE_DIRS.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.join(ROOT, folder))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join([package, *rel])] = os.path.join(dirpath, f)
    return out


MODULES = _modules()
TREES = {m: ast.parse(open(p).read(), p) for m, p in MODULES.items()}


def _is_package(module: str) -> bool:
    return MODULES[module].endswith("__init__.py")


def _bound_names(package: str, tree: ast.Module) -> set[str]:
    """Names a package's __init__ binds at module level to something other than its own submodule: `from pkg
    import name` then means that object, not the submodule `pkg.name` (Python looks the attribute up first)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = _absolute(package, node)
            names |= {a.asname or a.name for a in node.names if base != package or a.asname}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets) and isinstance(
                node.value, ast.Dict
            ):
                # the names a PEP 562 __getattr__ exports on first use (autopar/__init__.py)
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return names


def _known(name: str) -> str | None:
    """The longest prefix of `name` that is one of our modules."""
    while name not in MODULES:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(module: str, node: ast.AST) -> list[str]:
    """The dotted names one import statement (or constant importlib call) loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _absolute(module, node)
        out = []
        for a in node.names:
            sub = f"{base}.{a.name}"
            bound = base in BOUND and a.name in BOUND[base]
            out.append(sub if sub in MODULES and not bound else base)
        return out
    return [node.args[0].value]  # importlib.import_module("...")


def _dynamic_import(node: ast.AST) -> bool:
    """importlib.import_module(...) / __import__(...)."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in ("import_module", "__import__")


def _walk(tree: ast.Module):
    """(node, inside a function) for every node."""
    stack = [(tree, False)]
    while stack:
        node, lazy = stack.pop()
        yield node, lazy
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((c, inner) for c in ast.iter_child_nodes(node))


def _scan():
    """(imports between our modules, imports of uninstalled top-level packages, dynamic imports of ours)."""
    imports, uninstalled, dynamic = [], [], []
    for module, tree in TREES.items():
        for node, lazy in _walk(tree):
            if _dynamic_import(node):
                arg = node.args[0] if node.args else None
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    text = ast.unparse(arg) if arg is not None else ""
                    if "autopar" in text or text.lstrip("f'\"").startswith("."):
                        dynamic.append(f"{module} line {node.lineno}: import_module({text})")
                    continue
            elif not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _targets(module, node):
                if name.split(".")[0] in ("passes", "backends"):
                    uninstalled.append(f"{module} line {node.lineno}: {name}")
                    name = f"autopar.{name}"  # what it means; a dependency all the same
                target = _known(name)
                if target is not None and target != module:
                    imports.append(Import(module, target, node.lineno, lazy))
    return sorted(set(imports), key=str), uninstalled, dynamic


BOUND = {m: _bound_names(m, t) for m, t in TREES.items() if _is_package(m)}
IMPORTS, UNINSTALLED, DYNAMIC = _scan()


def layer(module: str) -> str:
    if module in FRONT or any(module.startswith(f + ".") for f in FRONT if f != "autopar"):  # the root: __init__
        return "front"
    if module.startswith("autopar.passes"):
        return "passes"
    if module.startswith("autopar.backends"):
        return "backends"
    return "core"


def _folder(module: str) -> str:
    for folder, package in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(kv[1])):
        if module == package or module.startswith(package + "."):
            return folder
    raise AssertionError(module)


def test_package_dirs_match_pyproject():
    """The folders this test reads are the ones the wheel installs, and every folder with an __init__.py is a
    package the wheel lists (a subpackage left out of pyproject.toml is missing from the installed autopar)."""
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    for folder, package in PACKAGE_DIRS.items():
        if package != folder:
            assert re.search(rf'"{re.escape(package)}"\s*=\s*"{folder}"', text), f"{package} -> {folder}/"
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"packages\s*=\s*\[([^\]]*)\]", text).group(1)))
    missing = sorted(m for m in MODULES if _is_package(m) and m not in listed)
    if missing:
        pytest.fail(f"packages not in pyproject.toml [tool.setuptools] packages: {missing}")


def test_no_import_of_uninstalled_packages():
    """`passes` and `backends` exist as top-level packages only in a source checkout; installed they are
    autopar.passes and autopar.backends."""
    if UNINSTALLED:
        pytest.fail("import through autopar.passes / autopar.backends instead:\n  " + "\n  ".join(UNINSTALLED))


def test_no_dynamic_imports_of_our_modules():
    if DYNAMIC:
        pytest.fail("name the module in an import statement:\n  " + "\n  ".join(DYNAMIC))


@pytest.mark.parametrize("own", LAYERS[:3])
def test_no_upward_import(own):
    """A module of layer `own` imports only from its own layer or lower ones."""
    rank = LAYERS.index
    bad = [i for i in IMPORTS if layer(i.source) == own and rank(layer(i.target)) > rank(own)]
    if bad:
        why = (f"{i}  [{own} imports {layer(i.target)}]" for i in bad)
        pytest.fail(f"{len(bad)} upward imports from the {own} layer:\n  " + "\n  ".join(why))


def _cycles() -> list[list[str]]:
    g = nx.DiGraph()
    g.add_edges_from((i.source, i.target) for i in IMPORTS)
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


@pytest.mark.parametrize("folder", PACKAGE_DIRS)
def test_no_import_cycle(folder):
    """No cycle in the module graph, imports inside functions included (each cycle is reported under every
    folder it touches, with the imports that close it)."""
    found = [c for c in _cycles() if any(_folder(m) == folder for m in c)]
    lines = []
    for c in found:
        members = set(c)
        lines.append(f"{{{', '.join(c)}}}")
        lines += [f"    {i}" for i in sorted(IMPORTS, key=str) if i.source in members and i.target in members]
    if found:
        pytest.fail(f"{len(found)} import cycles touch {folder}/:\n  " + "\n  ".join(lines))


@pytest.mark.parametrize("folder", PACKAGE_DIRS)
def test_no_file_over_600_lines(folder):
    long = sorted(
        (n, os.path.relpath(MODULES[m], ROOT))
        for m in MODULES
        if _folder(m) == folder and (n := open(MODULES[m]).read().count("\n")) > MAX_FILE_LINES
    )
    if long:
        pytest.fail(f"files over {MAX_FILE_LINES} lines: " + ", ".join(f"{p} ({n})" for n, p in long))


@pytest.mark.parametrize("folder", PACKAGE_DIRS)
def test_no_function_over_80_lines(folder):
    """Every function and method, nested ones on their own (from `def` to its last line)."""
    long = []
    for m, tree in TREES.items():
        if _folder(m) != folder:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{os.path.relpath(MODULES[m], ROOT)}:{node.lineno} {node.name} ({n} lines)")
    if long:
        pytest.fail(f"{len(long)} functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(sorted(long)))


# ---- the checker itself, on small made-up trees ------------------------------------------------------------------


def test_resolution_of_relative_and_bound_names():
    """`from . import x` in a package means its submodule x; `from autopar import plan` means the function its
    __init__ binds (autopar.api's), not the module autopar.plan."""
    tree = ast.parse("from . import solver\nfrom autopar import plan, pipeline_model\nfrom ..cost import comm")
    a, b, c = tree.body
    assert _targets("autopar", a) == ["autopar.solver"]
    assert _targets("autopar.api", b) == ["autopar", "autopar.pipeline_model"]
    assert _targets("autopar.strategies.strided", c) == ["autopar.cost.comm"]


def test_layer_of():
    assert [layer(m) for m in ("autopar", "autopar.predict", "autopar.examples.train", "autopar.passes.solve")] == [
        "front",
        "core",
        "front",
        "passes",
    ]
    assert layer("autopar.backends.spmd.program") == "backends"


def test_lazy_imports_are_seen():
    tree = ast.parse("def f():\n    from autopar.passes import solve\n\nimport autopar.graph")
    found = {(n.lineno, lazy) for n, lazy in _walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))}
    assert found == {(2, True), (4, False)}
