"""Per-tensor mode's write paths: what outside code puts on plain modules reaches every whole-buffer feature.

In per-tensor mode the modules are plain, so outside code writes to them as to the plain model. Each test
runs the write on the flattened model and on a plain twin from the same seed, then checks that the
whole-buffer features (a clip over ``flat_params``, ``flat_state_dict``, ``named_grads``, grad sync, an
optimizer over ``flat_params``) see the model as it is now, as the plain model's own tools see the twin.

nanoGPT's ``GPT.crop_block_size`` (karpathy/nanoGPT, model.py) is not a package; its two lines that touch
parameters are copied in :func:`crop_block_size`, as the issue that asked for this allows.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from flatten_parametrize import ShardedOptimizer, get_flat_storage, register_flat_storage, remove_flat_storage

from _helpers import cast_per_forward, twin


class _GPTish(nn.Module):
    """Token and position embeddings, one block, a tied head: nanoGPT's parameters in miniature."""

    def __init__(self, block_size: int = 16, vocab: int = 11, dim: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1])
        return self.head(torch.tanh(self.fc(self.wte(tokens) + self.wpe(pos))))


def crop_block_size(model: _GPTish, block_size: int) -> None:
    """nanoGPT's ``GPT.crop_block_size``: the position embedding replaced by a cropped ``nn.Parameter``."""
    model.block_size = block_size
    model.wpe.weight = nn.Parameter(model.wpe.weight[:block_size])


def _tokens(seed: int = 3, length: int = 8) -> torch.Tensor:
    return torch.randint(0, 11, (2, length), generator=torch.Generator().manual_seed(seed))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).pow(2).mean()


def _pair(
    policy: MixedPrecisionPolicy | None = None, unflatten: bool = True, grad_sync: bool = False
) -> tuple[_GPTish, _GPTish, object]:
    """A model and its flattened twin (with ``policy``, grad sync on), in per-tensor mode if ``unflatten``."""
    plain = _GPTish()
    model = twin(plain)
    storage = register_flat_storage(model, mixed_precision=policy)
    if grad_sync:
        storage.enable_grad_sync()
    if unflatten:
        storage.unflatten()
    return plain, model, storage


def test_crop_block_size_in_per_tensor_mode_reaches_every_whole_buffer_feature():
    """A cropped wpe: clip over flat_params, flat_state_dict, named_grads and AdamW(flat_params) as plain."""
    plain, model, storage = _pair()
    for m in (plain, model):
        crop_block_size(m, 8)
    for m in (plain, model):
        _loss(m, _tokens()).backward()
    norm = torch.nn.utils.clip_grad_norm_(storage.flat_params, 0.5)
    plain_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    assert torch.allclose(norm, plain_norm, rtol=1e-6, atol=0)
    assert sum(f.numel() for f in storage.flat_params) == sum(p.numel() for p in plain.parameters())
    grads = dict(storage.named_grads())
    assert grads["wpe.weight"].shape == (8, 4)
    for name, param in plain.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-6, atol=1e-7)
        assert model.get_parameter(name).grad.data_ptr() == grads[name].data_ptr()  # one memory
    assert storage.flat_state_dict()["flat_param_0"].numel() == sum(p.numel() for p in plain.parameters())
    assert model.wpe.weight.data_ptr() == dict(storage.named_views())["wpe.weight"].data_ptr()


