"""``setup.cfg`` claims the versions that the test suite was run on, and no others.

The table of ``docs/getting-started.md`` ("Supported versions") records each run of
``.ci/test-torch``; ``python_requires`` and the torch floor of ``install_requires`` are the
oldest Python and torch of a row without failures. torch stays a range there (users bring
their own build); only ``constraints/ci.txt`` pins it, for CI and the README's test command.
"""

from __future__ import annotations

import configparser
import re
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _measured_rows() -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    """Return ``(torch, python, tests)`` of each row of the table of supported versions."""
    page = (ROOT / "docs" / "getting-started.md").read_text()
    section = page.split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"\d+\.\d+\.\d+", cells[0]):
            rows.append((_version(cells[0]), _version(cells[1]), cells[2]))
    return rows


def _options() -> configparser.SectionProxy:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config["options"]


def test_floors_of_setup_cfg_are_the_oldest_passing_runs() -> None:
    """python_requires and the torch floor are the oldest Python and torch of a run without failures."""
    rows = _measured_rows()
    passing = [row for row in rows if re.search(r"\b0 failed\b", row[2]) and "passed" in row[2]]
    assert passing, rows
    options = _options()
    python_floor = re.fullmatch(r">=\s*(\d+\.\d+)", options["python_requires"].strip())
    assert python_floor is not None, options["python_requires"]
    torch_floor = re.search(r"^torch>=(\d+\.\d+)\s*$", options["install_requires"], re.M)
    assert torch_floor is not None, options["install_requires"]
    assert _version(torch_floor.group(1)) == min(row[0] for row in passing)[:2]
    assert _version(python_floor.group(1)) == min(row[1] for row in passing)[:2]


def test_torch_is_a_range_for_users_and_pinned_only_for_ci() -> None:
    """install_requires names torch as a range; constraints/ci.txt pins the release CI installs."""
    requirement = re.search(r"^torch\b.*$", _options()["install_requires"], re.M)
    assert requirement is not None and "==" not in requirement.group(0)
    pins = re.findall(r"^torch==(\S+)$", (ROOT / "constraints" / "ci.txt").read_text(), re.M)
    assert len(pins) == 1
    floor = _version(requirement.group(0))
    assert _version(pins[0]) >= floor and _version(torch.__version__) >= floor


def test_the_table_has_a_passing_row_for_the_torch_ci_pins() -> None:
    """The release that CI installs (``constraints/ci.txt``) is a measured row without failures."""
    pins = re.findall(r"^torch==(\S+)$", (ROOT / "constraints" / "ci.txt").read_text(), re.M)
    rows = [row for row in _measured_rows() if row[0] == _version(pins[0])]
    assert rows, f"docs/getting-started.md has no row for torch {pins[0]}, the release CI runs"
    assert all(re.search(r"\b0 failed\b", tests) for _, _, tests in rows), rows


def test_version_runner_needs_a_torch_release() -> None:
    """`.ci/test-torch` without a release prints its usage and fails before building anything."""
    before = sorted(ROOT.glob(".venv-torch-*"))
    command = ["bash", str(ROOT / ".ci" / "test-torch")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "usage: bash .ci/test-torch TORCH_VERSION [PYTHON]" in proc.stderr
    assert sorted(ROOT.glob(".venv-torch-*")) == before
