"""storage.plot_layout(): a matplotlib figure of the flat buffers, headless, matplotlib optional."""

from __future__ import annotations

import io
import sys

import matplotlib.figure
import pytest
from torch import nn

from flatten_parametrize import register_flat_storage

from _helpers import TiedLM


def _extents(ax, label: str) -> list[tuple[float, float]]:
    """Return the (start, end) x ranges of the boxes drawn with ``label`` on ``ax``."""
    out = []
    for collection in ax.collections:
        if collection.get_label() == label:
            for path in collection.get_paths():
                xs = path.vertices[:, 0]
                out.append((float(xs.min()), float(xs.max())))
    return sorted(out)


def test_one_axes_per_group_with_a_box_per_parameter():
    """Each group is one axes whose boxes cover exactly the ranges of its parameters."""
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    storage = register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]})
    fig = storage.plot_layout()
    assert isinstance(fig, matplotlib.figure.Figure)
    assert len(fig.axes) == 2
    for ax, group in zip(fig.axes, storage.group_names):
        expected = [(i.offset, i.offset + i.numel) for i in storage.param_infos if i.group == group]
        assert _extents(ax, "slots") == expected
        assert ax.get_xlim() == (0, storage[group].numel())
        assert ax.get_title(loc="left").startswith(f"group '{group}': 2 tensors")


def test_padding_is_drawn_hatched():
    """With align, the padding between and after parameters is drawn, hatched, and the title counts it."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))  # 9, 3, 9, 3 elements
    storage = register_flat_storage(model, align=8)
    (ax,) = storage.plot_layout().axes
    assert _extents(ax, "padding") == [(9, 16), (19, 24), (33, 40), (43, 48)]
    assert all(c.get_hatch() == "////" for c in ax.collections if c.get_label() == "padding")
    assert ax.get_title(loc="left").endswith("padding 24")


def test_groups_get_different_colours():
    """The boxes of different groups have different colours."""
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    storage = register_flat_storage(model, [["*.weight"], ["*.bias"]])
    colours = [
        {tuple(c.get_facecolor()[0]) for c in ax.collections if c.get_label() == "slots"}
        for ax in storage.plot_layout().axes
    ]
    assert colours[0] and colours[1] and not colours[0] & colours[1]


def test_wide_boxes_are_labelled_with_names_and_aliases():
    """Parameters wide enough get their name (with a tied parameter's aliases); labels=False draws none."""
    model = TiedLM()
    storage = register_flat_storage(model)
    texts = [t.get_text() for t in storage.plot_layout(min_label_fraction=0.1).axes[0].texts]
    assert texts == ["embed.weight (= head.weight)", "body.weight"]  # norm.*, body.bias: 6 of 120
    assert len(storage.plot_layout(labels=False).axes[0].texts) == 0


def test_figure_renders_headless_to_png():
    """The figure saves as PNG without a display or pyplot; figsize and title are honoured."""
    storage = register_flat_storage(TiedLM(), align=4)
    fig = storage.plot_layout(figsize=(6, 2), title="layout")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    assert buffer.getvalue().startswith(b"\x89PNG")
    assert tuple(fig.get_size_inches()) == (6, 2)
    assert fig.get_suptitle() == "layout"
    assert "matplotlib.pyplot" not in sys.modules or fig.canvas.manager is None


def test_empty_storage_draws_a_note():
    """A storage without groups gives a figure that says so."""
    storage = register_flat_storage(nn.ReLU())
    fig = storage.plot_layout()
    assert [t.get_text() for t in fig.axes[0].texts] == ["no flat parameters"]


def test_missing_matplotlib_raises_import_error_with_the_fix(monkeypatch: pytest.MonkeyPatch):
    """Without matplotlib, plot_layout raises an ImportError that says how to install it."""
    storage = register_flat_storage(nn.Linear(2, 2))
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"needs matplotlib.*`pip install matplotlib`.*\[plot\]"):
        storage.plot_layout()
