"""Inspection: repr, summary table, HTML."""

from __future__ import annotations

from torch import nn

from flatten_parametrize import register_flat_storage

from _helpers import TiedLM


def test_summary_lists_every_slot_with_its_columns():
    """summary() is a table with name, group, offset, numel, shape and dtype for each slot."""
    model = TiedLM()
    storage = register_flat_storage(model)
    lines = storage.summary().splitlines()
    assert lines[0].split() == ["name", "group", "offset", "numel", "shape", "dtype"]
    assert len(lines) == 2 + len(storage.param_infos)
    assert "embed.weight (= head.weight)" in lines[2]
    assert lines[5].split()[:4] == ["body.weight", "0", "78", "36"]


def test_repr_fits_one_screen_for_a_big_model():
    """repr(storage) stays short for hundreds of parameters and points to summary()."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(200)])
    storage = register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]})
    text = repr(storage)
    assert len(text.splitlines()) <= 24
    assert text.startswith("FlatStorage of Sequential: 2 groups, 400 tensors")
    assert "group 'w': 200 tensors, 3,200 elements" in text
    assert "388 more (storage.summary() lists all)" in text


def test_repr_html_renders_a_table():
    """_repr_html_ gives an HTML table with one row per slot, escaped."""
    model = TiedLM()
    html = register_flat_storage(model)._repr_html_()
    assert html.count("<tr>") == 1 + 5 and "<th>offset</th>" in html
    assert "embed.weight (= head.weight)" in html and "FlatStorage of TiedLM" in html


def test_repr_shows_mode_and_padding():
    """The header says flattened/unflattened and groups show their padding."""
    model = nn.Linear(3, 3)
    storage = register_flat_storage(model, align=8)
    assert "flattened" in repr(storage) and "padding 12" in repr(storage)
    storage.unflatten()
    assert "unflattened" in repr(storage).splitlines()[0]
