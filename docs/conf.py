"""Sphinx configuration for dlspark's documentation site.

Built by ``.ci/run`` with ``sphinx-build -W -n`` (warnings are errors, every
reference must resolve). No other site is reachable where it is built, so
intersphinx is not used: references to other packages' objects are ignored by
package prefix in ``nitpick_ignore_regex`` below.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath("_ext"))

import dlspark  # noqa: E402
import dlspark_docs  # noqa: E402

# The API pages, the configuration reference and the benchmark tables, from the code and docs/_data.
dlspark_docs.generate()

project = "dlspark"
author = "dlspark contributors"
copyright = "dlspark contributors"
version = release = dlspark.__version__

extensions = [
    "myst_nb",  # MyST markdown pages and executed notebooks (it brings myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "sphinx_click",
    "dlspark_docs",  # the configuration reference and the benchmark tables, generated at build time
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "_generated", "jupyter_execute", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]
root_doc = "index"

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# The notebook trains on the embedded cluster at every build, so the site shows dlspark working
# from a notebook kernel; nothing it runs needs the network.
nb_execution_mode = "force"
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True

autosummary_generate = True
autosummary_imported_members = True
templates_path = ["_templates"]
autodoc_default_options = {"members": True}
autodoc_typehints = "none"  # numpydoc's Parameters sections say the types
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

nitpicky = True
# Other packages' objects: no objects.inv can be downloaded here, so these resolve nowhere.
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|numpy|np|optax|flax|dask|distributed|fsspec|pyspark|pandas|bokeh|click|"
               r"dask_jobqueue|equinox|keras|torch|collections|typing|os|abc|enum|concurrent|pathlib|"
               r"dataclasses|datetime|io|numbers|builtins|contextlib|functools|threading|asyncio)(\..*)?"),
]

html_theme = "pydata_sphinx_theme"
html_title = "dlspark"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "navbar_align": "left",
    "header_links_before_dropdown": 8,
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_show_sourcelink = False
# Pages outside a section have no section navigation: no empty left sidebar there.
html_sidebars = {page: [] for page in ("index", "getting-started", "notebooks/*", "dl4j", "changelog")}
