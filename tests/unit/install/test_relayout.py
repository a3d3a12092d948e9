"""Ties changed by assignment, get_parameter, and laying a storage out again (``_install/relayout.py``).

Each case against a plain twin changed the same way: the flattened model ties and unties
as the plain one does, keeps its FlatStorage and FlatParameter objects, and has no dead
space afterwards.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage

from _helpers import (
    TiedHead,
    assert_agrees_with_twin,
    assert_unchanged,
    core_of,
    registered_bn_mlp,
    snapshot,
    train_steps,
    twin,
)

TOKENS = torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1]])


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def _pair(**kwargs: object) -> tuple[TiedHead, TiedHead]:
    plain = TiedHead()
    flat = twin(plain)
    register_flat_storage(flat, **kwargs)  # type: ignore[arg-type]
    return plain, flat


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_get_parameter_gives_the_view_that_the_attribute_serves():
    """get_parameter of a flattened name: the attribute's view (flat mode), the real parameter unflattened."""
    _, flat = _pair()
    storage = get_flat_storage(flat)
    assert flat.get_parameter("head.weight") is flat.head.weight
    assert flat.get_parameter("emb.weight").data_ptr() == flat.head.weight.data_ptr()
    assert flat.proj.get_parameter("bias") is flat.proj.bias
    assert flat.get_parameter("flat_param_0") is storage["0"]
    with pytest.raises(AttributeError, match="has no attribute `nothing`"):
        flat.get_parameter("proj.nothing")
    with storage.unflattened():
        param = flat.get_parameter("head.weight")
        assert isinstance(param, nn.Parameter) and param is flat.emb.weight


def test_assigning_a_new_parameter_to_one_tied_name_unties_as_the_plain_model():
    """head.weight = Parameter(new) on a tied slot: the embedding keeps the old weight, as on a plain one."""
    plain, flat = _pair()
    storage = get_flat_storage(flat)
    flat_param = storage["0"]
    new = torch.randn(5, 4)
    plain.head.weight = nn.Parameter(new.clone())
    flat.head.weight = nn.Parameter(new.clone())
    assert get_flat_storage(flat) is storage and storage["0"] is flat_param
    assert [(i.name, i.aliases) for i in storage.param_infos] == [
        ("emb.weight", ()),
        ("head.weight", ()),  # where the tied slot was: slots keep the order of their names
        ("proj.weight", ()),
        ("proj.bias", ()),
    ]
    assert _numel(flat) == _numel(plain) == flat_param.numel()
    assert_agrees_with_twin(plain, flat, TOKENS, step=True)


def test_assigning_another_slots_view_ties_as_the_plain_model():
    """a.weight = b.weight in flat mode (b.weight a view of another slot) ties the names, no dead space."""
    plain, flat = _pair()
    plain.head.weight = nn.Parameter(torch.ones(5, 4))
    flat.head.weight = nn.Parameter(torch.ones(5, 4))
    plain.head.weight = plain.emb.weight
    flat.head.weight = flat.emb.weight  # a view: the flat translation of the plain tie
    storage = get_flat_storage(flat)
    assert storage.param_infos[0].aliases == ("head.weight",)
    assert _numel(flat) == _numel(plain) == storage["0"].numel()
    assert_agrees_with_twin(plain, flat, TOKENS, step=True)


def test_assigning_an_ordinary_parameter_of_the_model_ties_to_it():
    """A new submodule's (ordinary) parameter assigned to a flattened name ties as on the plain model."""
    plain, flat = _pair()
    torch.manual_seed(1)
    plain.emb = nn.Embedding(5, 4)
    torch.manual_seed(1)
    flat.emb = nn.Embedding(5, 4)
    plain.head.weight = plain.emb.weight
    flat.head.weight = flat.emb.weight  # an ordinary parameter: before, its values were copied
    assert flat.head.weight.data_ptr() == flat.emb.weight.data_ptr()
    assert [n for n, _ in flat.named_parameters()] == ["flat_param_0"]
    assert _numel(flat) == _numel(plain)
    assert_agrees_with_twin(plain, flat, TOKENS, step=True)


