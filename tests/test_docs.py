"""The documentation site (docs/) and the README: code that runs, references that are complete, no history.

- Every fenced code block of the site's pages and the README runs here, page by page
  (the page's Python blocks in order as one script, then its shell blocks, in a fresh
  directory), unless ``SKIP`` names it with the reason. A block neither run nor listed
  fails. Blocks fenced as ``text`` are program output or diagrams, not code.
- Guides and docstrings carry no dates: history belongs in CHANGELOG.md.
- The generated references are complete: every public name has an API page and every
  ``dlspark.*`` key of ``dlspark.yaml`` appears, with its meaning, in the configuration
  reference (the generators in ``docs/_ext/dlspark_docs.py`` are the ones the build runs).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

_spec = importlib.util.spec_from_file_location("dlspark_docs", DOCS / "_ext" / "dlspark_docs.py")
dlspark_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dlspark_docs)

# (page, the block's first line): why the block does not run here. One list, for every page.
SKIP = {
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install -q --upgrade pip && pip install -q -e . "
                  "&& python examples/train_digits.py"):
        "makes a virtual environment and installs into it (needs the package index); examples/train_digits.py "
        "itself runs in tests/test_examples.py",
    ("README.md", "python3 -m venv .venv && . .venv/bin/activate && pip install -q --upgrade pip && pip install -q -e "
                  "\".[test,spark,hpc,docs]\" && python -m pytest -q"):
        "the test suite itself (.ci/run runs it)",
    ("docs/getting-started.md", "python3 -m venv .venv && . .venv/bin/activate && pip install -q --upgrade pip && pip "
                                "install -q -e ."):
        "makes a virtual environment and installs into it (needs the package index)",
    ("docs/getting-started.md", "python examples/train_digits.py              # parameter averaging on an embedded "
                                "LocalCluster"):
        "tests/test_examples.py runs examples/train_digits.py (locally and on the embedded cluster)",
    ("docs/dl4j.md", "pip install -e \".[spark]\"      # pyspark; Java 17 on the machine"):
        "installs (needs the package index); tests/test_compat.py runs examples/train_digits_spark.py",
    ("docs/dl4j.md", "VoidConfiguration conf = VoidConfiguration.builder()"):
        "Java: DL4J's own program, shown for comparison",
    ("docs/dl4j.md", "from dlspark.compat import (AdaptiveThresholdAlgorithm, MeshBuildMode, SharedTrainingMaster,"):
        "a fragment that takes the reader's SparkContext and RDDs; the whole program beside it, "
        "examples/train_digits_spark.py, runs in tests/test_compat.py",
    ("docs/guides/deployment.md", "from dask_jobqueue import LSFCluster, PBSCluster, SGECluster"):
        "needs PBS, LSF and SGE schedulers; jobqueue_options' scripts are checked in tests/test_deploy.py",
    ("docs/guides/deployment.md", "dlspark train examples/train_digits.py --local 2 -- --epochs 2"):
        "the --local line: tests/test_train_command.py runs dlspark train --local 2 on examples/train_digits.py and "
        "checks what it says and the accuracy it reaches (the page's dlspark info block runs the installed command "
        "here); the --slurm and --scheduler lines need a SLURM cluster with GPUs, a running scheduler and the "
        "reader's train.py (dlspark train --slurm runs in tests/test_slurm.py)",
    ("docs/benchmarks/index.md", "pip install -e \".[bench]\""):
        "installs asv and runs every benchmark suite (minutes); the suites are run by hand",
    ("docs/benchmarks/parity-suite.md", "python benchmarks/bench_suite.py --out suite.json       # the whole suite"):
        "the parity suite (hours; a slice takes minutes); tests/test_bench_suite.py builds and steps each task",
    ("docs/benchmarks/network.md", "from distributed import Client"):
        "needs root and iproute2 (network namespaces) and the reader's network, master and data; "
        "tests/test_network_emulated.py runs emulated_cluster with real fits",
    ("docs/guides/security.md", "dlspark info --scheduler tls://10.0.0.5:8786 --tls-ca-file ca.pem --tls-cert node.pem "
                                "--tls-key node.key"):
        "needs the reader's TLS scheduler and certificates; tests/test_security.py runs dlspark info and dlspark "
        "train against a TLS cluster set up from dask's configuration, and with these options",
}
# Blocks keyed by more than their first line: the SLURM block starts like the laptop's.
SKIP_CONTAINING = {
    ("docs/guides/deployment.md", "cluster = slurm_cluster(4, gpus_per_worker=1"):
        "needs a SLURM cluster with GPUs; slurm_cluster's job scripts are checked in tests/test_deploy.py and whole "
        "fits on a real SLURM run in tests/test_slurm.py",
}

_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_NOT_CODE = {"text"}  # program output and diagrams
_DIRECTIVE_CODE = {"{code-block}", "{code}", "{code-cell}", "{sourcecode}"}


def pages():
    out = [ROOT / "README.md"]
    for p in sorted(DOCS.rglob("*.md")):
        rel = p.relative_to(DOCS).parts
        if rel[0] in ("_build", "_generated", "jupyter_execute", "api"):
            continue
        out.append(p)
    return out


def code_blocks(path):
    """``(language, code)`` for each fenced code block of a MyST page (directives other than code are not code)."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        fence, info = m["fence"], m["info"].strip().split()
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            j += 1
        body = [line for line in lines[i + 1:j]]
        lang = info[0] if info else ""
        if lang.startswith("{"):
            if lang not in _DIRECTIVE_CODE:
                i = j + 1
                continue
            lang = info[1] if len(info) > 1 else ""
            body = [line for line in body if not line.startswith(":")]
        if lang not in _NOT_CODE:
            blocks.append((lang, "\n".join(body).strip("\n") + "\n"))
        i = j + 1
    return blocks


