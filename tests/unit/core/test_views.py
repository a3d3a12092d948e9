"""The hot path: one split per pass, and views that never go stale."""

from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flatten_parametrize import FlatParameter, get_flat_storage, register_flat_storage

from _helpers import mlp, sum_square, train_steps


def _graph_nodes(tensor: torch.Tensor) -> list[str]:
    seen, stack, names = set(), [tensor.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    return names


def test_one_split_per_group_per_pass():
    """All views of a group used in one forward come from a single split node."""
    model = mlp(depth=20)
    register_flat_storage(model)
    out = model(torch.randn(2, 5)).sum()
    nodes = _graph_nodes(out)
    assert nodes.count("_GroupSplitBackward") == 1
    assert not any(n.startswith(("AsStrided", "Slice", "View", "SplitWithSizes")) for n in nodes)


def test_two_groups_two_splits():
    """Each group is split once."""
    model = mlp(depth=6)
    register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]})
    nodes = _graph_nodes(model(torch.randn(2, 5)).sum())
    assert nodes.count("_GroupSplitBackward") == 2


class _Dispatched(TorchDispatchMode):
    """Counts the tensor ops dispatched inside it and the elements of their outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.elements += sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _backward_elements(model: nn.Module, x: torch.Tensor) -> int:
    """Elements that the second of two backward passes writes (an in-place update between them)."""
    for _ in range(2):
        loss = model(x).sum()
        with _Dispatched() as dispatched:
            loss.backward()
        with torch.no_grad():  # an optimizer-like in-place update between passes
            for p in model.parameters():
                p.mul_(1.0)
    return dispatched.elements


def test_deep_model_forward_backward_is_not_quadratic():
    """Backward through 300 flattened layers writes a small multiple of what the plain model's writes."""
    plain = nn.Sequential(*[nn.Linear(32, 32) for _ in range(300)])
    flat = copy.deepcopy(plain)
    register_flat_storage(flat)
    x = torch.randn(8, 32)
    # Per-access slicing would write one full-size gradient per parameter (about 200x the
    # plain model's backward here); one split per pass adds one copy of the flat gradient.
    assert _backward_elements(flat, x) < 3 * _backward_elements(plain, x)


