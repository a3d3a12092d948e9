"""Every write path lands in the flat buffer or raises.

`.data`, `_parameters`, `register_parameter`, a replaced flat parameter,
`load_state_dict(assign=True)`, `vector_to_parameters`: each against a plain twin.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from flatten_parametrize import FlatParameter, get_flat_storage, register_flat_storage
from flatten_parametrize._core.view_cache import WRITE_SCANS

from _helpers import TiedLM, assert_agrees_with_twin, assert_same_values, core_of, mlp, twin, values


def _pair(factory: Callable[[], nn.Module] = mlp, **kwargs: Any) -> tuple[nn.Module, nn.Module, Any]:
    plain = factory()
    flat = twin(plain)
    return plain, flat, register_flat_storage(flat, **kwargs)


# ----------------------------------------------------------------------- weight.data = t
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_data_assignment_lands_in_the_flat_buffer_for_every_mode_and_state_dict(mode):
    """`layer.weight.data = t` (same shape, dtype, device) is copied into the slot: every reader sees it."""
    plain, flat, storage = _pair()
    contexts = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}
    # Views of every mode are cached before the assignment.
    for context in contexts.values():
        with context():
            flat(torch.randn(2, 5))
    new = torch.randn(5, 5)
    with contexts[mode]():
        flat[2].weight.data = new.clone()
    plain[2].weight.data = new.clone()
    assert torch.equal(storage["0"].detach()[30:55].view(5, 5), new)
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))


def test_data_assignment_read_first_in_another_mode_still_lands():
    """An assignment in grad mode is seen by the next no-grad forward (other cache entry)."""
    plain, flat, _ = _pair()
    x = torch.randn(2, 5)
    with torch.no_grad():
        flat(x)
    flat[0].bias.data = torch.full((5,), 3.0)
    plain[0].bias.data = torch.full((5,), 3.0)
    with torch.no_grad():
        torch.testing.assert_close(flat(x), plain(x), rtol=0, atol=0)


def test_peft_style_safe_merge_through_data_trains_like_the_plain_model():
    """The merge idiom `w = weight.data.clone(); w += delta; weight.data = w` lands; training matches."""
    plain, flat, _ = _pair()
    delta = torch.randn(5, 5) * 0.1
    for model in (plain, flat):
        merged = model[4].weight.data.clone()
        merged += delta
        model[4].weight.data = merged
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, flat)]
    x = torch.randn(4, 5)
    for _ in range(3):
        for model, opt in zip((plain, flat), opts):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    assert_same_values(values(flat), values(plain), rtol=1e-6, atol=1e-7)


def test_data_assignment_on_a_tied_weight_reaches_every_name():
    """`.data` assigned through one name of a tied parameter is seen through the other."""
    plain, flat, _ = _pair(TiedLM)
    new = torch.randn(11, 6)
    flat.head.weight.data = new.clone()
    plain.head.weight.data = new.clone()
    assert torch.equal(flat.embed.weight, new)
    assert_agrees_with_twin(plain, flat, torch.randint(0, 11, (2, 3)))


def test_data_assignment_of_another_shape_is_refused_and_changes_nothing():
    """A `.data` tensor that does not fit its slot: RuntimeError at the next read, values unchanged."""
    plain, flat, _ = _pair()
    flat[0].weight.data = torch.zeros(3, 3)
    with pytest.raises(
        RuntimeError,
        match=r"cannot take `0\.weight\.data = tensor`.*shape \(5, 5\).*got shape \(3, 3\).*"
        r"change shapes on the plain model \(remove_flat_storage",
    ):
        flat.state_dict()
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))


@pytest.mark.parametrize("write", ["crop", "reshape"])
def test_data_assignment_of_its_own_memory_in_another_shape_is_refused_and_changes_nothing(write):
    """`w.data = w.data[:3]` (or a reshape) keeps the data pointer: refused all the same, at the next forward.

    It was not seen: the view served the crop, the forward computed with it and the backward failed
    with autograd's "returned an invalid gradient", the flat buffer holding the old values.
    """
    plain, flat, _ = _pair()
    weight = flat[0].weight
    weight.data = weight.data[:3] if write == "crop" else weight.data.reshape(25)
    shape = r"\(3, 5\)" if write == "crop" else r"\(25,\)"
    with pytest.raises(RuntimeError, match=r"cannot take `0\.weight\.data = tensor`.*got shape " + shape):
        flat(torch.randn(1, 5))
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))


def test_data_assignment_of_another_dtype_is_refused_at_the_next_forward():
    """A `.data` tensor of another dtype: RuntimeError naming both dtypes, at the next forward."""
    plain, flat, _ = _pair()
    view = flat[0].weight
    view.data = torch.zeros(5, 5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"torch\.float32 on cpu; got shape \(5, 5\), torch\.float64"):
        flat(torch.randn(1, 5))
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))


@pytest.mark.parametrize("reader", ["training step", "flat parameter", "deepcopy", "unflatten", "optimizer"])
def test_data_assignment_lands_before_any_reader_of_the_flat_parameter(reader):
    """Optimizer steps, storage[...], deepcopy and toggles land a pending `.data` write first."""
    plain, flat, storage = _pair()
    flat(torch.randn(1, 5))
    new = torch.randn(5, 5)
    flat[2].weight.data = new.clone()
    plain[2].weight.data = new.clone()
    if reader == "training step":
        for model in (plain, flat):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(torch.ones(1, 5)).sum().backward()
            opt.step()
    elif reader == "flat parameter":
        assert torch.equal(storage["0"].detach()[30:55].view(5, 5), new)
    elif reader == "deepcopy":
        flat = twin(flat)
    elif reader == "unflatten":
        storage.unflatten()
        assert torch.equal(flat[2].weight.detach(), new)
        storage.flatten()
    else:
        opt = torch.optim.SGD(flat.parameters(), lr=0.0)
        opt.step()  # an optimizer step reads the flat parameter directly
        assert torch.equal(storage["0"].detach()[30:55].view(5, 5), new)
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))


# ------------------------------------------------- _parameters[...] / register_parameter
@pytest.mark.parametrize("how", ["setattr", "register_parameter", "_parameters"])
def test_a_parameter_set_on_a_flattened_attribute_lands_in_its_slot(how):
    """`layer.weight = nn.Parameter(t)`, `register_parameter`, `_parameters[...] = p` copy t into the slot."""
    plain, flat, _ = _pair()
    new = torch.randn(5, 5)
    for model in (plain, flat):
        param = nn.Parameter(new.clone())
        if how == "setattr" or model is plain:
            model[2].weight = param
        elif how == "register_parameter":
            model[2].register_parameter("weight", param)
        else:
            model[2]._parameters["weight"] = param
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))
    assert [name for name, _ in flat.named_parameters()] == ["flat_param_0"]
    assert "weight" not in flat[2]._parameters


def test_a_parameter_put_into_parameters_is_landed_by_state_dict_without_an_access():
    """accelerate-style `_parameters[name] = p` lands before the state dict reads the slot."""
    plain, flat, _ = _pair()
    new = torch.randn(5)
    flat[0]._parameters["bias"] = nn.Parameter(new.clone())
    plain[0].bias = nn.Parameter(new.clone())
    assert_same_values(values(flat), values(plain))
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))


@pytest.mark.parametrize(
    "value, message",
    [
        (nn.Parameter(torch.zeros(2, 2)), r"cannot set 2\.weight to a tensor of shape \(2, 2\)"),
        (nn.Parameter(torch.zeros(5, 5), requires_grad=False), r"requires_grad=False.*requires_grad=True"),
        (None, r"cannot set 2\.weight to NoneType"),
    ],
)
def test_a_parameter_that_cannot_land_is_refused_and_removed(value, message):
    """A bad `_parameters` entry raises at the next read and is removed: the model is as before."""
    plain, flat, _ = _pair()
    flat[2]._parameters["weight"] = value
    with pytest.raises(RuntimeError, match=message):
        flat(torch.randn(1, 5))
    assert "weight" not in flat[2]._parameters
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))


# ------------------------------------------------------------ replacing a flat parameter
@pytest.mark.parametrize("how", ["setattr", "_parameters"])
def test_a_replaced_flat_parameter_is_adopted_everywhere(how):
    """`model.flat_param_0 = p` / `_parameters[...] = p`: coordinator, forward, state dicts, toggles agree."""
    plain, flat, storage = _pair()
    vector = torch.randn(storage["0"].numel())
    vector_to_parameters(vector.clone(), plain.parameters())
    param = nn.Parameter(vector.clone())
    if how == "setattr":
        flat.flat_param_0 = param
    else:
        flat._parameters["flat_param_0"] = param
        flat(torch.randn(1, 5))  # the next forward adopts it
    assert storage["0"] is param and type(param) is FlatParameter
    assert param.metadata() == (
        [f"{i}.{k}" for i in (0, 2, 4) for k in ("weight", "bias")],
        [torch.Size(s) for _ in range(3) for s in ((5, 5), (5,))],
        [25, 5] * 3,
    )
    assert storage.flat_state_dict()["flat_param_0"].data_ptr() == param.data_ptr()
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))
    # Training through the new flat parameter matches the plain model.
    for model in (plain, flat):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2, 5)).sum().backward()
        opt.step()
    assert_same_values(values(flat), values(plain), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "value, message",
    [
        (nn.Parameter(torch.zeros(7)), r"cannot replace flat_param_0 with a parameter of shape \(7,\)"),
        (nn.Parameter(torch.zeros(90, dtype=torch.float64)), r"torch\.float64 on cpu: group '0'"),
    ],
)
@pytest.mark.parametrize("how", ["setattr", "_parameters"])
def test_a_flat_parameter_replacement_that_does_not_fit_is_refused(value, message, how):
    """A replacement of another size or dtype: RuntimeError naming the flat parameter; the old one stays."""
    plain, flat, storage = _pair()
    old = storage["0"]
    with pytest.raises(RuntimeError, match=message):
        if how == "setattr":
            flat.flat_param_0 = value
        else:
            flat._parameters["flat_param_0"] = value
            flat.state_dict()
    assert flat.flat_param_0 is old and storage["0"] is old
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))


def test_replacing_a_flat_parameter_in_unflattened_mode_is_refused():
    """In unflattened mode there is no flat parameter to replace: RuntimeError saying to flatten first."""
    plain, flat, storage = _pair()
    with storage.unflattened():
        with pytest.raises(RuntimeError, match=r"cannot replace flat_param_0 in unflattened mode"):
            flat.flat_param_0 = nn.Parameter(torch.zeros(90))
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))


def test_functional_call_with_the_flat_parameter_is_not_a_replacement():
    """A plain tensor substituted by functional_call serves the views without being adopted."""
    plain, flat, storage = _pair()
    old = storage["0"]
    other = torch.randn(90)
    out = torch.func.functional_call(flat, {"flat_param_0": other}, (torch.ones(1, 5),))
    vector_to_parameters(other, plain.parameters())
    torch.testing.assert_close(out, plain(torch.ones(1, 5)))
    assert storage["0"] is old and flat.flat_param_0 is old


# ---------------------------------------------------------------- load_state_dict(assign=True)
@pytest.mark.parametrize("form", ["plain", "flat"])
@pytest.mark.parametrize("mode", ["flat", "unflattened"])
def test_load_state_dict_with_assign_lands_in_both_forms_and_modes(form, mode):
    """`load_state_dict(sd, assign=True)` gives every reader the loaded values; the flat parameter stays."""
    plain, flat, storage = _pair()
    source = mlp(seed=7)
    source_flat = twin(source)
    source_storage = register_flat_storage(source_flat)
    plain.load_state_dict(source.state_dict(), assign=True)
    sd = source.state_dict() if form == "plain" else source_storage.flat_state_dict()
    sd = {k: v.clone() for k, v in sd.items()}
    old = storage["0"]
    if mode == "flat":
        flat.load_state_dict(sd, assign=True)
    else:
        with storage.unflattened():
            flat.load_state_dict(sd, assign=True)
    assert storage["0"] is old and flat.flat_param_0 is old
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))


# ----------------------------------------------------------------- vector_to_parameters
@pytest.mark.parametrize("mode", ["flat", "unflattened"])
def test_vector_to_parameters_lands_in_both_modes(mode):
    """`vector_to_parameters(v, model.parameters())` writes v (one group, align 1: the plain order)."""
    plain, flat, storage = _pair()
    vector = torch.randn(90)
    vector_to_parameters(vector.clone(), plain.parameters())
    if mode == "flat":
        vector_to_parameters(vector.clone(), flat.parameters())
    else:
        with storage.unflattened():
            vector_to_parameters(vector.clone(), flat.parameters())
    assert torch.equal(parameters_to_vector(flat.parameters()), vector)
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
@pytest.mark.parametrize("safe_merge", [True, False])
def test_peft_merge_and_unload_equals_the_plain_model(safe_merge):
    """peft's LoRA merge (`.data` writes, adapters wrapped and unloaded) gives the plain model's result."""
    import peft

    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.q = nn.Linear(4, 4)
            self.out = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.q(x)))

    plain, flat, storage = _pair(Small)
    merged = []
    for model in (plain, flat):
        torch.manual_seed(1)
        config = peft.LoraConfig(target_modules=["q"], r=2, init_lora_weights=False)
        merged.append(peft.get_peft_model(model, config).merge_and_unload(safe_merge=safe_merge))
    assert get_flat_storage(merged[1]) is storage
    assert_agrees_with_twin(merged[0], merged[1], torch.randn(3, 4))


# ------------------------------------------------------- when writes land, and what a forward costs
def _scans() -> dict[str, int]:
    return dict(WRITE_SCANS)


def _scanned_by(fn: Callable[[], Any]) -> dict[str, int]:
    """The `_parameters` dicts and cached views that the write checks visited while ``fn`` ran."""
    before = _scans()
    fn()
    return {key: WRITE_SCANS[key] - before[key] for key in before}


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 3, enable_nested_tensor=False).eval()


_NOTHING = {"parameters": 0, "views": 0, "exposed": 0}


@pytest.mark.parametrize("policy", [None, "bfloat16"])
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_a_forward_in_which_nothing_was_written_scans_nothing(mode, policy):
    """Steady forwards visit no `_parameters` dict, cached view or compute-copy slot looking for writes."""
    model = _encoder()
    mixed = None if policy is None else MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    storage = register_flat_storage(model, mixed_precision=mixed)
    x = torch.randn(2, 4, 16)
    context = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]

    def forwards() -> None:
        for _ in range(5):
            with context():
                model(x)

    forwards()  # the first reads make the views; the next forward checks them once
    assert _scanned_by(forwards) == _NOTHING
    # The old check visited every changed module and every cached view on each forward.
    core = core_of(storage)
    assert _scanned_by(core.sync_writes)["parameters"] == len(core.members()) > 10
    if mode == "grad":  # a training step: the optimizer lands writes by reading the flat gradient
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(x).sum().backward()
        assert _scanned_by(opt.step)["parameters"] == 0


def test_a_forward_after_a_write_lands_it():
    """A `.data` write read in another grad mode is found and landed; `_parameters` entries land on read."""
    plain, flat, storage = _pair()
    x = torch.randn(2, 5)
    for model in (plain, flat):
        with torch.no_grad():
            model(x)
            model(x)
    with torch.no_grad():
        assert _scanned_by(lambda: flat(x)) == _NOTHING
    new = torch.randn(5, 5)
    for model in (plain, flat):
        model[2].weight.data = new.clone()  # a read in grad mode: another cache entry
    with torch.no_grad():
        scanned = _scanned_by(lambda: torch.testing.assert_close(flat(x), plain(x), rtol=0, atol=0))
    assert scanned["views"] > 0
    assert torch.equal(storage["0"].detach()[30:55].view(5, 5), new)
    bias = torch.randn(5)
    for model in (plain, flat):
        model[4]._parameters["bias"] = nn.Parameter(bias.clone())
    with torch.no_grad():
        scanned = _scanned_by(lambda: torch.testing.assert_close(flat(x), plain(x), rtol=0, atol=0))
    assert scanned["parameters"] == 0  # landed by the read of `4.bias`, no dict was scanned
    assert "bias" not in flat[4]._parameters and torch.equal(storage["0"].detach()[85:90], bias)
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))


@pytest.mark.parametrize("when", ["before the forward", "after the backward", "without a forward"])
def test_a_data_write_lands_before_the_optimizer_steps(when):
    """The optimizer reads the flat gradient before it steps: it lands a `.data` write made any time."""
    plain, flat, _ = _pair()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, flat)]
    x = torch.randn(3, 5)
    new = torch.randn(5, 5)
    for model, opt in zip((plain, flat), opts):
        for step in range(3):
            opt.zero_grad()
            if step == 1 and when == "before the forward":
                model[2].weight.data = new.clone()
            model(x).pow(2).sum().backward()
            if step == 1 and when != "before the forward":
                model[2].weight.data = new.clone()
                if when == "without a forward":
                    opt.step()  # with the gradient of the old values, as for the plain model
            opt.step()
    assert_same_values(values(flat), values(plain), rtol=1e-6, atol=1e-6)


def test_registration_adds_no_process_wide_optimizer_hook():
    """Landing writes before a step needs no global optimizer hook: registering adds none."""
    from torch.optim import optimizer as optim_module

    before = (dict(optim_module._global_optimizer_pre_hooks), dict(optim_module._global_optimizer_post_hooks))
    register_flat_storage(mlp())
    after = (dict(optim_module._global_optimizer_pre_hooks), dict(optim_module._global_optimizer_post_hooks))
    assert after == before


def test_a_cached_read_reads_nothing_of_the_flat_parameter_but_its_identity(monkeypatch):
    """No `data_ptr()` per read: replacing the flat parameter's `.data` drops the views instead."""
    plain, flat, storage = _pair()
    x = torch.randn(2, 5)
    calls = []
    monkeypatch.setattr(
        FlatParameter, "data_ptr", lambda self: calls.append(1) or torch.Tensor.data_ptr(self)
    )
    with torch.no_grad():
        flat(x)
        flat(x)
        calls.clear()
        for _ in range(3):
            flat(x)
    assert calls == []
    new = torch.randn(90)
    storage["0"].data = new.clone()
    vector_to_parameters(new.clone(), plain.parameters())
    with torch.no_grad():
        torch.testing.assert_close(flat(x), plain(x), rtol=0, atol=0)
    assert_agrees_with_twin(plain, flat, torch.randn(2, 5))