def test_crop_block_size_then_training_over_flat_params_matches_the_plain_model():
    """AdamW over flat_params built before the crop: its state follows the slots; training as plain."""
    plain, model, storage = _pair()
    opt = torch.optim.AdamW(storage.flat_params, lr=1e-2)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(4):
        if step == 2:
            for m in (plain, model):
                crop_block_size(m, 8)
            ref = torch.optim.AdamW(plain.parameters(), lr=1e-2)  # the plain recipe: a new optimizer
            opt = torch.optim.AdamW(storage.flat_params, lr=1e-2)
        for m, o in ((model, opt), (plain, ref)):
            o.zero_grad()
            _loss(m, _tokens(step, 8 if step >= 2 else 16)).backward()
            o.step()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "write",
    [
        "setattr",
        "register_parameter",
        "_parameters",
        "parameters_dict",
        "data",
        "data_same_memory",
        "submodule",
        "to_double",
        "none",
    ],
)
def test_every_write_path_lands_in_the_storage_or_lays_it_out_again(write):
    """Whatever the write, the next call on the storage sees the plain model's parameters and values."""
    plain, model, storage = _pair()
    for m in (plain, model):
        new = torch.full((4, 4), 0.5)
        if write == "setattr":
            m.fc.weight = nn.Parameter(new)
        elif write == "register_parameter":
            m.fc.register_parameter("weight", nn.Parameter(new))
        elif write == "_parameters":
            m.fc._parameters["weight"] = nn.Parameter(new)
        elif write == "parameters_dict":  # a new dict in place of the module's (model surgery code)
            vars(m.fc)["_parameters"] = {**m.fc._parameters, "weight": nn.Parameter(new)}
        elif write == "data":
            m.fc.weight.data = new
        elif write == "data_same_memory":  # the same memory under another dtype: only the dtype tells
            m.fc.weight.data = m.fc.weight.data.view(torch.bfloat16)[:, ::2]
        elif write == "submodule":
            torch.manual_seed(9)
            m.fc = nn.Linear(4, 4)
        elif write == "to_double":
            m.fc.to(torch.float64)
        elif write == "none":
            m.fc.bias = None
    plain_names = {n for n, _ in plain.named_parameters()}
    if write == "to_double":  # cannot live in a float32 buffer: it leaves the storage, said once
        with pytest.warns(UserWarning, match=r"fc\.weight \(a tensor of float64, not float32\)"):
            views = dict(storage.named_views())
        assert set(views) == plain_names - {"fc.weight", "fc.bias"}
    elif write == "data_same_memory":
        with pytest.warns(UserWarning, match=r"fc\.weight \(a tensor of bfloat16, not float32\)"):
            views = dict(storage.named_views())
        assert set(views) == plain_names - {"fc.weight"}
    elif write == "submodule":  # a new module's parameters stay ordinary (SPEC "Structure changes")
        views = dict(storage.named_views())
        assert set(views) == plain_names - {"fc.weight", "fc.bias"}
        assert sum(f.numel() for f in storage.flat_params) == sum(v.numel() for v in views.values())
    else:
        views = dict(storage.named_views())
        assert set(views) == plain_names
        for name, view in views.items():
            assert torch.equal(view, plain.get_parameter(name)), name
            assert model.get_parameter(name).data_ptr() == view.data_ptr(), name  # the leaf is the slot
    if write in ("to_double", "data_same_memory"):  # neither model computes with mixed dtypes
        return
    _loss(model, _tokens()).backward()
    _loss(plain, _tokens()).backward()
    for name, grad in storage.named_grads():
        torch.testing.assert_close(grad, plain.get_parameter(name).grad, rtol=1e-6, atol=1e-7)
    storage.flatten()
    torch.testing.assert_close(model(_tokens()), plain(_tokens()), rtol=0, atol=0)


def test_a_leaf_replaced_by_a_parameter_of_its_shape_becomes_the_slots_leaf():
    """The new parameter object is the model's (as on the plain model), aliasing its slot of the buffer."""
    _, model, storage = _pair()
    new = nn.Parameter(torch.ones(4, 4))
    model.fc.weight = new
    flat = storage.flat_params[0]
    assert model.fc.weight is new and new.data_ptr() == dict(storage.named_views())["fc.weight"].data_ptr()
    with torch.no_grad():
        new.mul_(3)
    assert torch.equal(dict(storage.views_of(storage.flat_params))["fc.weight"], torch.full((4, 4), 3.0))
    assert flat is storage.flat_params[0]  # the flat parameter object stays