def test_views_are_rebuilt_after_an_optimizer_step():
    """An in-place update between passes neither errors nor leaves stale views."""
    model = mlp(2)
    storage = register_flat_storage(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(4, 5)
    for _ in range(3):
        train_steps(model, opt, [x], sum_square)
        weight = model[0].weight
        torch.testing.assert_close(weight.detach(), storage["0"].detach()[:25].view(5, 5))


def test_views_are_rebuilt_after_a_data_swap():
    """Replacing flat.data keeps _version but the views follow the new memory."""
    model = mlp(1)
    storage = register_flat_storage(model)
    _ = model[0].weight
    storage["0"].data = torch.full_like(storage["0"], 7.0)
    assert model[0].weight.eq(7.0).all() and model[0].bias.eq(7.0).all()


def test_views_follow_module_to_dtype():
    """module.to(float64) converts the flat buffer and every view, keeping values."""
    model = mlp(1)
    storage = register_flat_storage(model)
    before = model[0].weight.detach().clone()
    model.to(torch.float64)
    assert storage["0"].dtype == torch.float64 and model[0].weight.dtype == torch.float64
    torch.testing.assert_close(model[0].weight.detach().float(), before)
    model(torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    assert storage["0"].grad.dtype == torch.float64
    model.half()
    assert model[0].bias.dtype == torch.float16


@pytest.mark.parametrize("flag", ["overwrite", "swap"])
def test_conversion_that_replaces_parameters_keeps_a_flat_parameter(flag):
    """With torch.__future__ conversion flags, .to() still leaves a FlatParameter with its layout."""
    setter = {
        "overwrite": torch.__future__.set_overwrite_module_params_on_conversion,
        "swap": torch.__future__.set_swap_module_params_on_conversion,
    }[flag]
    model = mlp(2)
    storage = register_flat_storage(model)
    names = storage["0"].metadata()[0]
    setter(True)
    try:
        model.to("cpu")  # a no-op conversion
        model.double()
    finally:
        setter(False)
    flat = dict(model.named_parameters())["flat_param_0"]
    assert type(flat) is FlatParameter and flat is storage["0"]
    assert flat.metadata()[0] == names and flat.dtype == torch.float64
    assert model[0].weight.dtype == torch.float64
    model(torch.randn(2, 5, dtype=torch.float64)).sum().backward()
    assert flat.grad is not None


def test_views_differ_per_grad_mode():
    """Views read under no_grad carry no autograd history; grad-mode views do."""
    model = mlp(1)
    register_flat_storage(model)
    with torch.no_grad():
        assert model[0].weight.grad_fn is None
        model[0].weight.add_(0.0)  # writable in place under no_grad
    assert model[0].weight.grad_fn is not None
    with torch.no_grad():
        assert model[0].weight.grad_fn is None


def test_inference_mode_then_training_works():
    """A pass under inference_mode does not poison the views used for training."""
    model = mlp(2)
    storage = register_flat_storage(model)
    x = torch.randn(3, 5)
    with torch.inference_mode():
        expected = model(x)
    out = model(x)
    torch.testing.assert_close(out.detach(), expected)
    out.sum().backward()
    assert storage["0"].grad is not None


def test_views_are_per_thread():
    """An inference thread under no_grad and a training thread both get correct views."""
    model = mlp(2)
    storage = register_flat_storage(model)
    plain = mlp(2)
    x = torch.randn(4, 5)
    errors: list[BaseException] = []

    def infer() -> None:
        try:
            for _ in range(50):
                with torch.no_grad():
                    torch.testing.assert_close(model(x), plain(x))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=infer)
    thread.start()
    for _ in range(50):
        storage["0"].grad = None
        model(x).sum().backward()
    thread.join()
    assert not errors
    plain(x).sum().backward()
    grads = dict(storage.named_grads())
    torch.testing.assert_close(grads["0.weight"], plain[0].weight.grad)


def test_functional_call_with_the_flat_parameter_name_substitutes_it():
    """functional_call(model, {'flat_param_0': t}) runs the model on t, with gradients into t."""
    model = mlp(1)
    storage = register_flat_storage(model)
    weights = torch.randn(storage["0"].numel(), requires_grad=True)
    x = torch.randn(2, 5)
    out = functional_call(model, {"flat_param_0": weights}, (x,))
    expected = torch.tanh(x @ weights[:25].view(5, 5).T + weights[25:])
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert weights.grad is not None and storage["0"].grad is None
    torch.testing.assert_close(model(x), torch.tanh(model[0](x)))


def test_vmap_over_stacked_flat_vectors():
    """vmap evaluates K weight vectors in one call, with gradients to the stack."""
    model = mlp(1)
    storage = register_flat_storage(model)
    stack = torch.randn(3, storage["0"].numel(), requires_grad=True)
    x = torch.randn(2, 5)
    out = torch.vmap(lambda w: functional_call(model, {"flat_param_0": w}, (x,)))(stack)
    for k in range(3):
        with storage.using([stack[k]]):
            torch.testing.assert_close(out[k], model(x))
    out.sum().backward()
    assert stack.grad is not None and stack.grad.shape == stack.shape


def test_assigning_the_own_view_is_a_no_op_and_anything_else_raises():
    """layer.weight = layer.weight is fine; a new tensor raises with guidance."""
    model = mlp(1)
    register_flat_storage(model)
    model[0].weight = model[0].weight
    with torch.no_grad():
        model[0].weight = model[0].weight.detach()
    with pytest.raises(RuntimeError, match=r"torch.no_grad\(\): module.weight.copy_\(value\)"):
        model[0].weight = torch.zeros(5, 5)


def test_functional_call_by_original_name_is_refused():
    """functional_call keyed by an original name raises instead of being dropped silently."""
    model = mlp(1)
    register_flat_storage(model)
    with pytest.raises(RuntimeError, match="flat_param_<group>"):
        functional_call(model, {"0.weight": torch.zeros(5, 5)}, (torch.randn(1, 5),))


def test_parametrize_api_keeps_working():
    """is_parametrized, type_before_parametrizations and cached() work on flattened modules."""
    model = mlp(1)
    register_flat_storage(model)
    assert parametrize.is_parametrized(model[0], "weight")
    assert parametrize.type_before_parametrizations(model[0]) is nn.Linear
    with parametrize.cached():
        out = model(torch.randn(2, 5))
    out.sum().backward()
    assert isinstance(model[0].parametrizations["weight"][0], nn.Module)
    torch.testing.assert_close(model[0].parametrizations["weight"](), model[0].weight)


def _python_calls_per_read(module: nn.Module, reads: int = 100) -> float:
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        for _ in range(reads):
            _ = module.weight
    finally:
        sys.setprofile(None)
    return calls / reads


def test_attribute_access_cost_is_bounded():
    """A cached attribute read builds no view, dispatches no op and runs a few Python frames."""
    layer = nn.Linear(3, 3)
    plain = nn.Linear(3, 3)
    register_flat_storage(layer)
    first = layer.weight
    with _Dispatched() as dispatched:
        views = {id(layer.weight) for _ in range(100)}
    assert dispatched.ops == 0
    assert views == {id(first)}
    # parametrize's own property runs 17 frames per read (identity parametrization); a plain read one.
    assert _python_calls_per_read(layer) <= _python_calls_per_read(plain) + 5


def test_deepcopy_after_use_does_not_copy_cached_views():
    """A model whose views are cached can be deep-copied (cached non-leaf views are not copied)."""
    model = mlp(2)
    register_flat_storage(model)
    model(torch.randn(2, 5)).sum().backward()
    clone = copy.deepcopy(model)
    storage = get_flat_storage(clone)
    assert storage is not None
    clone(torch.randn(2, 5)).sum().backward()
    assert storage["0"].grad is None or storage["0"].grad.shape == storage["0"].shape


def test_freezing_the_flat_parameter_reaches_cached_views():
    """requires_grad_(False) on a flat parameter stops views (and outputs) from requiring grad."""
    layer = nn.Linear(4, 2)
    storage = register_flat_storage(layer)
    x = torch.randn(3, 4)
    layer(x).sum().backward()
    storage["0"].requires_grad_(False)
    assert not layer.weight.requires_grad and not layer(x).requires_grad
    storage["0"].requires_grad_(True)
    assert layer(x).requires_grad


@pytest.mark.parametrize("how", ["attribute", "module.requires_grad_"])
@pytest.mark.parametrize("mode", ["grad", "no_grad"])
def test_setting_requires_grad_reaches_views_cached_in_every_mode(how, mode):
    """`flat.requires_grad = False` and `module.requires_grad_(False)` reach views cached in both modes.

    A cached read does not compare the flag (the flat parameter reports it being set): the views
    served after it follow it in both modes, and the frozen model's output requires no grad.
    """
    layer = nn.Linear(4, 2)
    storage = register_flat_storage(layer)
    x = torch.randn(3, 4)
    context = torch.enable_grad if mode == "grad" else torch.no_grad

    def freeze(flag: bool) -> None:
        if how == "attribute":
            storage["0"].requires_grad = flag
        else:
            layer.requires_grad_(flag)

    with context():
        assert layer.weight.requires_grad and layer.weight is layer.weight  # cached
        freeze(False)
        assert not layer.weight.requires_grad and not layer.bias.requires_grad
        assert not layer(x).requires_grad
        freeze(True)
        assert layer.weight.requires_grad and layer.weight is layer.weight
        assert layer(x).requires_grad is (mode == "grad")
    layer(x).sum().backward()
    assert storage["0"].grad is not None


def test_gradients_with_padding_and_unused_parameters_match_plain():
    """With align padding and a layer the forward skips, used slots get the plain gradient, others zeros."""
    plain = nn.ModuleDict({"used": nn.Linear(3, 3), "unused": nn.Linear(3, 2)})
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model, align=8)
    x = torch.randn(4, 3)
    model["used"](x).pow(2).sum().backward()
    plain["used"](x).pow(2).sum().backward()
    grads = dict(storage.named_grads())
    torch.testing.assert_close(grads["used.weight"], plain["used"].weight.grad)
    torch.testing.assert_close(grads["used.bias"], plain["used"].bias.grad)
    assert grads["unused.weight"].eq(0).all()
    flat_grad = storage["0"].grad
    covered = torch.zeros(flat_grad.numel(), dtype=torch.bool)
    for info in storage.param_infos:
        covered[info.offset : info.offset + info.numel] = True
    assert flat_grad[~covered].eq(0).all()


