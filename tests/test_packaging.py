"""The source distribution carries what it takes to run the tests and build the docs.

``MANIFEST.in`` lists them; this test builds the sdist from a copy of the tracked files
(with setuptools' PEP 517 backend in this environment, so no network and no ``build``
package are needed) and checks that every tracked file under ``tests/``, ``docs/``,
``notebooks/``, ``benchmarks/``, ``constraints/`` and ``.ci/`` is in it, with the
changelog and the root ``conftest.py``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a subprocess

ROOT = Path(__file__).resolve().parents[1]
CARRIED = ("tests/", "docs/", "notebooks/", "benchmarks/", "constraints/", ".ci/")
ALSO = {"CHANGELOG.md", "LICENSE", "README.md", "conftest.py", "setup.cfg", "pyproject.toml", "setup.py"}


def _tracked_files() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an unpacked sdist): nothing to compare the sdist with")
    proc = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [line for line in proc.stdout.splitlines() if (ROOT / line).is_file()]


def test_the_sdist_carries_the_tests_docs_notebooks_and_benchmarks(tmp_path: Path) -> None:
    """Every tracked file of the tests, docs, notebooks, benchmarks, constraints and CI is in the sdist."""
    tracked = _tracked_files()
    source = tmp_path / "source"
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, source / name)
    dist = tmp_path / "dist"
    dist.mkdir()
    build = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", build, str(dist)], cwd=source, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    archive = dist / proc.stdout.strip().splitlines()[-1]
    with tarfile.open(archive) as tar:
        top = archive.name.removesuffix(".tar.gz") + "/"
        members = {name.removeprefix(top) for name in tar.getnames()}
    wanted = {name for name in tracked if name.startswith(CARRIED) or name in ALSO}
    missing = sorted(wanted - members)
    assert not missing, f"tracked files not in the sdist: {missing}"
    assert not [name for name in members if "__pycache__" in name or name.startswith("docs/_build/")]
    assert "flatten_parametrize/py.typed" in members


def test_the_readme_links_resolve_in_the_source_tree_and_the_sdist() -> None:
    """Every relative link of the README names a file that the sdist carries too.

    The project has no public URL yet (none in ``setup.cfg``), so the README's links are
    relative: they work on a checkout, in the unpacked sdist and on a repository web view,
    and the README says so for readers of the package description on an index.
    """
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"[a-z]+:", link) and not link.startswith("#")]
    assert relative
    for link in relative:
        path = ROOT / link.split("#", 1)[0]
        assert path.exists(), f"README.md links to {link}, which does not exist"
        assert str(path.relative_to(ROOT)).startswith(CARRIED) or path.name in ALSO, link