def test_a_gradient_present_before_the_replacement_is_kept():
    """A replacement between backward and step: the new parameter's own gradient lands, the old one goes."""
    plain, model, storage = _pair()
    for m in (plain, model):
        _loss(m, _tokens()).backward()
        crop_block_size(m, 8)
        m.wpe.weight.grad = torch.ones(8, 4)
    grads = dict(storage.named_grads())
    assert torch.equal(grads["wpe.weight"], torch.ones(8, 4))
    assert torch.equal(grads["fc.weight"], plain.fc.weight.grad)


@pytest.mark.usefixtures("world1")
def test_grad_sync_reduces_a_parameter_replaced_before_the_forward():
    """With grad sync on, the forward lays the groups out again first: the cropped wpe is reduced too."""
    plain, model, storage = _pair()
    storage.enable_grad_sync()
    reduced: list[int] = []
    flat = storage.flat_params[0]
    flat.register_post_accumulate_grad_hook(lambda p: reduced.append(p.grad.numel()))
    for m in (plain, model):
        crop_block_size(m, 8)
    _loss(model, _tokens()).backward()
    total = sum(p.numel() for p in plain.parameters())
    assert reduced == [total] and storage.flat_params[0].numel() == total
    storage.broadcast_params()  # the new layout: nothing refused
    assert torch.equal(model.wpe.weight, plain.wpe.weight)


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("feature", ["grad sync", "policy", "ShardedOptimizer"])
@pytest.mark.parametrize("given", ["tensors", "parameters"])
@pytest.mark.parametrize("how", ["unflatten()", "unflattened()"])
def test_functional_call_in_per_tensor_mode_computes_with_its_tensors_and_lands_nothing(feature, given, how):
    """``torch.func.functional_call`` puts its tensors in the leaves' places for one call: no outside write.

    With a feature that makes the forward a sync point (grad sync, a bf16 policy, a
    ``ShardedOptimizer``), its tensors (plain tensors, or another model's parameters of the same
    shapes) were taken as replaced parameters: their values were written into the flat buffers and
    the storage laid out again (the model's weights changed with no word), under a policy the call
    failed with torch's ``_cast_inputs() missing 1 required positional argument``, and a
    ``ShardedOptimizer`` refused it as an outside change of the layout it holds. Now the call
    computes as on the plain model (under the policy with its tensors cast to bf16), its gradients
    reach its tensors, and the model, its flat buffers and the storage are as before.
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if feature == "policy" else None
    plain, model, storage = _pair(policy, unflatten=how == "unflatten()", grad_sync=feature == "grad sync")
    if feature == "ShardedOptimizer":
        optimizer = ShardedOptimizer(storage, torch.optim.AdamW, lr=0.1)  # noqa: F841  # held while the call runs
    other = _GPTish()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    given_to = {}
    for net in ("model", "plain"):
        source = other if net == "model" else twin(other)
        given_to[net] = (
            dict(source.named_parameters())
            if given == "parameters"
            else {n: p.detach().clone().requires_grad_() for n, p in source.named_parameters()}
        )
    flats = [(flat, flat.detach().clone()) for flat in storage.flat_params]
    before = model(_tokens())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with storage.unflattened() if how == "unflattened()" else contextlib.nullcontext():
            out = torch.func.functional_call(model, given_to["model"], (_tokens(),))
    cast = {n: t.to(torch.bfloat16) if policy else t for n, t in given_to["plain"].items()}
    expected = torch.func.functional_call(plain, cast, (_tokens(),))
    assert torch.equal(out, expected)
    grads = torch.autograd.grad(out.float().pow(2).mean(), list(given_to["model"].values()))
    wanted = torch.autograd.grad(expected.float().pow(2).mean(), list(given_to["plain"].values()))
    assert all(torch.equal(g, w) for g, w in zip(grads, wanted))
    assert all(now is f and torch.equal(now, kept) for now, (f, kept) in zip(storage.flat_params, flats))
    assert get_flat_storage(model).flat_params[0] is flats[0][0]
    assert torch.equal(model(_tokens()), before)


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("feature", ["grad sync", "policy"])
@pytest.mark.parametrize("given", ["every parameter", "fc.weight"])
def test_per_sample_gradients_through_functional_call_in_per_tensor_mode_are_the_plain_ones(feature, given):
    """torch.func's recipe, ``vmap(grad(loss))`` over ``functional_call``: the plain model's gradients.

    The tensors given are cast to bf16 under the policy, the other leaves serve their compute
    views (from a node made inside ``vmap``, at the first call); the model is left as it was.
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if feature == "policy" else None
    plain, model, storage = _pair(policy, grad_sync=feature == "grad sync")

    def per_sample(net: nn.Module, cast: bool) -> dict[str, torch.Tensor]:
        named = dict(net.named_parameters())
        chosen = {n: p.detach() for n, p in named.items() if given == "every parameter" or n == given}

        def loss(tensors: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
            if cast:  # the reference: every weight cast to bf16 for the forward
                tensors = {n: tensors.get(n, p).to(torch.bfloat16) for n, p in named.items()}
            return torch.func.functional_call(net, tensors, (tokens[None],)).float().pow(2).mean()

        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(chosen, _tokens())

    kept = [flat.detach().clone() for flat in storage.flat_params]
    mine, expected = per_sample(model, cast=False), per_sample(plain, cast=policy is not None)
    assert mine.keys() == expected.keys() and all(torch.equal(mine[n], expected[n]) for n in expected)
    assert all(torch.equal(flat, k) for flat, k in zip(storage.flat_params, kept))
    assert all(p.grad is None for p in model.parameters())


class _Double(nn.Module):
    """A parametrization of one tensor without ``right_inverse``: torch keeps the same parameter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


#: torch parametrizations: two new originals, one original given other memory by ``right_inverse``
#: (torch's ``set_``), the same parameter under ``parametrizations.weight.original``.
PARAMETRIZATIONS: dict[str, Callable[[nn.Module], Any]] = {
    "weight_norm": nn.utils.parametrizations.weight_norm,
    "orthogonal": nn.utils.parametrizations.orthogonal,
    "spectral_norm": nn.utils.parametrizations.spectral_norm,  # a power iteration per training read
    "register_parametrization": lambda m: torch.nn.utils.parametrize.register_parametrization(
        m, "weight", _Double()
    ),
}


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize(
    "call", ["flat_params", "forward under grad sync", "flatten()", "remove_flat_storage"]
)
@pytest.mark.parametrize("kind", list(PARAMETRIZATIONS))
def test_a_torch_parametrization_added_in_per_tensor_mode_is_laid_out_and_trains_as_the_plain_model(
    kind: str, call: str
):
    """A leaf parametrized after registration: the next sync point lays the groups out as torch left them.

    Each of these calls put the library's class back over torch's ``ParametrizedLinear`` and dropped its
    ``parametrizations``: ``fc`` ended a ``Linear`` without ``weight``; later they refused. Now the module
    leaves the storage as torch made it: the same parameter under ``parametrizations.weight.original``
    keeps its slot, ``bias`` joins its group again, new originals are ordinary parameters; orthogonal's
    original keeps the values its ``right_inverse`` gave it.
    """
    plain, model, storage = _pair(grad_sync=call == "forward under grad sync")
    for m in (plain, model):
        torch.manual_seed(1)
        PARAMETRIZATIONS[kind](m.fc)
    if call == "flat_params":
        storage.flat_params  # noqa: B018
    elif call == "forward under grad sync":
        for m in (plain, model):  # spectral_norm's training forward moves its vectors: on both
            m(_tokens())
    elif call == "flatten()":
        storage.flatten()
    else:
        remove_flat_storage(model)
    assert type(model.fc).__name__ == "ParametrizedLinear"
    assert list(model.fc.state_dict()) == list(plain.fc.state_dict())
    if call != "remove_flat_storage":
        names = [info.name for info in storage.param_infos]
        assert "fc.bias" in names and "fc.weight" not in names
        assert ("fc.parametrizations.weight.original" in names) == (kind != "weight_norm")
        assert sum(f.numel() for f in storage.flat_params) == sum(
            p.numel() for n, p in plain.named_parameters() if "original0" not in n and "original1" not in n
        )  # no dead space
    assert torch.equal(model(_tokens()), plain(_tokens()))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    for step in range(3):
        for m, opt in zip((model, plain), optimizers):
            opt.zero_grad()
            _loss(m, _tokens(step)).backward()
            opt.step()
    assert torch.equal(model(_tokens()), plain(_tokens()))
    assert list(model.state_dict()) == list(plain.state_dict())
    if get_flat_storage(model) is not None:
        remove_flat_storage(model)
    for (name, mine), theirs in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(mine, theirs), name


def test_a_held_layout_refuses_the_change_with_the_holder_and_the_model_keeps_it(tmp_path: Path):
    """Offloaded to disk (a layout holder): a whole-buffer call raises naming it; loaded back, it lands."""
    plain, model, storage = _pair()
    storage.offload_to_disk(tmp_path)
    for m in (plain, model):
        crop_block_size(m, 8)
    with pytest.raises(
        RuntimeError,
        match=r"changed the model in per-tensor mode \(wpe\.weight was replaced by a "
        r"parameter of shape \(8, 4\) \(its slot holds \(16, 4\)\)\), but DiskOffload hold",
    ):
        storage.flat_params  # noqa: B018
    assert model.wpe.weight.shape == (8, 4) and storage.is_offloaded
    storage.load_to_memory()
    assert dict(storage.named_views())["wpe.weight"].shape == (8, 4)


def test_a_deep_copy_in_per_tensor_mode_aliases_its_own_flat_buffers():
    """The copy's leaves are views of the copy's buffers: a step on a leaf is in the copy's flat_params."""
    _, model, _ = _pair()
    other = copy.deepcopy(model)
    storage = get_flat_storage(other)
    with torch.no_grad():
        other.fc.weight.add_(1.0)
    assert torch.equal(dict(storage.views_of(storage.flat_params))["fc.weight"], other.fc.weight)
    assert not torch.equal(model.fc.weight, other.fc.weight)


def test_a_deleted_submodule_leaves_the_storage_while_a_module_below_it_lives_on():
    """`del model.block`, a module below it kept alive: the storage sees the plain model's names."""
    model = nn.Sequential(OrderedDict(block=nn.Sequential(nn.Linear(4, 4)), head=nn.Linear(4, 2)))
    storage = register_flat_storage(model)
    storage.unflatten()
    kept = model.block[0]
    del model.block
    gc.collect()
    names = set(dict(storage.named_views()))
    assert names == {name for name, _ in model.named_parameters()}
    assert names == {"head.weight", "head.bias"}
    assert kept.weight.shape == (4, 4)  # the module below lives on, outside the model


class _Head(nn.Module):
    """A body and a head without bias, as in the issue: the head's weight is given another shape."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 24)
        self.head = nn.Linear(24, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


#: ``.data`` writes of another shape: other memory (the issue's), the same memory cropped (same pointer).
SHAPE_WRITES: dict[str, Callable[[nn.Parameter], torch.Tensor]] = {
    "other memory": lambda w: torch.randn(6, 24, generator=torch.Generator().manual_seed(5)),
    "same memory cropped": lambda w: w.data[:2],
}


@pytest.mark.parametrize("over", ["parameters", "flat_params"])
@pytest.mark.parametrize("write", list(SHAPE_WRITES))
@pytest.mark.parametrize("policy", [None, "bf16"])
def test_a_leaf_given_another_shape_through_data_trains_as_the_plain_model(policy, write, over):
    """``layer.weight.data = t`` of another shape in per-tensor mode: the plain training; the features agree.

    It failed at the next step with torch's "The size of tensor a (4) must match the size of tensor b
    (6)" (the leaf kept its slot, of the old shape), under a policy with "cannot flatten: head.weight
    has shape (6, 24)". Now the next sync point (a forward under the policy, the step of an optimizer
    over ``flat_params``, any call on the storage) lays the groups out again with the leaf's new shape.
    """
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if policy else None
    plain = _Head()
    model = twin(plain)
    storage = register_flat_storage(model, mixed_precision=mixed)
    storage.unflatten()
    reference = cast_per_forward(plain) if policy else plain
    opt = torch.optim.Adam(storage.flat_params if over == "flat_params" else model.parameters(), lr=0.1)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.1)
    for m in (plain, model):
        m.head.weight.data = SHAPE_WRITES[write](m.head.weight)
    for step in range(3):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
        for forward, o in ((model, opt), (reference, plain_opt)):
            o.zero_grad()
            forward(x).float().pow(2).mean().backward()
            o.step()
    rows = plain.head.weight.shape[0]
    assert model.head.weight.shape == dict(storage.named_views())["head.weight"].shape == (rows, 24)
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    grads = dict(storage.named_grads())
    assert all(torch.equal(grads[n], p.grad) for n, p in plain.named_parameters())
    norm = torch.nn.utils.clip_grad_norm_(storage.flat_params, 1e9)
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    assert storage.flat_state_dict()["flat_param_0"].numel() == sum(p.numel() for p in plain.parameters())


@pytest.mark.parametrize("write", ["setattr", "register_parameter", "_parameters", "data"])
def test_an_optimizer_over_flat_params_steps_a_parameter_replaced_since_with_no_call_on_the_storage(write):
    """The step of an optimizer over ``flat_params`` lays the groups out again first: the new wpe trains.

    Without a feature that makes the forward a sync point, nothing called the storage between the
    crop and the step: the optimizer stepped the old layout, and the cropped wpe did not train (no
    word). The plain twin's optimizer holds the new parameter with fresh momentum, as a slot that
    changed shape gets; every other parameter keeps its momentum in both.
    """
    plain, model, storage = _pair()
    opt = torch.optim.SGD(storage.flat_params, lr=0.1, momentum=0.9)  # a new slot's momentum: zeros
    ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        if step == 2:
            for m in (plain, model):
                cropped = nn.Parameter(m.wpe.weight.detach()[:8].clone())
                if write == "setattr":
                    m.wpe.weight = cropped
                elif write == "register_parameter":
                    m.wpe.register_parameter("weight", cropped)
                elif write == "_parameters":
                    m.wpe._parameters["weight"] = cropped
                else:
                    m.wpe.weight.data = cropped.data
            old = ref.param_groups[0]["params"][1]
            ref.state.pop(old)
            ref.param_groups[0]["params"][1] = plain.wpe.weight  # the plain optimizer over the new parameter
        for m, o in ((model, opt), (plain, ref)):
            o.zero_grad()
            _loss(m, _tokens(step, 8)).backward()
            o.step()
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("write", ["setattr", "register_parameter", "_parameters", "data"])
def test_groups_laid_out_again_at_the_forward_keep_the_policys_input_and_output_casts(write):
    """A change landed by the forward's sync point: the input cast (args and kwargs) and output cast hold.

    The forward's pre-hook laid the groups out again and the feature that took over re-registered the
    input-cast hook, which torch then called without its kwargs: "_cast_inputs() missing 1 required
    positional argument: 'kwargs'" (torchao's ``quantize_`` in per-tensor mode met it too).
    """
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    plain = _Head()
    model = twin(plain)
    storage = register_flat_storage(model, mixed_precision=policy)
    storage.unflatten()
    new = torch.randn(6, 24, generator=torch.Generator().manual_seed(5))
    for m in (plain, model):
        if write == "setattr":
            m.head.weight = nn.Parameter(new.clone())
        elif write == "register_parameter":
            m.head.register_parameter("weight", nn.Parameter(new.clone()))
        elif write == "_parameters":
            m.head._parameters["weight"] = nn.Parameter(new.clone())
        else:
            m.head.weight.data = new.clone()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    out = model(x=x)  # the first sync point since the change, with the input as a keyword
    assert out.dtype == torch.float32 and torch.equal(out, cast_per_forward(plain)(x).float())
    assert dict(storage.named_views())["head.weight"].shape == (6, 24)


def _frozen_pair(policy: str | None, grad_sync: bool = False) -> tuple[_GPTish, _GPTish, Any]:
    """The model with ``fc`` frozen before registering (a group of its own) and its twin; per-tensor mode."""
    plain = _GPTish()
    plain.fc.requires_grad_(False)
    model = twin(plain)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if policy else None
    storage = register_flat_storage(model, mixed_precision=mixed)
    if grad_sync:
        storage.enable_grad_sync()
    storage.unflatten()
    return plain, model, storage


def _train_both(model: nn.Module, plain: nn.Module, policy: str | None, steps: int = 3) -> None:
    reference = cast_per_forward(plain) if policy else plain
    params = [[p for p in m.parameters() if p.requires_grad] for m in (model, plain)]
    opts = [torch.optim.SGD(ps, lr=0.1, momentum=0.9) for ps in params]
    for step in range(steps):
        for forward, opt in zip((model, reference), opts):
            opt.zero_grad()
            forward(_tokens(step)).float().pow(2).mean().backward()
            opt.step()


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("grad_sync", [False, True])
@pytest.mark.parametrize("policy", [None, "bf16"])
def test_requires_grad_set_on_leaves_in_per_tensor_mode_trains_as_the_plain_model(policy, grad_sync):
    """Each leaf's own flag counts, as on the plain model: a submodule frozen, one of a frozen group unfrozen.

    Under a policy a frozen leaf failed the backward with an ``AssertionError`` (its compute view was an
    output of the group's node) and an unfrozen leaf of a frozen group got no gradient with no word
    (its group's views were served without a graph). With grad sync, the unfrozen group's gradient
    was never reduced: its flat parameter did not require grad, so nothing hooked it.
    """
    plain, model, storage = _frozen_pair(policy, grad_sync)
    reduced: list[int] = []
    for m in (plain, model):
        m.fc.requires_grad_(True)  # the frozen group trains again
        m.wpe.requires_grad_(False)  # a submodule of the other group is frozen
    if grad_sync:
        model(_tokens())  # the sync point lays the groups out as the flags now say
        frozen_group = storage.flat_params[1]
        assert frozen_group.requires_grad
        frozen_group.register_post_accumulate_grad_hook(lambda p: reduced.append(p.grad.numel()))
    _train_both(model, plain, policy)
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert [(n, p.requires_grad) for n, p in model.named_parameters()] == [
        (n, p.requires_grad) for n, p in plain.named_parameters()
    ]
    grads = dict(storage.named_grads())
    assert grads["wpe.weight"] is None and torch.equal(grads["fc.weight"], plain.fc.weight.grad)
    assert reduced == ([plain.fc.weight.numel() + plain.fc.bias.numel()] * 3 if grad_sync else [])


@pytest.mark.parametrize("then", ["a layout change", "remove_flat_storage"])
@pytest.mark.parametrize("policy", [None, "bf16"])
def test_a_layout_change_and_removal_keep_each_leafs_requires_grad(policy, then):
    """A crop laid out again, or the storage removed, in per-tensor mode: frozen leaves stay frozen.

    Both gave every leaf its group's flag: a submodule frozen in per-tensor mode trained again with no
    word, and the leaves unfrozen in a frozen group stopped training.
    """
    plain, model, storage = _frozen_pair(policy)
    for m in (plain, model):
        m.fc.weight.requires_grad_(True)
        m.wpe.requires_grad_(False)
    if then == "a layout change":
        for m in (plain, model):
            crop_block_size(m, 8)
            m.wpe.weight.requires_grad_(False)
        assert dict(storage.named_views())["wpe.weight"].shape == (8, 4)
    else:
        remove_flat_storage(model)
    assert [(n, p.requires_grad) for n, p in model.named_parameters()] == [
        (n, p.requires_grad) for n, p in plain.named_parameters()
    ]
    _train_both(model, plain, policy if then != "remove_flat_storage" else None)
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def _write_head(m: _Head, how: str) -> None:
    """One write path of SPEC "Outside code touching the model" on the head, in the plain model's way.

    ``same``: a weight of the slot's shape; ``other`` and ``crop``: 3 rows instead of 4 (no bias).
    """
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(4 if how.endswith("same") else 3, 24, generator=g)
    if how.startswith("setattr"):
        m.head.weight = nn.Parameter(weight)
    elif how.startswith("register_parameter"):
        m.head.register_parameter("weight", nn.Parameter(weight))
    elif how.startswith("_parameters"):
        m.head._parameters["weight"] = nn.Parameter(weight)
    elif how.startswith("data"):
        m.head.weight.data = weight if how != "data crop" else m.head.weight.data[:3]
    elif how == "load_state_dict(assign=True)":
        state = {k: torch.randn(v.shape, generator=g) for k, v in m.state_dict().items()}
        m.load_state_dict(state, assign=True)
    elif how == "vector_to_parameters":
        n = sum(p.numel() for p in m.parameters())
        torch.nn.utils.vector_to_parameters(torch.randn(n, generator=g), m.parameters())
    elif how == "requires_grad_(False)":
        m.body.requires_grad_(False)


HEAD_WRITES = [
    "setattr same",
    "setattr other",
    "register_parameter other",
    "_parameters same",
    "_parameters other",
    "data same",
    "data other",
    "data crop",
    "load_state_dict(assign=True)",
    "vector_to_parameters",
    "requires_grad_(False)",
]


@pytest.mark.parametrize("how", HEAD_WRITES)
@pytest.mark.parametrize("policy", [None, "bf16"])
def test_every_write_path_in_per_tensor_mode_trains_as_the_plain_model_with_or_without_a_policy(policy, how):
    """Each write path, then training: the plain model's values; a clip over flat_params gives its norm."""
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if policy else None
    plain = _Head()
    plain.head = nn.Linear(24, 4, bias=False) if how.endswith("other") or how == "data crop" else plain.head
    model = twin(plain)
    storage = register_flat_storage(model, mixed_precision=mixed)
    storage.unflatten()
    for m in (plain, model):
        _write_head(m, how)
    reference = cast_per_forward(plain) if policy else plain
    trained = [[p for p in m.parameters() if p.requires_grad] for m in (model, plain)]
    opts = [torch.optim.SGD(params, lr=0.1, momentum=0.9) for params in trained]
    for step in range(2):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
        for forward, opt in zip((model, reference), opts):
            opt.zero_grad()
            forward(x).float().pow(2).mean().backward()
            opt.step()
    assert list(model.state_dict()) == list(plain.state_dict())
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    norm = torch.nn.utils.clip_grad_norm_(storage.flat_params, 1e9)
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    views = dict(storage.named_views())
    assert {n: v.shape for n, v in views.items()} == {n: p.shape for n, p in plain.named_parameters()}


def test_a_frozen_group_set_to_train_while_a_feature_holds_the_layout_is_refused_naming_it(tmp_path: Path):
    """Offloaded to disk: the change that lays the group out again raises naming the holder; then it lands."""
    _, model, storage = _frozen_pair(None)
    storage.offload_to_disk(tmp_path)
    model.fc.requires_grad_(True)
    with pytest.raises(
        RuntimeError,
        match=r"changed the model in per-tensor mode \(fc\.weight was set to requires_grad=True\), but "
        r"DiskOffload hold",
    ):
        storage.flat_params  # noqa: B018
    assert model.fc.weight.requires_grad  # the model keeps the change
    storage.load_to_memory()
    assert storage["1"].requires_grad and model.fc.weight.requires_grad