def test_double_backward_through_views_matches_plain():
    """A gradient penalty (create_graph=True) differentiates through the flat views like plain."""
    plain = mlp(2)
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)
    x = torch.randn(4, 5, requires_grad=True)
    for m in (model, plain):
        (gx,) = torch.autograd.grad(m(x).pow(2).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
    for name, grad in storage.named_grads():
        torch.testing.assert_close(grad, plain.get_parameter(name).grad, msg=name)


def test_cpu_flat_gradient_memory_is_reused_when_free():
    """After zero_grad(set_to_none=True) backward reuses the memory; a gradient still held is not reused."""
    model = mlp(2)
    storage = register_flat_storage(model)
    x = torch.randn(3, 5)
    model(x).sum().backward()
    first = storage["0"].grad
    first_ptr, first_values = first.data_ptr(), first.clone()
    del first
    storage["0"].grad = None
    model(x).sum().backward()
    assert storage["0"].grad.data_ptr() == first_ptr
    torch.testing.assert_close(storage["0"].grad, first_values)
    kept = storage["0"].grad
    storage["0"].grad = None
    model(2 * x).sum().backward()
    assert storage["0"].grad.data_ptr() != kept.data_ptr()
    torch.testing.assert_close(kept, first_values)


def test_reused_gradient_memory_gets_every_gradient_zeros_and_zero_padding():
    """Backward into reused memory writes each view's gradient, zeros for unused slots, zero padding."""

    class PartlyUsed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(5, 3)
            self.unused = nn.Linear(3, 3)
            self.b = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    model = PartlyUsed()
    plain = copy.deepcopy(model)
    storage = register_flat_storage(model, align=4)
    padding = torch.ones(storage["0"].numel(), dtype=torch.bool)
    for info in storage.param_infos:
        padding[info.offset : info.offset + info.numel] = False
    assert padding.any()
    pointers = set()
    for _ in range(4):
        x = torch.randn(4, 5)
        storage["0"].grad = None
        plain.zero_grad(set_to_none=True)
        model(x).pow(2).sum().backward()
        plain(x).pow(2).sum().backward()
        grad = storage["0"].grad
        pointers.add(grad.data_ptr())
        for name, view in storage.named_grads():
            expected = dict(plain.named_parameters())[name].grad
            torch.testing.assert_close(view, torch.zeros_like(view) if expected is None else expected)
        assert grad[padding].eq(0).all()
        grad.fill_(7.0)  # garbage everywhere, padding included, before the memory is reused
        del grad
    assert len(pointers) <= 2  # the memory is reused across steps


def test_hessian_vector_product_through_the_flat_parameter_matches_plain():
    """create_graph=True through the group node (second derivatives w.r.t. the flat weights) works."""
    from torch.nn.utils import parameters_to_vector

    plain = mlp(2)
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)
    x = torch.randn(4, 5)
    vector = torch.randn(storage["0"].numel())
    (grad,) = torch.autograd.grad(model(x).pow(2).sum(), storage["0"], create_graph=True)
    (hvp,) = torch.autograd.grad((grad * vector).sum(), storage["0"])
    params = list(plain.parameters())
    plain_grads = torch.autograd.grad(plain(x).pow(2).sum(), params, create_graph=True)
    plain_hvp = torch.autograd.grad((parameters_to_vector(plain_grads) * vector).sum(), params)
    torch.testing.assert_close(grad.detach(), parameters_to_vector(plain_grads).detach())
    torch.testing.assert_close(hvp, parameters_to_vector(plain_hvp))


