"""The documentation site's strict build and the run of its code blocks fail on what a reader trips over.

Each build runs ``docs/build.py`` on a copy of the sources (the notebooks rendered without
executing them, to keep it short; ``.ci/run`` builds the real site with them executed): one
clean, one with every defect put in at once (a broken cross-reference, a link to a missing
heading, a page in no toctree, a public name without a docstring), whose ``--keep-going``
build reports each; a test per defect checks its message. The link check of the built HTML
is tested on its own, on a few small files.
``tests/test_doc_blocks.py``, which runs the code blocks of the pages, is run on a temporary
tree of pages with a broken block in it.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow  # subprocesses

ROOT = Path(__file__).resolve().parents[1]
# What the docs read: their sources, the files their pages include, and the repository files they link to
# (the site serves those as downloads).
INCLUDED = [
    "README.md", "CHANGELOG.md", "notebooks", "benchmarks", "tests", "flatten_parametrize", "constraints",
]  # fmt: skip
Build = subprocess.CompletedProcess[str]
IGNORED = shutil.ignore_patterns("__pycache__", "out", ".hypothesis")


def _load_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_build", ROOT / "docs" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_sources(into: Path) -> Path:
    """Copy ``docs/`` and what it includes into ``into``; return the copy's ``docs``."""
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_nb")
    pytest.importorskip("pydata_sphinx_theme")
    shutil.copytree(ROOT / "docs", into / "docs", ignore=shutil.ignore_patterns("_build", "notebooks"))
    for name in INCLUDED:
        source, target = ROOT / name, into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=IGNORED)
        else:
            shutil.copyfile(source, target)
    return into / "docs"


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    """A copy of ``docs/`` and of what it includes; returns the copy's ``docs``."""
    return _copy_sources(tmp_path)


@pytest.fixture(scope="module")
def broken_build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """One strict build of a copy with every defect below planted (``--keep-going`` reports each)."""
    docs = _copy_sources(tmp_path_factory.mktemp("broken"))
    page = docs / "getting-started.md"
    page.write_text(
        page.read_text()
        + "\nSee {py:meth}`flatten_parametrize.FlatStorage.no_such_method`.\n"
        + "\nSee [the missing section](distributed.md#no-such-heading).\n"
    )
    (docs / "orphan.md").write_text("# Orphan\n\nNo toctree lists this page.\n")
    api = docs / "api" / "FlatStorage.rst"
    api.write_text(api.read_text() + "\n.. automethod:: flatten_parametrize.FlatStorage.__len__\n")
    proc = _build(docs)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    return proc


def _build(docs: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(docs / "build.py"), "--source", str(docs),
         "--out", str(docs / "_build" / "html"), "--no-notebooks"],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip


def test_the_sources_build_cleanly(sources: Path) -> None:
    """Without a defect the strict build and the link check pass (so the failures below are the defects')."""
    proc = _build(sources)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every internal link resolves" in proc.stdout


def test_a_broken_reference_fails_the_build(broken_build: Build) -> None:
    """A reference to a name that the API reference does not have is an error, not a dead link."""
    assert "reference target not found: flatten_parametrize.FlatStorage.no_such_method" in broken_build.stderr


def test_a_broken_page_link_fails_the_build(broken_build: Build) -> None:
    """A Markdown link to a page or heading that does not exist is an error."""
    assert "no-such-heading" in broken_build.stderr


def test_a_page_in_no_toctree_fails_the_build(broken_build: Build) -> None:
    """Every page is reachable from the navigation."""
    assert "orphan" in broken_build.stderr
    assert "document isn't included in any toctree" in broken_build.stderr


def test_a_public_name_without_a_docstring_fails_the_build(broken_build: Build) -> None:
    """Documenting a public name that has no docstring is an error (``FlatStorage.__len__`` has none)."""
    assert "public name without a docstring: flatten_parametrize.FlatStorage.__len__" in broken_build.stderr


