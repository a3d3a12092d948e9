"""Inspection for terminals and notebooks: repr, summary table, HTML."""

from __future__ import annotations

import html

from .._core.names import alias_label, dtype_name
from .._core.records import Coordinator

__all__ = ["storage_repr", "summary_table", "storage_html", "format_bytes", "header"]

_COLUMNS = ("name", "group", "offset", "numel", "shape", "dtype")
_RIGHT = {"offset", "numel"}
_REPR_ROWS = 12


def format_bytes(count: int) -> str:
    """Return ``count`` bytes in binary units, e.g. ``'3.8 MiB'``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _rows(storage: Coordinator) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    infos = storage.param_infos
    # the names the tree reaches each slot by now; a removed storage has no module to look them up in
    current = storage.current_names() if storage.is_attached else [(i.name, *i.aliases) for i in infos]
    for info, names in zip(infos, current):
        label = alias_label(names[0], tuple(names[1:])) if names else f"{info.name} (replaced: dead space)"
        rows.append(
            (
                label,
                info.group,
                str(info.offset),
                str(info.numel),
                str(tuple(info.shape)),
                dtype_name(info.dtype),
            )
        )
    return rows


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(_COLUMNS)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            cell.rjust(w) if col in _RIGHT and cells is not _COLUMNS else cell.ljust(w)
            for cell, w, col in zip(cells, widths, _COLUMNS)
        ).rstrip()

    return [line(_COLUMNS), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def _group_lines(storage: Coordinator) -> list[str]:
    lines = []
    for group in storage.groups():
        flat, layout = group.flat, group.layout
        count = len(layout.numels)
        lines.append(
            f"  group {group.name!r}: {count} tensor{'s' if count != 1 else ''}, "
            f"{flat.numel():,} elements ({format_bytes(flat.numel() * flat.element_size())}), "
            f"{dtype_name(flat.dtype)} on {flat.device}, requires_grad={flat.requires_grad}"
            + (f", padding {layout.padding:,}" if layout.padding else "")
        )
    return lines


def header(storage: Coordinator) -> str:
    """Return the one-line description of ``storage``: module, groups, tensors, bytes, mode."""
    try:
        owner = type(storage.module_unchecked).__name__
    except RuntimeError:
        owner = "(collected module)"
    groups = storage.groups()
    total = sum(g.flat.numel() * g.flat.element_size() for g in groups)
    mode = "removed" if not storage.is_attached else "flattened" if storage.is_flattened else "unflattened"
    return (
        f"FlatStorage of {owner}: {len(groups)} group"
        f"{'s' if len(groups) != 1 else ''}, {len(storage.slots())} tensors, "
        f"{format_bytes(total)}, {mode}"
    )


def summary_table(storage: Coordinator) -> str:
    """Return the full table of slots as text."""
    return "\n".join(_table(_rows(storage)))


def storage_repr(storage: Coordinator) -> str:
    """Return a one-screen description: groups, then the first rows of the table."""
    rows = _rows(storage)
    lines = [header(storage), *_group_lines(storage)]
    if rows:
        shown = _table(rows[:_REPR_ROWS])
        lines += ["  " + line for line in shown]
        if len(rows) > _REPR_ROWS:
            lines.append(f"  ... {len(rows) - _REPR_ROWS} more (storage.summary() lists all)")
    return "\n".join(lines)


def storage_html(storage: Coordinator) -> str:
    """Return the header, groups and full table as an HTML fragment."""
    esc = html.escape
    head = "".join(f"<th>{esc(c)}</th>" for c in _COLUMNS)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td style="text-align:{"right" if col in _RIGHT else "left"}">{esc(cell)}</td>'
            for cell, col in zip(row, _COLUMNS)
        )
        + "</tr>"
        for row in _rows(storage)
    )
    groups = "".join(f"<li>{esc(line.strip())}</li>" for line in _group_lines(storage))
    return (
        f"<div><p><b>{esc(header(storage))}</b></p><ul>{groups}</ul>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )
