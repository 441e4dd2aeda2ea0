"""The package's shape is checked, not only met once: no import loop among dlspark's and
dlspark.compat's modules (imports inside functions included), no module over 600 lines.

The import-linter contracts in ``pyproject.toml`` (the core never imports the runtimes or
the Spark bridge; the runtimes never import an algorithm package) are run here too, and
mypy over the algorithm contracts, so that the README's test command covers them.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: where each importable package's files live (dlspark.compat is mapped to compat/)
PACKAGES = {"dlspark": ROOT / "dlspark", "dlspark.compat": ROOT / "compat"}
MAX_LINES = 600


def _modules() -> dict:
    """Module name -> (path, is a package), for every module of dlspark and dlspark.compat."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package] + (parts[:-1] if is_package else parts))
            found[name] = (path, is_package)
    return found


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(modules=None) -> dict:
    """Module -> the project modules it imports anywhere in its text: at the top, inside
    functions and under ``if TYPE_CHECKING``. ``from package import submodule`` points at the
    submodule; importing a module does not count as importing its parent package (as
    import-linter counts)."""
    modules = _modules() if modules is None else modules
    graph = {}
    for name, (path, is_package) in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(name, is_package, node)
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                deps.update(subs)
                if len(subs) < len(node.names):
                    deps.add(target)
        graph[name] = sorted(d for d in deps if d in modules and d != name)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = iter(range(len(graph) + 1))

    def visit(v):
        index[v] = low[v] = next(counter)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_loop_through_a_function_level_import(tmp_path):
    # the shape of the loop the data package once closed: a top-level import one way,
    # an import inside a function the other
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .c import g\n    return g\n")
    (pkg / "c.py").write_text("import json\n\ndef g():\n    from .a import b\n")
    mods = {f"pkg.{n}": (pkg / f"{n}.py", False) for n in "abc"} | {"pkg": (pkg / "__init__.py", True)}
    graph = import_graph(mods)
    assert graph["pkg.b"] == ["pkg.c"] and graph["pkg.c"] == ["pkg.a"]
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_no_import_loop_even_through_function_level_imports():
    graph = import_graph()
    assert "dlspark.network" in graph and "dlspark.compat._networks" in graph
    found = cycles(graph)
    detail = "; ".join(" <-> ".join(c) + " (" + ", ".join(f"{m} -> {[d for d in graph[m] if d in c]}" for m in c)
                       + ")" for c in found)
    assert not found, f"import loops: {detail}"


def test_the_core_does_not_import_the_spark_bridge_or_the_runtimes():
    graph = import_graph()
    core = [m for m in graph if m.split(".")[:2] in (["dlspark", "data"], ["dlspark", "network"],
                                                      ["dlspark", "model"], ["dlspark", "losses"],
                                                      ["dlspark", "checkpoint"], ["dlspark", "_fit"])]
    assert "dlspark.data._sources" in core
    upper = ("dlspark.spark", "dlspark.distributed", "dlspark.parallel", "dlspark.trainer", "dlspark._inference")
    bad = {m: [d for d in graph[m] if d.startswith(upper)] for m in core}
    assert not {m: d for m, d in bad.items() if d}


def test_no_runtime_imports_an_algorithm_package():
    # every package under dlspark/algorithms/ is an algorithm, found here (a new one is covered
    # without editing this test); the runtimes reach them only through the dlspark.algorithms base
    graph = import_graph()
    packages = sorted(p.parent.name for p in (ROOT / "dlspark" / "algorithms").glob("*/__init__.py"))
    assert {"averaging", "sharing"} <= set(packages)
    runtimes = [m for m in graph if m in ("dlspark.parallel", "dlspark.trainer", "dlspark._mesh")
                or m.startswith(("dlspark.distributed", "dlspark._parallel"))]
    assert "dlspark.distributed._scheduler" in runtimes and "dlspark.parallel" in runtimes
    bad = {m: [d for d in graph[m] if d.split(".")[:3] in (["dlspark", "algorithms", p] for p in packages)]
           for m in runtimes}
    assert not {m: d for m, d in bad.items() if d}, "runtimes importing an algorithm package"


def test_no_module_over_600_lines():
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path, _ in _modules().values()}
    assert len(sizes) > 50
    over = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by job): {over}"


def test_the_spark_source_is_registered_from_the_bridge_and_old_names_still_import():
    import dlspark
    from dlspark import spark
    from dlspark.data import _registry, _sources

    assert [type(s) for s in _registry._SOURCES].count(spark.SparkRDDSource) == 1
    for name in _sources.__all__:  # what dlspark.data._sources exported before the split
        assert getattr(_sources, name) is getattr(_registry, name, getattr(_sources, name))
    assert _sources.load_ref is dlspark.data.load_ref and _sources.Source is dlspark.data.Source
    from dlspark.compat import _networks

    assert _networks._spark is spark


def _run(args, **kw):
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=240, **kw)


def test_the_import_contracts_hold():
    # .importlinter: the core imports no runtime and not the Spark bridge; the runtimes import no
    # algorithm package by name; no loop between sibling packages
    linter = pathlib.Path(sys.executable).with_name("lint-imports")
    done = _run([str(linter) if linter.exists() else "lint-imports", "--no-cache"])
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    kept = re.search(r"Contracts: (\d+) kept, (\d+) broken", report)
    assert kept and int(kept.group(1)) >= 3 and kept.group(2) == "0", report


def test_mypy_passes_on_the_typed_contracts(tmp_path):
    # the files and settings are [tool.mypy] in pyproject.toml
    done = _run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy")])
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"Success: no issues found in [1-9]\d* source files", done.stdout), done.stdout
