"""Pages of dlspark's site that are generated when it is built, never written by hand.

- The API reference: one page per public module, listing every name in its ``__all__``
  (``autosummary`` then writes a page per name from the docstrings).
- The configuration reference: every key of ``dlspark/dlspark.yaml`` with its default and
  the comment beside it, which is the key's meaning.
- The benchmark tables: one table per JSON file under ``docs/_data/``.

``conf.py`` calls :func:`generate` before Sphinx reads a page; ``tests/test_docs.py`` calls
the same functions to check that nothing public is left out.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import types

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.dirname(HERE)
ROOT = os.path.dirname(DOCS)

#: The public modules, in the order their pages appear. A name re-exported from a module earlier
#: in this list is documented there once, and the later module's page links to it.
PUBLIC_MODULES = [
    "dlspark",
    "dlspark.data",
    "dlspark.datasets",
    "dlspark.losses",
    "dlspark.evaluation",
    "dlspark.cluster",
    "dlspark.stats",
    "dlspark.io",
    "dlspark.errors",
    "dlspark.config",
    "dlspark.algorithms",
    "dlspark.compat",
    "dlspark.testing",
]

#: Modules without a page of their own: their public names are re-exported by ``dlspark``
#: (``Network`` from ``dlspark.network``, ...) and documented there.
IMPLEMENTATION_MODULES = [
    "dlspark.model",
    "dlspark.network",
    "dlspark.checkpoint",
    "dlspark.trainer",
    "dlspark.parallel",
    "dlspark.distributed",
    "dlspark.cli",  # documented from its click parser on the command's page
    "dlspark.spark",  # the pyspark bridge, reached through DistributedTrainer.fit(rdd) and dlspark.compat
]

_SUMMARY = {
    "dlspark": "The main classes: models, networks, the trainers and the algorithms.",
    "dlspark.data": "DataSets, the minibatch file format and the data sources.",
    "dlspark.datasets": "Data that ships with dlspark, for examples and tests.",
    "dlspark.losses": "Losses by name, with DL4J's names as aliases.",
    "dlspark.evaluation": "Evaluations that merge across workers.",
    "dlspark.cluster": "The embedded cluster, job queues, GPUs and memory, the version check.",
    "dlspark.stats": "Training statistics: the record, its summaries and exports.",
    "dlspark.io": "Reading and writing at any fsspec URL, atomically.",
    "dlspark.errors": "The exceptions users catch.",
    "dlspark.config": "dlspark's settings in ``dask.config``.",
    "dlspark.algorithms": "The algorithms, their protocols, and what a new algorithm implements.",
    "dlspark.compat": "DL4J-on-Spark names over dlspark, taking pyspark RDDs.",
    "dlspark.testing": "Helpers for testing code that uses dlspark.",
}


def public_modules():
    """The public modules that can be imported here (``dlspark.testing`` only where it exists)."""
    mods = []
    for name in PUBLIC_MODULES:
        try:
            mods.append(importlib.import_module(name))
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
    return mods


def _canonical(obj):
    """The (module, name) of the page documenting ``obj``: the first public module exporting it."""
    for mod in public_modules():
        for name in getattr(mod, "__all__", ()):
            if getattr(mod, name) is obj:
                return mod.__name__, name
    return None


def api_entries(module):
    """For each name in ``module.__all__``: ``("page", name)``, ``("module", target)`` or
    ``("link", name, target)`` where another page (another module's, or another name's) documents the same object."""
    out = []
    for name in module.__all__:
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType):
            out.append(("module", obj.__name__))
            continue
        where = None if isinstance(obj, (str, int, float, tuple, dict, list, frozenset)) else _canonical(obj)
        if where is None or where == (module.__name__, name):
            out.append(("page", name))
        else:
            out.append(("link", name, f"{where[0]}.{where[1]}"))
    return out


def nested_classes(obj):
    """Names of the public classes defined as attributes of class ``obj`` (``Builder``)."""
    if not inspect.isclass(obj):
        return []
    out, seen = [], set()
    for k, v in sorted(vars(obj).items(), key=lambda kv: not kv[0][:1].isupper()):  # Builder before builder
        if inspect.isclass(v) and not k.startswith("_") and id(v) not in seen:
            seen.add(id(v))
            out.append(k)
    return out


def _skip_nested_class(app, what, name, obj, skip, options):
    # documented on a page of its own (api_page), not as an alias on its owner's page
    if what == "class" and inspect.isclass(obj):
        return True
    return None


def _role(obj):
    if inspect.isclass(obj):
        return "class" if not issubclass(obj, BaseException) else "exc"
    if callable(obj):
        return "func"
    return "data"


def api_page(module) -> str:
    """The reStructuredText page of one public module."""
    name = module.__name__
    lines = [name, "=" * len(name), "", f".. automodule:: {name}", "   :no-members:", "",
             f".. currentmodule:: {name}", ""]
    entries = api_entries(module)
    pages = []
    for e in entries:
        if e[0] == "page":
            pages.append(e[1])
            # a public class's nested classes (DL4J's builders) get pages of their own
            pages += [f"{e[1]}.{attr}" for attr in nested_classes(getattr(module, e[1]))]
    if pages:
        lines += [".. autosummary::", "   :toctree: generated", "   :nosignatures:", ""]
        lines += [f"   {n}" for n in pages] + [""]
    mods = [e[1] for e in entries if e[0] == "module"]
    if mods:
        lines += ["Submodules", "----------", ""]
        lines += [f"- :doc:`{m}` -- {_SUMMARY.get(m, '')}" for m in mods] + [""]
    links = [e[1:] for e in entries if e[0] == "link"]
    if links:
        lines += ["Also exported here", "------------------", ""]
        for name, target in links:
            lines.append(f"- ``{name}``: :py:{_role(_resolve(target))}:`{target}`")
        lines.append("")
    return "\n".join(lines)


def write_api_pages(outdir):
    """Write ``<module>.rst`` for each public module and an index of them into ``outdir``."""
    os.makedirs(outdir, exist_ok=True)
    names = []
    for module in public_modules():
        _write(os.path.join(outdir, f"{module.__name__}.rst"), api_page(module))
        names.append(module.__name__)
    index = ["API reference", "=============", "",
             "Generated from the docstrings, one page for every name in the ``__all__`` of each public module.", "",
             ".. list-table::", "   :widths: 30 70", ""]
    for n in names:
        index += [f"   * - :doc:`{n}`", f"     - {_SUMMARY.get(n, '')}"]
    index += ["", ".. toctree::", "   :hidden:", ""] + [f"   {n}" for n in names] + [""]
    _write(os.path.join(outdir, "index.rst"), "\n".join(index))
    return names


# ---------------------------------------------------------------------------- configuration

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<value>[^#]*)(#(?P<comment>.*))?$")
_COMMENT = re.compile(r"^(?P<indent> *)#(?P<comment>.*)$")


def config_keys(path=None):
    """Every leaf key of ``dlspark.yaml`` as ``(dotted key, default as written, meaning)``.

    The meaning is the comment beside the key and the comment lines right below it that are
    indented past the key (a continuation). Section comments (own lines, at a key's indentation)
    are not a key's meaning.
    """
    path = path or os.path.join(ROOT, "dlspark", "dlspark.yaml")
    with open(path) as f:
        lines = f.read().splitlines()
    stack = []  # (indent, key)
    out = []
    last = None
    for line in lines:
        if not line.strip():
            last = None
            continue
        m = _KEY.match(line)
        if m:
            indent = len(m["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            value = m["value"].strip()
            if value == "":
                stack.append((indent, m["key"]))
                last = None
                continue
            key = ".".join([k for _, k in stack] + [m["key"]])
            out.append([key, value, (m["comment"] or "").strip()])
            last = (indent, out[-1], line.index("#") if m["comment"] is not None else None)
            continue
        c = _COMMENT.match(line)
        if c and last is not None and last[2] is not None and len(c["indent"]) > last[0]:
            last[1][2] += " " + c["comment"].strip()
        else:
            last = None
    return [tuple(x) for x in out]


def config_table(path=None) -> str:
    """The configuration reference as MyST markdown: one definition per key, grouped by section."""
    out = []
    section = None
    for key, default, meaning in config_keys(path):
        sec = ".".join(key.split(".")[:2])
        if sec != section:
            section = sec
            out += ["", f"## `{sec}`", ""]
        env = "DASK_" + "__".join(p.upper().replace("-", "_") for p in key.split("."))
        text = meaning[:1].upper() + meaning[1:]
        text = text if text.endswith(".") else text + "."
        out += [f"`{key}` (default `{default}`)", f": {text}", "", f"  Environment variable: `{env}`", ""]
    return "\n".join(out).lstrip() + "\n"


def _cell(text):
    return text.replace("|", "\\|")


# ---------------------------------------------------------------------------- benchmarks


def benchmark_files():
    data = os.path.join(DOCS, "_data")
    return sorted(os.path.join(data, f) for f in os.listdir(data) if f.endswith(".json"))


def benchmark_tables(path) -> str:
    """One suite's JSON (``docs/_data/<suite>.json``) as markdown: its command, machine, source and tables.

    The file holds ``suite``, ``command``, ``machine``, ``source`` (where the figures come from) and
    ``tables``: each a ``title``, ``columns``, ``rows`` and an optional ``note``.
    """
    with open(path) as f:
        suite = json.load(f)
    out = [f"**Command:** `{suite['command']}`", "", f"**Machine:** {suite['machine']}", "",
           f"**Source of these figures:** {suite['source']}", ""]
    for table in suite["tables"]:
        if table.get("title"):
            out += [f"**{table['title']}**", ""]
        out.append("| " + " | ".join(_cell(str(c)) for c in table["columns"]) + " |")
        out.append("|" + "---|" * len(table["columns"]))
        for row in table["rows"]:
            if len(row) != len(table["columns"]):
                raise ValueError(f"{os.path.basename(path)}: table {table.get('title')!r} has "
                                 f"{len(table['columns'])} columns, a row has {len(row)}: {row}")
            out.append("| " + " | ".join(_cell("" if c is None else str(c)) for c in row) + " |")
        out.append("")
        if table.get("note"):
            out += [table["note"], ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------- entry points


def _write(path, text):
    """Write only when changed, so that Sphinx does not re-read unchanged pages."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)


def generate():
    """Write every generated page (called from ``conf.py``)."""
    write_api_pages(os.path.join(DOCS, "api"))
    gen = os.path.join(DOCS, "_generated")
    os.makedirs(gen, exist_ok=True)
    _write(os.path.join(gen, "config.md"), config_table())
    for path in benchmark_files():
        name = os.path.splitext(os.path.basename(path))[0]
        _write(os.path.join(gen, f"bench-{name}.md"), benchmark_tables(path))


def _resolve(dotted):
    """The object a dotted path names, importing the longest module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def public_name(dotted):
    """The public name of what a private path (``dlspark.data._dataset.DataSet``) names, or None.

    Autodoc writes a class's bases and nested classes by where they are defined; the pages
    document them where they are exported.
    """
    parts = dotted.split(".")
    for i in range(len(parts), 1, -1):
        obj = _resolve(".".join(parts[:i]))
        if obj is None or isinstance(obj, (str, int, float, tuple, dict, list, frozenset)):
            continue
        where = _canonical(obj) or _nested(obj)
        if where is not None:
            return ".".join([*where] + parts[i:])
    return None


def _nested(obj):
    """(module, "Class.attr") where a public class holds ``obj`` as an attribute (a builder class)."""
    for mod in public_modules():
        for name in getattr(mod, "__all__", ()):
            owner = getattr(mod, name)
            if inspect.isclass(owner):
                for attr, value in vars(owner).items():
                    if value is obj and not attr.startswith("_"):
                        return mod.__name__, f"{name}.{attr}"
    return None


def _missing_reference(app, env, node, contnode):
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py":
        return None
    if "." not in target and str(node.get("py:module") or "").startswith("dlspark."):
        # a bare name in a docstring read where its private module is the context: the public module's
        context = str(node.get("py:module"))
        # the public module nearest the private one first (dlspark.compat for dlspark.compat._masters)
        for mod in sorted(public_modules(), key=lambda m: -len(m.__name__) if context.startswith(m.__name__ + ".")
                          else 0):
            if target in getattr(mod, "__all__", ()):
                return env.get_domain("py").resolve_xref(env, node.get("refdoc"), app.builder, node["reftype"],
                                                         f"{mod.__name__}.{target}", node, contnode)
        return None
    if not target.startswith("dlspark."):
        return None
    public = public_name(target)
    if public is None or public == target:
        return None
    domain = env.get_domain("py")
    return domain.resolve_xref(env, node.get("refdoc"), app.builder, node["reftype"], public, node, contnode)


def _document_nested_classes_as_classes():
    """A nested class whose ``__qualname__`` ends in the name it is documented under (DL4J's
    ``ParameterAveragingTrainingMaster.Builder``, defined as ``_ParameterAveragingBuilder``) is
    documented as a class with its methods, not as an alias. Sphinx's autodoc decides this in a
    private property; where that changes, the builders are shown as aliases again (no failure)."""
    try:
        from sphinx.ext.autodoc._property_types import _ClassDefProperties
    except ImportError:
        return
    original = _ClassDefProperties.__dict__.get("doc_as_attr")
    if not isinstance(original, property):
        return

    def doc_as_attr(self):
        qualname = getattr(self, "_obj___qualname__", None) or ""
        if "." in qualname and qualname.rsplit(".", 1)[1] == self.parts[-1]:
            return False
        return original.fget(self)

    _ClassDefProperties.doc_as_attr = property(doc_as_attr)


def setup(app):
    _document_nested_classes_as_classes()
    app.connect("missing-reference", _missing_reference)
    app.connect("autodoc-skip-member", _skip_nested_class)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