def test_the_link_check_finds_missing_files_and_anchors(tmp_path: Path) -> None:
    """``check_links`` reports a missing page, a missing anchor and a link out of the site; not good links."""
    build = _load_build()
    site = tmp_path / "html"
    (site / "api").mkdir(parents=True)
    (site / "api" / "page.html").write_text('<h1 id="top">Page</h1><a href="../index.html#intro">home</a>')
    (site / "index.html").write_text(
        '<p id="intro"></p><a href="api/page.html#top">ok</a> <a href="https://pytorch.org">external</a>'
        '<a href="api/page.html#gone">anchor</a> <a href="missing.html">page</a>'
        '<a href="../outside.html">out</a>'
        '<img src="_images/plot.png">'
    )
    errors = build.check_links(site)
    assert len(errors) == 4, errors
    assert any("no id 'gone' in page.html" in error for error in errors)
    assert any("missing.html: no such file" in error for error in errors)
    assert any("points outside the site" in error for error in errors)
    assert any("_images/plot.png: no such file" in error for error in errors)


# --- The code blocks of the pages (tests/test_doc_blocks.py), run on a temporary tree of pages.


def _run_code_blocks(tmp_path: Path, pages: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``tests/test_doc_blocks.py`` on a tree holding only ``pages`` (paths relative to the root)."""
    (tmp_path / "tests").mkdir()
    for name in ("test_doc_blocks.py", "_helpers.py", "_gloo_pool.py"):
        shutil.copyfile(ROOT / "tests" / name, tmp_path / "tests" / name)
    for name, text in {"README.md": "# Project\n", **pages}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_doc_blocks.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )


BROKEN_PAGE = """# Broken

```python
import torch
weights = torch.ones(3)
```

```{code-block} python
print(weight)  # a typo: the block above defines `weights`
```

```python
# torchrun --nproc-per-node 2 broken.py
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise RuntimeError("rank 1 fails")
dist.destroy_process_group()
```
"""


def test_a_broken_code_block_fails_the_collector(tmp_path: Path) -> None:
    """A block that raises, in this process or on one torchrun rank, fails the test run (so ``.ci/run``)."""
    pytest.importorskip("markdown_it")
    proc = _run_code_blocks(tmp_path, {"docs/broken.md": BROKEN_PAGE})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "3 failed, 3 passed" in out, out  # the typo also fails the stand-alone check
    assert "NameError: name 'weight' is not defined" in out
    assert "docs/broken.md:9: the block uses weight without defining or importing them" in out
    assert "docs/broken.md:9: NameError" in out  # the traceback points at the page's line
    assert "docs/broken.md:13: the block failed on 2 processes" in out and "rank 1 fails" in out


def test_blocks_continue_on_their_page_and_a_marked_block_is_skipped(tmp_path: Path) -> None:
    """A ``# continues`` block shares its page's namespace; a ``# not run: <reason>`` block is skipped."""
    pytest.importorskip("markdown_it")
    page = (
        "# Page\n\n```python\nsize = 3\n```\n\nText.\n\n"
        "```python\n# continues the block above: size\nassert size == 3\n```\n\n"
        "```python\n# not run: needs a cluster\nraise SystemExit(1)\n```\n\n```bash\nexit 1\n```\n"
    )
    proc = _run_code_blocks(tmp_path, {"docs/page.md": page})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "5 passed, 1 skipped" in out, out  # 3 blocks run or skipped, 2 stand-alone checks, 1 self-test
    assert "docs/page.md:15: not run: needs a cluster" in out


# --- References to repository files: links (on the site a copy of the file, in a checkout the file).

REPO_PATH = re.compile(
    r"(?<!\[)`((?:tests|flatten_parametrize|benchmarks|constraints)/[\w./-]+\.(?:py|txt|pt))"
)


def test_references_to_repository_files_in_the_pages_are_links() -> None:
    """A `tests/...py` (or package, benchmark, constraint file) named in a page's text links to that file.

    The strict build then checks that each link names a file (the site serves it as a download).
    """
    bare = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if "_build" in page.parts:
            continue
        fenced = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced:
                bare += [f"{page.relative_to(ROOT)}:{number}: {m.group(1)}" for m in REPO_PATH.finditer(line)]
    assert not bare, "repository files named without a link:\n" + "\n".join(bare)
