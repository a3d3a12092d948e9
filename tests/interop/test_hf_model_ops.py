"""transformers' model operations on a flattened model: get_parameter, tie_weights, resize_token_embeddings.

Each against the plain twin built from the same seed and changed the same way (the same RNG
state before each resize, since new rows are sampled): same logits, weights, ties,
``num_parameters()`` (no dead space) and training.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage

from _helpers import assert_same_values, assert_unchanged, snapshot, train_steps, twin
from _hf import gpt2, lm_loss, tokens


def _pair(tie: bool = True) -> tuple[nn.Module, nn.Module]:
    plain = gpt2(tie=tie)
    flat = twin(plain)
    register_flat_storage(flat)
    return plain, flat


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 8), generator=torch.Generator().manual_seed(0))


def _assert_same_model(plain: nn.Module, flat: nn.Module, vocab: int) -> None:
    ids = _ids(vocab)
    assert torch.equal(flat(ids).logits, plain(ids).logits)
    assert_same_values(flat, plain)
    assert flat.num_parameters() == plain.num_parameters()
    assert flat.config.vocab_size == plain.config.vocab_size == vocab
    tied = plain.lm_head.weight is plain.transformer.wte.weight
    assert (flat.lm_head.weight.data_ptr() == flat.transformer.wte.weight.data_ptr()) is tied


def _train_alike(plain: nn.Module, flat: nn.Module, vocab: int) -> None:
    batches = [_ids(vocab)] * 3
    ref = train_steps(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), batches, lm_loss)
    got = train_steps(flat, torch.optim.AdamW(flat.parameters(), lr=1e-2), batches, lm_loss)
    assert got == pytest.approx(ref, rel=1e-6)
    assert_same_values(flat, plain, rtol=1e-5, atol=1e-6)


def test_get_parameter_and_get_parameter_or_buffer_find_flattened_names():
    """Both give the view that the attribute serves, for the tied name and its alias."""
    _, flat = _pair()
    assert flat.get_parameter("transformer.wte.weight") is flat.transformer.wte.weight
    assert flat.get_parameter_or_buffer("lm_head.weight") is flat.lm_head.weight
    assert flat.get_parameter("lm_head.weight").data_ptr() == flat.transformer.wte.weight.data_ptr()
    with pytest.raises(AttributeError, match="neither a parameter, buffer, nor extra state"):
        flat.get_parameter_or_buffer("lm_head.nothing")


def test_tie_weights_keeps_the_tie_and_changes_nothing():
    """tie_weights() on a tied flattened GPT-2 is a no-op: same objects, values and layout."""
    _, flat = _pair()
    storage = get_flat_storage(flat)
    snap = snapshot(flat)
    layout = storage.param_infos
    flat.tie_weights()
    assert_unchanged(flat, snap)
    assert storage.param_infos == layout


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("vocab", [120, 40], ids=["grow", "shrink"])
def test_resize_token_embeddings_gives_the_plain_models_result(tie: bool, vocab: int):
    """Grow and shrink, tied and untied: same weights, logits, tie, num_parameters and training."""
    plain, flat = _pair(tie)
    storage = get_flat_storage(flat)
    flat_param = storage["0"]
    torch.manual_seed(1)
    expected = plain.resize_token_embeddings(vocab)
    torch.manual_seed(1)
    got = flat.resize_token_embeddings(vocab)
    assert got is flat.get_input_embeddings() and got.num_embeddings == expected.num_embeddings == vocab
    assert get_flat_storage(flat) is storage and storage["0"] is flat_param and storage.is_flattened
    assert flat_param.numel() == flat.num_parameters()  # no dead space in the buffer
    assert storage.param_infos[0].shape == (vocab, 16)
    _assert_same_model(plain, flat, vocab)
    _train_alike(plain, flat, vocab)


def test_resize_token_embeddings_inside_unflattened_gives_the_plain_models_result():
    """Resized inside unflattened(): still unflattened in the block, flat after it, as the plain model."""
    plain, flat = _pair()
    storage = get_flat_storage(flat)
    torch.manual_seed(1)
    plain.resize_token_embeddings(100, pad_to_multiple_of=8)
    with storage.unflattened():
        torch.manual_seed(1)
        flat.resize_token_embeddings(100, pad_to_multiple_of=8)
        assert not storage.is_flattened
        assert isinstance(flat.transformer.wte.weight, nn.Parameter)
    assert storage.is_flattened
    _assert_same_model(plain, flat, 104)
    _train_alike(plain, flat, 104)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resize_token_embeddings_after_an_optimizer_exists_behaves_as_on_the_plain_model(optimizer: str):
    """The flat parameter stays: SGD trains on as the plain model; Adam's state does not fit (both raise)."""
    plain, flat = _pair()

    def make(model: nn.Module) -> torch.optim.Optimizer:
        if optimizer == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.1)
        return torch.optim.Adam(model.parameters(), lr=0.1)

    opt_plain, opt_flat = make(plain), make(flat)
    batch = [tokens()]
    train_steps(plain, opt_plain, batch, lm_loss)
    train_steps(flat, opt_flat, batch, lm_loss)
    for model in (plain, flat):
        torch.manual_seed(1)
        model.resize_token_embeddings(100)
    if optimizer == "adam":
        for model, opt in ((plain, opt_plain), (flat, opt_flat)):
            with pytest.raises(RuntimeError, match="must match the size"):
                train_steps(model, opt, batch, lm_loss)
        return
    train_steps(plain, opt_plain, batch * 2, lm_loss)
    train_steps(flat, opt_flat, batch * 2, lm_loss)
    assert_same_values(flat, plain, rtol=1e-5, atol=1e-6)