def _name(path):
    return str(path.relative_to(ROOT))


def skip_reason(page, code):
    first = code.strip().splitlines()[0].strip()
    if (page, first) in SKIP:
        return SKIP[(page, first)]
    for (p, piece), why in SKIP_CONTAINING.items():
        if p == page and piece in code:
            return why
    return None


def _runnable(path):
    py, sh = [], []
    for lang, code in code_blocks(path):
        if skip_reason(_name(path), code) is not None:
            continue
        (py if lang == "python" else sh).append(code)
    return py, sh


def test_every_code_block_is_run_or_skipped_with_a_reason():
    unrunnable, used = [], set()
    for path in pages():
        for lang, code in code_blocks(path):
            why = skip_reason(_name(path), code)
            first = code.strip().splitlines()[0].strip()
            if why is not None:
                used.add((_name(path), first))
                assert why.strip(), f"{_name(path)}: the skip of {first!r} names no reason"
            elif lang not in ("python", "bash", "sh", "console"):
                unrunnable.append(f"{_name(path)}: a {lang or 'untagged'} block, {first!r}")
    assert not unrunnable, ("blocks that neither run here (python, bash) nor are listed in SKIP with a reason:\n"
                            + "\n".join(unrunnable))
    stale = [k for k in SKIP if k not in used]
    assert not stale, f"SKIP lists blocks no page has (edit SKIP with the page): {stale}"
    assert all(any(k[0] == _name(p) and k[1] in c for p in pages() for _, c in code_blocks(p))
               for k in SKIP_CONTAINING), "SKIP_CONTAINING lists a block no page has"


_CLUSTER = ("local_cluster(", "DistributedTrainer(", "dlspark info", "dlspark train")