# ------------------------------------------- views without grad across in-place updates


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_views_without_grad_are_kept_across_in_place_updates_and_follow_them(mode):
    """Under no_grad and inference_mode an in-place update of the buffer rebuilds nothing; values follow."""
    model = mlp(2)
    plain = copy.deepcopy(model)
    storage = register_flat_storage(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    x = torch.randn(4, 5)
    with context():
        before = model[0].weight
    for module, optimizer in ((model, opt), (plain, plain_opt)):
        module(x).pow(2).sum().backward()
        optimizer.step()  # in place, in grad mode
    with torch.no_grad():
        storage["0"].add_(0.25)  # in place, without grad
        for p in plain.parameters():
            p.add_(0.25)
    with context():
        after = model[0].weight
        assert after is before  # served from the cache: no split, no view rebuilt
        assert after.grad_fn is None and after.requires_grad  # as the plain parameter
        torch.testing.assert_close(after, plain[0].weight)
        torch.testing.assert_close(model(x), plain(x))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_views_without_grad_run_the_plain_models_kernels(mode):
    """Under no_grad a view requires grad as the plain parameter does, so torch picks the same kernels.

    torch's ``matmul`` folds a transposed batch (``MultiheadAttention(batch_first=True)`` in train
    mode) into one ``mm`` only when the weight requires grad; otherwise it copies the weight out
    per batch row (``bmm`` over an expanded weight: 4x slower on a bfloat16 encoder).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    plain = nn.MultiheadAttention(16, 2, batch_first=True)
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)
    x = torch.randn(3, 5, 16)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    seen = []
    for m in (plain, model):
        with context():
            m(x, x, x)
            with Ops() as ops:
                out = m(x, x, x)[0]
        seen.append((ops.ops, out))
    assert seen[1][0] == seen[0][0]
    assert torch.equal(seen[1][1], seen[0][1])
    with context():
        assert model.in_proj_weight.requires_grad
    storage["0"].requires_grad_(False)  # frozen: the views follow, as frozen parameters do
    with context():
        assert not model.in_proj_weight.requires_grad


def test_grad_mode_views_are_kept_across_in_place_updates_and_train_like_plain():
    """Optimizer steps rebuild no view in grad mode; losses and gradients equal the plain model's."""
    model = mlp(2)
    plain = copy.deepcopy(model)
    storage = register_flat_storage(model)
    before = model[0].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 5)
    for _ in range(3):
        train_steps(model, opt, [x], sum_square)
        train_steps(plain, plain_opt, [x], sum_square)
        assert torch.equal(model(x), plain(x).detach()) or torch.allclose(model(x), plain(x), atol=1e-6)
        torch.testing.assert_close(dict(storage.named_grads())["0.weight"], plain[0].weight.grad)
    assert model[0].weight is before  # the same view, following the updated buffer
    torch.testing.assert_close(before.detach(), plain[0].weight.detach())


