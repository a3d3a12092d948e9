"""The measured tables of the performance and mixed-precision pages say where, when and which way.

Every Markdown table of ``docs/performance.md`` and ``docs/mixed-precision.md`` that holds
measurements sits in a ``{table}`` directive whose caption names the machine, the torch
version, the date and which way is better ("lower is faster" or "lower is better"); the
measurement history ("was ...") lives in ``benchmarks/RESULTS.md``, not in the pages.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["performance.md", "mixed-precision.md"]
CAPTION = re.compile(r"^:::\{table\} (.+)$")


def _tables(text: str) -> list[tuple[str | None, str]]:
    """``(caption or None, first row)`` of each table of ``text``: a caption comes from ``{table}`` only."""
    tables, caption, in_table = [], None, False
    for line in text.splitlines():
        match = CAPTION.match(line)
        if match:
            caption = match.group(1)
        elif line.startswith("|") and not in_table:
            tables.append((caption, line))
            in_table = True
        elif not line.startswith("|"):
            in_table = False
            if line.startswith(":::") and not line.startswith(":::{"):
                caption = None
    return tables


#: Tables of rules and of memory arithmetic, not of measurements: no caption needed.
NOT_MEASURED = ("| Field |", "| Write path |", "| Setup | Bytes per parameter")


@pytest.mark.parametrize("page", PAGES)
def test_measured_tables_have_a_caption_with_machine_torch_date_and_direction(page: str) -> None:
    """Each table of measurements has a caption naming machine, torch, date and which way is better."""
    text = (ROOT / "docs" / page).read_text().split("```{include}")[0]
    tables = _tables(text)
    assert any(caption for caption, _ in tables), page
    for caption, row in tables:
        if row.startswith(NOT_MEASURED):
            continue
        assert caption is not None, f"{page}: table {row!r} has no caption"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", caption), caption
        assert "torch 2." in caption and "AMD EPYC" in caption, caption
        assert "lower is faster" in caption.lower() or "lower is better" in caption.lower(), caption


@pytest.mark.parametrize("page", PAGES)
def test_pages_carry_no_measurement_history(page: str) -> None:
    """Figures of earlier runs ("was 1.32 ...") are in benchmarks/RESULTS.md, not on the page."""
    text = (ROOT / "docs" / page).read_text().split("```{include}")[0]
    assert not re.search(r"\(was \d|; was \d|, was \d", text), page


# --- benchmarks/RESULTS.md: the current figures, one section per workload; the dated runs in HISTORY.md

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _sections(text: str) -> dict[str, str]:
    """``## `` title -> the section's text up to the next ``## `` title."""
    chunks = re.split(r"^(?=## )", text, flags=re.MULTILINE)[1:]
    return {chunk.splitlines()[0][3:]: chunk for chunk in chunks}


def test_results_hold_one_section_per_workload_with_command_machine_and_date() -> None:
    """RESULTS.md: one ``## <workload>: <description>`` per workload of ``python -m benchmarks``, undated."""
    from benchmarks.run import WORKLOADS

    sections = _sections((ROOT / "benchmarks" / "RESULTS.md").read_text())
    assert list(sections) == [f"{name}: {desc}" for name, (_, desc) in WORKLOADS.items()]
    for title, body in sections.items():
        assert not DATE.search(title), f"dated section title {title!r}: earlier runs go to HISTORY.md"
        assert "python -m benchmarks" in body, title
        assert re.search(r"^- machine: \S", body, flags=re.MULTILINE), title
        assert re.search(r"^- date: 20\d\d-\d\d-\d\d", body, flags=re.MULTILINE), title


def test_save_results_writes_the_same_shape() -> None:
    """``--save-results`` replaces the sections of the workloads it ran and keeps the others."""
    from benchmarks.run import WORKLOADS, results_file

    old = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    header = "- command: `python -m benchmarks --only access`\n- date: 2031-01-02\n- machine: some CPU"
    new = _sections(results_file(old, {"access": "### One `layer.weight` access\n\n| a |\n|---|"}, header))
    assert list(new) == list(_sections(old))
    access = new[f"access: {WORKLOADS['access'][1]}"]
    assert "- date: 2031-01-02" in access and "| a |" in access
    mlp = f"mlp: {WORKLOADS['mlp'][1]}"
    assert new[mlp].strip() == _sections(old)[mlp].strip()


def test_the_history_is_not_linked_from_the_pages() -> None:
    """benchmarks/HISTORY.md keeps the earlier runs; no page of the docs links to it."""
    assert (ROOT / "benchmarks" / "HISTORY.md").read_text().startswith("# ")
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert not re.search(r"\]\([^)]*HISTORY\.md", page.read_text()), page.name