def _page_code():
    """``[(page, python blocks, shell blocks, starts a cluster)]`` for each page with code to run."""
    out = []
    for path in pages():
        py, sh = _runnable(path)
        if py or sh:
            out.append((path, py, sh, any(s in "".join(py + sh) for s in _CLUSTER)))
    return out


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def _run_shell(path, blocks, cwd):
    for code in blocks:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=_env(), capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"{_name(path)}'s shell block {code!r} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def _page_dir(tmp_path, path):
    d = tmp_path / re.sub(r"\W", "_", _name(path))
    d.mkdir()
    (d / "examples").symlink_to(ROOT / "examples")
    return d


# Runs each page's script in one interpreter, in a directory of its own, so that the pages without a cluster
# share one start of JAX. Two CPU devices from the start, as the ParallelWrapper pages ask.
_RUNNER = """
import os, runpy, sys, traceback
import jax
jax.config.update("jax_num_cpu_devices", 2)
failed = []
for script in sys.argv[1:]:
    os.chdir(os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException:
        failed.append(script)
        print(f"==== {script} failed:", file=sys.stderr)
        traceback.print_exc()
sys.exit(1 if failed else 0)
"""


@pytest.mark.timeout(900)  # every such page in one test: about a minute on two idle cores
def test_the_code_blocks_of_pages_without_a_cluster_run(tmp_path):
    todo = [(path, py, sh) for path, py, sh, cluster in _page_code() if not cluster]
    assert todo, "no page without a cluster has code: the extraction is broken"
    dirs = {path: _page_dir(tmp_path, path) for path, _, _ in todo}
    scripts = []
    for path, py, _ in todo:
        if py:
            script = dirs[path] / "page.py"
            script.write_text("\n\n".join(py))
            scripts.append(str(script))
    r = subprocess.run([sys.executable, "-c", _RUNNER, *scripts], env=_env(), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, f"Python blocks failed (the page is named in its script's path):\n{r.stderr[-8000:]}"
    for path, _, sh in todo:
        _run_shell(path, sh, dirs[path])


@pytest.mark.slow
@pytest.mark.parametrize("path", [pytest.param(p, id=_name(p)) for p, _, _, cluster in _page_code() if cluster])
def test_the_code_blocks_of_a_page_with_a_cluster_run(path, tmp_path):
    # its own interpreter, the script run by path as __main__: spawned workers import it again, as the reader's
    _, py, sh, _ = next(x for x in _page_code() if x[0] == path)
    d = _page_dir(tmp_path, path)
    if py:
        script = d / "page.py"
        script.write_text("\n\n".join(py))
        r = subprocess.run([sys.executable, str(script)], cwd=d, env=_env(), capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"{_name(path)}'s Python blocks failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    _run_shell(path, sh, d)


# ------------------------------------------------------------------------------------ no history in guides

_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def test_guides_carry_no_dates():
    # the guides, getting started, DL4J and design pages; the changelog and the benchmark data keep dates
    found = []
    for path in pages():
        rel = path.relative_to(ROOT).parts
        if rel[0] == "docs" and rel[1] == "benchmarks":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _DATE.search(line):
                found.append(f"{_name(path)}:{n}: {line.strip()}")
    assert not found, "dates belong in CHANGELOG.md, not in guides:\n" + "\n".join(found)


def test_docstrings_carry_no_dates():
    found = []
    for path in sorted((ROOT / "dlspark").rglob("*.py")) + sorted((ROOT / "compat").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                for date in _DATE.findall(doc):
                    found.append(f"{path.relative_to(ROOT)}: {getattr(node, 'name', 'module')}: {date}")
    assert not found, "dates belong in CHANGELOG.md, not in docstrings:\n" + "\n".join(found)


def test_the_date_checks_can_fail(tmp_path):
    page = tmp_path / "guide.md"
    page.write_text("Until 2026-11-24 the start was copied.\n")
    assert _DATE.search(page.read_text())
    assert not _DATE.search("version 0.1.0, 10-20 ms, 1e-3")


# ------------------------------------------------------------------------------------ generated references


def test_every_public_name_has_an_api_page(tmp_path):
    import dlspark

    names = dlspark_docs.write_api_pages(tmp_path)
    # every public submodule named in dlspark's __all__ has a page of its own
    for name in dlspark.__all__:
        obj = getattr(dlspark, name)
        if isinstance(obj, types.ModuleType):
            assert obj.__name__ in names, f"{obj.__name__} is public (dlspark.__all__) but has no API page"
    # every module of the package is either public (a page) or an implementation module whose public names
    # are re-exported by a public one
    import pkgutil

    for info in pkgutil.iter_modules(dlspark.__path__):
        if not info.name.startswith("_"):
            full = f"dlspark.{info.name}"
            assert full in dlspark_docs.PUBLIC_MODULES or full in dlspark_docs.IMPLEMENTATION_MODULES, (
                f"{full} is neither a public module (docs/_ext/dlspark_docs.py PUBLIC_MODULES: it gets an API page) "
                "nor listed as an implementation module whose names are re-exported")
    documented = {}  # object id -> the page's entry
    for module in dlspark_docs.public_modules():
        text = (tmp_path / f"{module.__name__}.rst").read_text()
        summary = re.search(r"\.\. autosummary::\n(?:   :.*\n)*\n((?:   \S.*\n)+)", text)
        entries = set(summary.group(1).split()) if summary else set()
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                assert f":doc:`{obj.__name__}`" in text, f"{module.__name__}.{name}: no link to its module's page"
            elif name in entries:
                documented[id(obj)] = f"{module.__name__}.{name}"
            else:
                link = re.search(rf"- ``{re.escape(name)}``: :py:\w+:`[\w.]+`", text)
                assert link, f"{module.__name__}.{name} is in __all__ but has no API page and no link to one"
    # a link leads to a page that documents that very object
    for module in dlspark_docs.public_modules():
        for entry in dlspark_docs.api_entries(module):
            if entry[0] == "link":
                target = entry[2]
                obj = dlspark_docs._resolve(target)
                assert documented.get(id(obj)) == target, f"{module.__name__} links to {target}, which has no page"


def test_the_configuration_reference_holds_every_key_with_its_meaning():
    with open(ROOT / "dlspark" / "dlspark.yaml") as f:
        defaults = yaml.safe_load(f)

    def leaves(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    keys = dict(leaves(defaults, ""))
    parsed = {key: meaning for key, _, meaning in dlspark_docs.config_keys()}
    assert set(parsed) == set(keys), f"keys the reference misreads: {set(parsed) ^ set(keys)}"
    missing = [k for k, meaning in parsed.items() if len(meaning) < 10]
    assert not missing, f"keys of dlspark.yaml without a comment saying what they mean: {missing}"
    table = dlspark_docs.config_table()
    for key in keys:
        assert re.search(rf"^`{re.escape(key)}` \(default `", table, re.M), f"{key} is missing from the configuration reference"
        env = "DASK_" + "__".join(p.upper().replace("-", "_") for p in key.split("."))
        assert env in table
    # the hand-written reference is gone: the README names the defaults file instead of listing keys
    readme = (ROOT / "README.md").read_text()
    assert not [k for k in keys if k.startswith("dlspark.") and f"`{k}`" in readme]


def test_the_configuration_parser_reads_meanings_and_continuations(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("dlspark:\n  a:\n    b: 1s   # the first line\n         # and its continuation\n"
                    "    # a section's note\n    c: null  # c's meaning\n")
    assert dlspark_docs.config_keys(path) == [("dlspark.a.b", "1s", "the first line and its continuation"),
                                              ("dlspark.a.c", "null", "c's meaning")]


def test_the_readme_stays_a_landing_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in ci.splitlines() if "python -m pytest" in line)
    assert f"```bash\n{test_command}\n```" in readme, "the README's test command differs from .ci/run's"
    main_job = ("python3 -m venv .venv && . .venv/bin/activate && pip install -q --upgrade pip && pip install -q -e . "
                "&& python examples/train_digits.py")
    assert f"```bash\n{main_job}\n```" in readme