def test_in_place_on_a_grad_mode_view_lands_in_the_buffer_with_its_gradient():
    """An in-place change of a served view in grad mode writes the buffer; later passes train like plain."""
    model = mlp(1)
    plain = copy.deepcopy(model)
    storage = register_flat_storage(model)
    weight = model[0].weight
    weight.mul_(2.0)  # plain refuses this on a leaf; here it is recorded like on any non-leaf
    with torch.no_grad():
        plain[0].weight.mul_(2.0)
    torch.testing.assert_close(storage["0"].detach()[:25].view(5, 5), plain[0].weight.detach())
    assert model[0].weight is not weight  # its history grew: the next access serves a fresh view
    x = torch.randn(3, 5)
    model(x).pow(2).sum().backward()
    plain(x).pow(2).sum().backward()
    for name, grad in storage.named_grads():
        torch.testing.assert_close(grad, dict(plain.named_parameters())[name].grad)


def test_an_optimizer_step_between_forward_and_backward_raises_as_for_the_plain_model():
    """Autograd's saved-tensor version check fires on the flattened model where it fires on the plain one."""
    model = mlp(2)
    plain = copy.deepcopy(model)
    register_flat_storage(model)
    x = torch.randn(4, 5)
    for module in (plain, model):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        with torch.no_grad():  # warm the no_grad cache: it must not hide the update from autograd
            module(x)
        loss = module(x).pow(2).sum()
        module(x).pow(2).sum().backward()
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_views_without_grad_are_rebuilt_when_the_buffer_is_replaced():
    """A .data swap, a conversion or a new flat tensor still rebuilds the cached no_grad views."""
    model = mlp(1)
    storage = register_flat_storage(model)
    with torch.no_grad():
        before = model[0].weight
        storage["0"].data = torch.full_like(storage["0"], 3.0)
        assert model[0].weight is not before and model[0].weight.eq(3.0).all()
        model.double()
        assert model[0].weight.dtype == torch.float64
        with storage.using([torch.zeros(30, dtype=torch.float64)]):
            assert model[0].weight.eq(0.0).all()
        assert model[0].weight.eq(3.0).all()
