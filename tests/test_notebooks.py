"""Every notebook in ``notebooks/`` runs headless from top to bottom without a cell error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_exist() -> None:
    """The notebooks folder holds at least the quick start."""
    assert any(path.name.startswith("01_") for path in NOTEBOOKS), NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebook_runs(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The notebook executes in a fresh python3 kernel of this interpreter, every cell without error."""
    # The kernel spec launches `python`: put this interpreter's directory first on PATH so the
    # kernel runs in the same environment (with torch and this package) as the tests.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    notebook = nbformat.read(path, as_version=4)
    assert all(
        not cell.get("outputs") and cell.get("execution_count") is None
        for cell in notebook.cells
        if cell.cell_type == "code"
    ), f"{path.name} is committed with outputs; clear them"
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError naming the failing cell