def test_a_new_parameter_for_an_untied_slot_still_lands_in_it():
    """No tie changes: the values are copied into the slot, the layout stays."""
    model, storage = registered_bn_mlp()
    flat_param = storage["a"]
    layout = [(i.name, i.offset) for i in storage.param_infos]
    model[0].bias = nn.Parameter(torch.full((4,), 3.0))
    assert storage["a"] is flat_param and [(i.name, i.offset) for i in storage.param_infos] == layout
    assert torch.equal(model[0].bias, torch.full((4,), 3.0))


def test_relayout_keeps_the_mode_alignment_and_groups():
    """Untying with align=4 and named groups: same group names, aligned offsets, flat mode."""
    plain = TiedHead()
    flat = twin(plain)
    storage = register_flat_storage(flat, {"embeddings": ["emb.weight"], "rest": ["proj.*"]}, align=4)
    flat.head.weight = nn.Parameter(torch.zeros(5, 4))
    plain.head.weight = nn.Parameter(torch.zeros(5, 4))
    assert storage.group_names == ["embeddings", "rest"] and storage.is_flattened
    assert all(i.offset % 4 == 0 for i in storage.param_infos)
    assert [i.name for i in storage.param_infos if i.group == "embeddings"] == ["emb.weight", "head.weight"]
    assert_agrees_with_twin(plain, flat, TOKENS)


def test_untying_with_an_optimizer_keeps_training_the_flat_parameter():
    """The flat parameter object stays: an optimizer without state built before trains the new layout."""
    plain, flat = _pair()
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_flat = torch.optim.SGD(flat.parameters(), lr=0.1)
    new = torch.randn(5, 4)
    plain.emb.weight = nn.Parameter(new.clone())
    flat.emb.weight = nn.Parameter(new.clone())
    # The plain optimizer holds the head's (old) weight but not the new embedding: add it.
    opt_plain.add_param_group({"params": [plain.emb.weight]})
    train_steps(plain, opt_plain, [TOKENS] * 2, _loss)
    train_steps(flat, opt_flat, [TOKENS] * 2, _loss)
    assert_agrees_with_twin(plain, flat, TOKENS)


def test_a_tie_change_with_a_parameter_of_another_dtype_is_refused_and_changes_nothing():
    """Untying with a float64 parameter would put it into a float32 group: RuntimeError, nothing changed."""
    _, flat = _pair()
    snap = snapshot(flat)
    with pytest.raises(
        RuntimeError, match=r"cannot set head\.weight to a parameter of torch\.float64 .*nothing was changed"
    ):
        flat.head.weight = nn.Parameter(torch.zeros(5, 4, dtype=torch.float64))
    assert_unchanged(flat, snap)


def test_a_tie_change_inside_using_is_refused_before_anything_changes():
    """Inside using() the storage is not laid out again: the usual refusal of assignment."""
    _, flat = _pair()
    storage = get_flat_storage(flat)
    with storage.using([storage["0"].detach().clone()]), pytest.raises(RuntimeError, match="cannot assign"):
        flat.head.weight = flat.proj.weight
    snap = snapshot(flat)
    with pytest.raises(RuntimeError, match=r"cannot run tying head\.weight .*inside storage\.using"):
        core_of(storage).using_depth += 1
        try:
            from flatten_parametrize._install.relayout import check_relayout

            check_relayout(core_of(storage), "tying head.weight to emb.weight")
        finally:
            core_of(storage).using_depth -= 1
    assert_unchanged(flat, snap)


def test_a_tie_change_while_a_feature_holds_the_layout_is_refused(tmp_path):
    """Disk offload holds the layout: untying raises before anything changes, naming the feature."""
    _, flat = _pair()
    storage = get_flat_storage(flat)
    storage.offload_to_disk(tmp_path)
    snap = snapshot(flat)
    with pytest.raises(
        RuntimeError, match=r"cannot run untying head\.weight on a flattened module while DiskOffload"
    ):
        flat.head.weight = nn.Parameter(torch.zeros(5, 4))
    assert_unchanged(flat, snap)


def test_relayout_during_a_load_is_refused():
    """While load_state_dict stages values the layout cannot change: RuntimeError."""
    from flatten_parametrize._install.relayout import check_relayout

    _, flat = _pair()
    core = core_of(get_flat_storage(flat))
    core.pending = []
    try:
        with pytest.raises(RuntimeError, match="while load_state_dict stages values"):
            check_relayout(core, "resize_token_embeddings")
    finally:
        core.pending = None