def test_assigning_a_new_parameter_to_the_tied_embedding_unties_as_the_plain_model():
    """wte.weight = Parameter(new): lm_head keeps the old weight on both models (before: both changed)."""
    plain, flat = _pair()
    new = torch.randn(64, 16)
    plain.transformer.wte.weight = nn.Parameter(new.clone())
    flat.transformer.wte.weight = nn.Parameter(new.clone())
    assert flat.lm_head.weight.data_ptr() != flat.transformer.wte.weight.data_ptr()
    _assert_same_model(plain, flat, 64)
    _train_alike(plain, flat, 64)


def test_tie_weights_after_untying_ties_again():
    """tie_weights() after an untie re-ties lm_head to wte on both models (one slot, no dead space)."""
    plain, flat = _pair()
    new = torch.randn(64, 16)
    plain.transformer.wte.weight = nn.Parameter(new.clone())
    flat.transformer.wte.weight = nn.Parameter(new.clone())
    plain.tie_weights()
    flat.tie_weights()
    info = get_flat_storage(flat).param_infos[0]
    assert (info.name, info.aliases) == ("transformer.wte.weight", ("lm_head.weight",))
    _assert_same_model(plain, flat, 64)
    _train_alike(plain, flat, 64)


def test_set_input_embeddings_then_tie_weights_ties_as_the_plain_model():
    """A new embedding module, then tie_weights(): lm_head is tied to it (before: its values were copied)."""
    plain, flat = _pair()
    torch.manual_seed(3)
    plain.set_input_embeddings(nn.Embedding(64, 16))
    torch.manual_seed(3)
    flat.set_input_embeddings(nn.Embedding(64, 16))
    plain.tie_weights()
    flat.tie_weights()
    assert [n for n, _ in flat.named_parameters()] == ["flat_param_0"]
    _assert_same_model(plain, flat, 64)
    _train_alike(plain, flat, 64)


def test_resize_while_a_feature_holds_the_layout_raises_before_changing_anything(tmp_path):
    """Disk offload holds the layout: resize_token_embeddings raises, the model and its config unchanged."""
    _, flat = _pair()
    storage = get_flat_storage(flat)
    storage.offload_to_disk(tmp_path)
    snap = snapshot(flat)
    with pytest.raises(
        RuntimeError, match="cannot run resize_token_embeddings on a flattened module while DiskOffload"
    ):
        flat.resize_token_embeddings(120)
    assert_unchanged(flat, snap)
    assert flat.transformer.wte.num_embeddings == flat.config.vocab_size == 64


def test_a_refused_write_of_one_model_never_affects_another_model():
    """A pending wrong-shaped .data write on one model: another model's forward and step still work."""
    other_plain, other = _pair()
    opt, ref = (
        torch.optim.AdamW(other.parameters(), lr=1e-2),
        torch.optim.AdamW(other_plain.parameters(), lr=1e-2),
    )
    _, broken = _pair()
    broken.transformer.wte.weight.data = torch.zeros(120, 16)  # refused at its next sync, not here
    batches = [tokens()] * 2
    assert train_steps(other, opt, batches, lm_loss) == pytest.approx(
        train_steps(other_plain, ref, batches, lm_loss), rel=1e-6
    )
    with pytest.raises(RuntimeError, match=r"cannot take `transformer\.wte\.weight\.data = tensor`"):
        broken(tokens())
