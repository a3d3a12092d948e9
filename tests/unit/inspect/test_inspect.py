"""Inspection: repr, summary table, HTML."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from flatten_parametrize import register_flat_storage, remove_flat_storage

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


def _cropped() -> tuple[nn.Sequential, Any]:
    """A model in per-tensor mode whose embedding was cropped as nanoGPT's ``crop_block_size`` does."""
    model = nn.Sequential(nn.Embedding(16, 4), nn.Linear(4, 3))
    storage = register_flat_storage(model)
    storage.unflatten()
    model[0].weight = nn.Parameter(model[0].weight[:8])  # nanoGPT's two lines, for one weight
    return model, storage


@pytest.mark.parametrize("show", ["param_infos", "summary", "repr", "html"])
def test_inspection_in_per_tensor_mode_shows_the_model_as_it_is_now(show: str) -> None:
    """Each way to look at the layout lands a change made since the last call first, as named_views does."""
    _, storage = _cropped()
    if show == "param_infos":
        assert [tuple(info.shape) for info in storage.param_infos] == [(8, 4), (3, 4), (3,)]
    else:
        text = {"summary": storage.summary, "repr": storage.__repr__, "html": storage._repr_html_}[show]()
        assert "(8, 4)" in text and "(16, 4)" not in text


def test_a_module_moved_in_the_tree_is_shown_under_its_new_name_not_as_dead_space() -> None:
    """A layer put into a container (as a fusion does) keeps its slot: summary() names it where it is now."""
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    storage = register_flat_storage(model)
    with storage.unflattened():
        model[0] = nn.Sequential(model[0])
    assert [info.name for info in storage.param_infos] == ["0.0.weight", "0.0.bias"]
    assert "dead space" not in storage.summary() and "0.0.weight" in repr(storage)


def test_inspection_of_a_removed_storage_says_so_and_lists_the_slots_it_had() -> None:
    model, storage = _cropped()
    remove_flat_storage(model)
    text = repr(storage)
    assert text.splitlines()[0].endswith(", removed") and "0.weight" in text
    assert "removed" in storage._repr_html_()
    assert [info.name for info in storage.param_infos] == ["0.weight", "1.weight", "1.bias"]
    assert storage.summary().splitlines()[2].startswith("0.weight")


def test_inspection_shows_the_held_layout_while_a_holder_refuses_the_change() -> None:
    """A change that cannot land (live ensemble stacks hold the layout) is refused by calls on the buffers."""
    model = nn.Sequential(nn.Embedding(16, 4), nn.Linear(4, 3))
    storage = register_flat_storage(model)
    stacks = storage.stack(2)
    storage.unflatten()
    model[0].weight = nn.Parameter(model[0].weight[:8])
    assert [tuple(info.shape) for info in storage.param_infos] == [(16, 4), (3, 4), (3,)]
    assert "(16, 4)" in storage.summary() and "(16, 4)" in repr(storage)
    with pytest.raises(RuntimeError, match="hold"):
        list(storage.named_views())
    del stacks
