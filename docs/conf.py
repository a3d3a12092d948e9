"""Sphinx configuration of the flatten_parametrize documentation site.

Build it (strictly, as CI does) with ``python docs/build.py``; the pages are
Markdown (MyST), the notebooks of ``notebooks/`` are executed at build time
(myst-nb) and the API reference is generated from the docstrings (autodoc and
napoleon for the Google style). ``_ext/public_api.py`` turns gaps in the API
reference into warnings, which the strict build makes errors.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "_ext"))
os.environ.setdefault("MPLBACKEND", "Agg")  # the notebooks' plots, headless

import flatten_parametrize  # noqa: E402

project = "flatten_parametrize"
author = "flatten_parametrize contributors"
copyright = "the flatten_parametrize contributors"
release = flatten_parametrize.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_nb",  # Markdown pages (it loads myst_parser) and notebooks
    "public_api",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
templates_path: list[str] = []
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}

# Every cross-reference must resolve: a broken one is a warning, and the strict build fails.
nitpicky = True
# Names of other libraries (no intersphinx: the build needs no network) and the
# parameter types that docstrings write in prose ("int, optional").
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|nn|dist|os|optim|matplotlib|collections|typing|pathlib)(\..*)?"),
    (r"py:.*", r"(Tensor|Path|Parameter|ProcessGroup|Module|Optimizer|Figure|MixedPrecisionPolicy)"),
    (r"py:.*", r"(Any|Iterator|Iterable|Sequence|Mapping|Callable|OrderedDict|Union|Optional)"),
    (r"py:.*", r"(optional|str or os\.PathLike)"),
]

# --- autodoc and napoleon: the public names of flatten_parametrize, Google-style docstrings
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_preserve_defaults = True
# Type aliases of the private modules, shown by their short names (each is described in the Args).
autodoc_type_aliases = {
    "PublicStorage": "flatten_parametrize.FlatStorage",
    "GroupsArg": "GroupsArg",
    "FlatTensors": "FlatTensors",
    "StackedTensors": "StackedTensors",
    "NoDecayRule": "NoDecayRule",
    "MixedPrecisionArg": "MixedPrecisionArg",
}
nitpick_ignore = [("py:class", alias) for alias in autodoc_type_aliases if alias != "PublicStorage"]
python_use_unqualified_type_names = True
# The page's table of contents lists `using()`, not `FlatStorage.using()`.
toc_object_entries_show_parents = "hide"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True

# --- MyST and myst-nb
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links resolve (and are checked)
nb_execution_mode = "force"  # the notebooks are committed without outputs: run them at every build
nb_execution_timeout = 300
nb_execution_raise_on_error = True  # a failing cell fails the build
nb_execution_show_tb = True
nb_merge_streams = True

# --- HTML: the PyData theme, as PyTorch's own documentation
html_theme = "pydata_sphinx_theme"
html_title = "flatten_parametrize"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_show_sourcelink = False
html_copy_source = False
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "navbar_align": "left",
    "header_links_before_dropdown": 6,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version", "theme-version"],
}
html_sidebars = {"index": [], "changelog": []}

# Classes that users get from the library, never construct: no misleading constructor signature.
NOT_CONSTRUCTED = {"flatten_parametrize.FlatStorage", "flatten_parametrize.OptimizerAttachment"}


def _hide_signature(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, signature: str | None, annotation: str | None
) -> tuple[str, None] | None:
    if what == "class" and name in NOT_CONSTRUCTED:
        return "", None
    return None


def setup(app: Sphinx) -> None:
    app.connect("autodoc-process-signature", _hide_signature)


def _copy_notebooks() -> None:
    """Bring ``notebooks/*.ipynb`` into the source tree (``docs/notebooks/``, not committed).

    Sphinx only reads files below ``docs/``; the notebooks stay where the
    README and the tests find them. A copy is refreshed only when its source
    changed, so incremental builds stay incremental.
    """
    target = DOCS / "notebooks"
    target.mkdir(exist_ok=True)
    sources = {path.name: path for path in sorted((ROOT / "notebooks").glob("*.ipynb"))}
    for stale in target.glob("*.ipynb"):
        if stale.name not in sources:
            stale.unlink()
    for name, source in sources.items():
        copy = target / name
        if not copy.exists() or copy.read_bytes() != source.read_bytes():
            shutil.copyfile(source, copy)


_copy_notebooks()
