"""A picture of the flat buffers (matplotlib, optional): which parameter occupies which range."""

from __future__ import annotations

from typing import Any

from .._core.names import alias_label, dtype_name
from .._core.records import Coordinator
from .summary import header

__all__ = ["plot_layout"]

#: Per group, the two alternating shades of its slots (pairs of matplotlib's "tab20").
_SHADES = [
    ("#1f77b4", "#aec7e8"),
    ("#ff7f0e", "#ffbb78"),
    ("#2ca02c", "#98df8a"),
    ("#d62728", "#ff9896"),
    ("#9467bd", "#c5b0d5"),
    ("#8c564b", "#c49c94"),
    ("#e377c2", "#f7b6d2"),
    ("#7f7f7f", "#c7c7c7"),
    ("#bcbd22", "#dbdb8d"),
    ("#17becf", "#9edae5"),
]
_PADDING = "#ffffff"


def _matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "storage.plot_layout() needs matplotlib, which cannot be imported "
            f"({error}); install it with `pip install matplotlib` "
            "(or the plot extra: `pip install flatten_parametrize[plot]`)"
        ) from None
    return Figure


def _gaps(numel: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Return the ``(start, width)`` ranges of ``[0, numel)`` that no range covers."""
    gaps, cursor = [], 0
    for start, width in sorted(ranges):
        if start > cursor:
            gaps.append((cursor, start - cursor))
        cursor = max(cursor, start + width)
    if numel > cursor:
        gaps.append((cursor, numel - cursor))
    return gaps


def plot_layout(
    storage: Coordinator,
    *,
    figsize: tuple[float, float] | None = None,
    labels: bool = True,
    min_label_fraction: float = 0.05,
    title: str | None = None,
) -> Any:
    """Draw the flat buffers: which parameter occupies which range, padding and groups.

    One horizontal bar per group, its x axis the element offset in that
    group's flat parameter. Each parameter is a box over the range it
    occupies, in the group's colour (two alternating shades, so that
    neighbours stand apart); padding is white and hatched. Works headless:
    the result is a ``matplotlib.figure.Figure`` made without ``pyplot``, so
    save it with ``fig.savefig(path)`` or show it as the last line of a
    Jupyter cell.

    Args:
        storage: the flat storage to draw.
        figsize: ``(width, height)`` in inches. Default: 10 wide, 1.1 per group.
        labels: write each parameter's name in its box when the box is wide
            enough. Default: ``True``.
        min_label_fraction: the narrowest box, as a fraction of its bar, that
            gets a label. Default: ``0.05``.
        title: the figure's title. Default: the storage's one-line summary.

    Returns:
        A ``matplotlib.figure.Figure`` with one axes per group.

    Raises:
        ImportError: if matplotlib is not installed (``pip install matplotlib``).

    Example:
        >>> from torch import nn
        >>> from flatten_parametrize import register_flat_storage
        >>> model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
        >>> storage = register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]}, align=4)
        >>> fig = storage.plot_layout()
        >>> for ax in fig.axes:
        ...     print(ax.get_title(loc="left"))
        group 'w': 2 tensors, 28 elements, float32, padding 3
        group 'b': 2 tensors, 12 elements, float32, padding 5
    """
    figure_class = _matplotlib()
    groups = storage.groups()
    infos = storage.param_infos
    rows = max(len(groups), 1)
    fig = figure_class(figsize=figsize or (10.0, 0.6 + 1.1 * rows), layout="constrained")
    fig.suptitle(title if title is not None else header(storage), fontsize=10)
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    if not groups:
        axes[0].set_axis_off()
        axes[0].text(0.5, 0.5, "no flat parameters", ha="center", va="center")
        return fig
    for g, (ax, record) in enumerate(zip(axes, groups)):
        group, flat = record.name, record.flat
        members = [info for info in infos if info.group == group]
        numel = flat.numel()
        dark, light = _SHADES[g % len(_SHADES)]
        ranges = [(info.offset, info.numel) for info in members]
        ax.broken_barh(
            ranges[0::2], (0, 1), facecolors=dark, edgecolors="white", linewidth=0.5, label="slots"
        )
        ax.broken_barh(
            ranges[1::2], (0, 1), facecolors=light, edgecolors="white", linewidth=0.5, label="slots"
        )
        padding = _gaps(numel, ranges)
        if padding:
            ax.broken_barh(
                padding, (0, 1), facecolors=_PADDING, edgecolors="0.45", hatch="////", label="padding"
            )
        if labels:
            for i, info in enumerate(members):
                if numel and info.numel / numel >= min_label_fraction:
                    ax.text(
                        info.offset + info.numel / 2,
                        0.5,
                        alias_label(info.name, info.aliases),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if i % 2 == 0 else "black",
                        clip_on=True,
                    )
        pad = sum(width for _, width in padding)
        count = len(members)
        ax.set_title(
            f"group '{group}': {count} tensor{'s' if count != 1 else ''}, {numel:,} elements, "
            f"{dtype_name(flat.dtype)}" + (f", padding {pad:,}" if pad else ""),
            loc="left",
            fontsize=9,
        )
        ax.set_xlim(0, max(numel, 1))
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.spines[["top", "right", "left"]].set_visible(False)
    axes[-1].set_xlabel("element offset in the flat parameter")
    return fig
