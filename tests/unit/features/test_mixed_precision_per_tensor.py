"""Mixed precision in per-tensor mode: float32 leaves are the masters, each forward computes in bf16.

The reference needs no library (``_helpers.cast_per_forward``): a plain model whose float32 weights are
cast to bf16 for each forward (``torch.func.functional_call``), whose bf16 gradients are accumulated into
its float32 parameters. Per-tensor mode gives it bit for bit, however the mode is entered.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from _mixed_precision_cases import Block, CountCasts
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.checkpoint import checkpoint

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage
from flatten_parametrize._core.grad.leaf_slots import LeafGrads

from _helpers import cast_per_forward, twin

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


class _ReadsAWeight(Block):
    """A head computed from the embedding's weight outside the embedding's forward (GPT-2's ``x @ wte.T``)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return (h + self.down(self.up(self.norm(h)))) @ self.embed.weight.T


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _batches(n: int, vocab: int = 13) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randint(0, vocab, (4, 5)) for _ in range(n)]


def _per_tensor(plain: nn.Module, how: str = "unflatten") -> tuple[nn.Module, object]:
    """A flattened twin of ``plain`` with a bf16 policy in per-tensor mode ``how`` (``"flat"``: left flat)."""
    model = twin(plain)
    storage = register_flat_storage(model, mixed_precision=BF16)
    if how == "unflatten":
        storage.unflatten()
    elif how == "deepcopy":
        storage.unflatten()
        model = copy.deepcopy(model)
        storage = get_flat_storage(model)
    elif how == "pickle":
        storage.unflatten()
        model = pickle.loads(pickle.dumps(model))
        storage = get_flat_storage(model)
    return model, storage


# ------------------------------------------------------------------------------ semantics


@pytest.mark.parametrize("how", ["unflatten", "deepcopy", "pickle"])
@pytest.mark.parametrize("arch", [Block, _ReadsAWeight])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("over", ["leaves", "flat_params"])
def test_training_in_per_tensor_mode_matches_the_cast_per_forward_reference_bit_for_bit(
    how, arch, fused, over
):
    """Outputs, every leaf's gradient, the flat gradient and the stepped masters equal the reference's.

    The optimizer steps the leaves, or the flat parameters (one tensor per group, as in flat mode: the
    docs' recipe for an element-wise optimizer in per-tensor mode).
    """
    plain = arch()
    model, storage = _per_tensor(plain, how)
    reference = cast_per_forward(plain)
    params = model.parameters() if over == "leaves" else storage.flat_params
    opt = torch.optim.AdamW(params, lr=1e-2, fused=fused)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=fused)
    for batch in _batches(3):
        assert model.up.weight.dtype == torch.float32 and type(model.up) is nn.Linear
        out, expected = model(batch), reference(batch)
        assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
        _loss(out).backward()
        _loss(expected).backward()
        for name, param in model.named_parameters():
            assert param.grad.dtype == torch.float32
            assert torch.equal(param.grad, plain.get_parameter(name).grad), name
        for name, grad in storage.named_grads():  # the leaves' gradients are the flat gradient's slots
            assert torch.equal(grad, plain.get_parameter(name).grad), name
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, value in model.state_dict().items():
        assert torch.equal(value, plain.state_dict()[name]), name


def test_a_forward_in_per_tensor_mode_casts_once_per_group_after_a_change_and_never_when_clean():
    """No cast per forward while the leaves are unchanged; one per group after a step, any micro-batches."""
    model = Block()
    storage = register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]}, mixed_precision=BF16)
    storage.unflatten()
    sizes = {f.numel() for f in storage.flat_params} | {i.numel for i in storage.param_infos}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = _batches(4)
    _loss(model(batches[0])).backward()
    with CountCasts(sizes) as counter:
        for batch in batches:
            _loss(model(batch)).backward()
        with torch.no_grad():
            model(batches[0])
        with torch.inference_mode():
            model(batches[0])
    assert counter.casts == 0
    for _ in range(2):
        with CountCasts(sizes) as counter:
            opt.step()
            opt.zero_grad()
            for batch in batches:
                _loss(model(batch)).backward()
        assert counter.casts == 2


@pytest.mark.parametrize("write", ["in_place", "data", "fused_step", "init", "ema_swap", "load_state_dict"])
def test_every_write_to_a_leaf_reaches_the_next_forward(write):
    """In-place, ``.data`` (EMA, hand-written steps), init, fused steps, loads: the next forward casts."""
    plain = Block()
    model, _ = _per_tensor(plain)
    batch = _batches(1)[0]
    model(batch)  # a compute copy cast before the write
    for m in (model, plain):
        torch.manual_seed(5)
        if write == "in_place":
            with torch.no_grad():
                m.up.weight.mul_(3)
        elif write == "data":
            m.up.weight.data.mul_(3)
        elif write == "fused_step":
            m.up.weight.grad = torch.ones_like(m.up.weight)
            torch.optim.AdamW([m.up.weight], lr=0.5, fused=True).step()
        elif write == "init":
            nn.init.normal_(m.down.weight)
        elif write == "ema_swap":  # timm's ModelEmaV3 and torch's AveragedModel copy through .data/detach()
            for p in m.parameters():
                p.data.copy_(p.data * 0.5)
        elif write == "load_state_dict":
            m.load_state_dict({k: v + 1 for k, v in m.state_dict().items()})
    assert torch.equal(model(batch), cast_per_forward(plain)(batch))


def test_per_tensor_views_from_a_direct_call_and_activation_checkpointing():
    """A submodule called alone computes in bf16; checkpointing recomputes it so: the same gradients."""
    plain = Block()
    model, storage = _per_tensor(plain)
    batch = _batches(1)[0]
    assert model.embed(batch).dtype == torch.bfloat16
    assert model.up.weight.dtype == torch.float32  # back after the call
    for use_reentrant in (False, True):
        h = model.embed(batch)
        _loss(
            model.head(
                checkpoint(lambda t: t + model.down(model.up(model.norm(t))), h, use_reentrant=use_reentrant)
            )
        ).backward()
        ckpt = storage.flat_params[0].grad.clone()
        model.zero_grad()
        h = model.embed(batch)
        _loss(model.head(h + model.down(model.up(model.norm(h))))).backward()
        assert torch.equal(storage.flat_params[0].grad, ckpt)
        model.zero_grad()


# ------------------------------------------------------------------ where gradients land


class _CountUpcasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the float32 tensors that backward writes a leaf-sized gradient into, by how.

    ``adds``: float32 gradients added to float32 ones (autograd accumulating a converted gradient).
    """

    def __init__(self, sizes: set[int]) -> None:
        super().__init__()
        self.sizes, self.new, self.copies, self.adds = sizes, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.float32:
            self.new += args[0].numel() in self.sizes
        if func is torch.ops.aten.copy_.default and args[0].dtype == args[1].dtype == torch.float32:
            self.copies += args[0].numel() in self.sizes
        if func is torch.ops.aten.add_.Tensor and args[0].dtype == args[1].dtype == torch.float32:
            self.adds += args[0].numel() in self.sizes
        return func(*args, **kwargs)


def test_backward_converts_each_gradient_straight_into_its_slot():
    """no float32 gradient per leaf, no copy into a slot; each ``.grad`` is its slot."""
    plain = Block()
    model, storage = _per_tensor(plain)
    reference = cast_per_forward(plain)
    sizes = {info.numel for info in storage.param_infos}
    for batch in _batches(2):
        model.zero_grad()
        plain.zero_grad()
        with _CountUpcasts(sizes) as counter:
            _loss(model(batch)).backward()
        assert (counter.new, counter.copies) == (0, 0)
        _loss(reference(batch)).backward()
        flat_grad = storage.flat_params[0].grad
        for name, param in model.named_parameters():
            assert torch.equal(param.grad, plain.get_parameter(name).grad), name
            assert flat_grad.data_ptr() <= param.grad.data_ptr() < flat_grad.data_ptr() + flat_grad.nbytes


@pytest.mark.parametrize("hooked", [False, True], ids=["unwatched", "a leaf hooked"])
def test_later_micro_batches_add_into_the_slots_as_the_reference_accumulates(hooked):
    """No float32 buffer per micro-batch: each adds into the slots; a hooked leaf sees every gradient."""
    plain = Block()
    model, storage = _per_tensor(plain)
    reference = cast_per_forward(plain)
    sizes = {info.numel for info in storage.param_infos}
    seen: list[torch.Tensor] = []
    expected_seen: list[torch.Tensor] = []
    if hooked:  # a hook of the user's watches the accumulation: that leaf takes autograd's path
        model.up.weight.register_hook(lambda g: seen.append(g.clone()))
        plain.up.weight.register_hook(lambda g: expected_seen.append(g.clone()))
    for step, batches in enumerate((_batches(3), _batches(5)[3:])):
        model.zero_grad(set_to_none=step == 0)
        plain.zero_grad(set_to_none=step == 0)
        for batch in batches:
            accumulating = model.up.weight.grad is not None  # a gradient to add to
            with _CountUpcasts(sizes) as counter:
                _loss(model(batch)).backward()
            _loss(reference(batch)).backward()
            assert counter.new == 0 and counter.adds == (hooked and accumulating)
            flat_grad = storage.flat_params[0].grad
            for name, param in model.named_parameters():
                assert torch.equal(param.grad, plain.get_parameter(name).grad), name
                assert (
                    param.grad.data_ptr() - flat_grad.data_ptr()
                    == 4 * storage.param_infos[[info.name for info in storage.param_infos].index(name)].offset
                ), name
    assert len(seen) == len(expected_seen) == 5 * hooked
    assert all(torch.equal(a, b) for a, b in zip(seen, expected_seen))


def test_autograd_grad_returns_gradients_of_their_own_and_leaves_the_slots_alone():
    """``torch.autograd.grad`` over the leaves: the reference's values, in tensors no backward touches."""
    plain = Block()
    model, storage = _per_tensor(plain)
    reference = cast_per_forward(plain)
    batch = _batches(1)[0]
    grads = torch.autograd.grad(_loss(model(batch)), list(model.parameters()))
    expected = torch.autograd.grad(_loss(reference(batch)), list(plain.parameters()))
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))
    assert all(p.grad is None for p in model.parameters()) and storage.flat_params[0].grad is None
    kept = [g.clone() for g in grads]
    _loss(model(_batches(2)[1])).backward()
    assert all(torch.equal(g, k) for g, k in zip(grads, kept))


@pytest.mark.parametrize("mode", ["per-tensor", "flat"])
@pytest.mark.parametrize("how", ["autograd.grad", "backward"])
def test_a_gradient_penalty_under_the_policy_differentiates_the_gradients_as_the_reference(mode, how):
    """``create_graph=True``: the gradients keep their graph through the cast, the penalty trains.

    A penalty on the parameters' gradients (``sum(g**2)``, added to the loss) backpropagates
    through them: a gradient without a graph would drop the penalty's part of the update with no
    word. Each gradient, and each parameter's gradient after the penalty's backward, equals the
    reference's bit for bit.
    """
    plain = _ReadsAWeight()
    model, storage = _per_tensor(plain, "unflatten" if mode == "per-tensor" else "flat")
    reference = cast_per_forward(plain)
    batch = _batches(1)[0]
    found = []
    for net, forward in ((model, model), (plain, reference)):
        loss = _loss(forward(batch))
        params = list(net.parameters())
        if how == "autograd.grad":
            grads = torch.autograd.grad(loss, params, create_graph=True)
            total = loss + sum(g.pow(2).sum() for g in grads)
        else:
            loss.backward(create_graph=True)
            grads = tuple(p.grad for p in params)
            total = sum(g.pow(2).sum() for g in grads)
            net.zero_grad()
        assert all(g.requires_grad for g in grads)
        found.append(grads)
        total.backward()
    if mode == "per-tensor":  # one gradient per leaf, as on the plain model
        assert all(torch.equal(g, e) for g, e in zip(*found))
    for name, grad in storage.named_grads():
        assert torch.equal(grad, plain.get_parameter(name).grad), name


@pytest.mark.parametrize("mode", ["per-tensor", "flat"])
def test_two_forwards_before_one_backward_add_their_gradients_in_param_dtype(mode):
    """One compute copy serves both forwards: their gradients add up in bf16, then convert once.

    The reference casts the float32 weights once for both forwards (the docs' statement); a cast
    per forward would add the two in float32.
    """
    plain = Block()
    model, storage = _per_tensor(plain, "unflatten" if mode == "per-tensor" else "flat")
    weights = {name: p.to(torch.bfloat16) for name, p in plain.named_parameters()}
    first, second = _batches(2)
    (_loss(model(first)) + _loss(model(second))).backward()
    once = [_loss(torch.func.functional_call(plain, weights, (b,))) for b in (first, second)]
    (once[0] + once[1]).backward()
    for name, grad in storage.named_grads():
        assert torch.equal(grad, plain.get_parameter(name).grad), name


def _weight_read_before_forward(model: nn.Module, hook) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """A term on ``up.weight`` made before the forward: backward reaches it after ``up``'s slot is filled."""
    term = (model.up.weight * 1.0).sum()
    term.register_hook(hook)
    return term


def test_a_flat_gradient_read_during_backward_keeps_what_backward_put_in_the_slots():
    """A hook reading ``flat_param.grad`` while a slot holds a gradient not accumulated changes nothing."""
    plain = Block()
    model, storage = _per_tensor(plain)
    reference = cast_per_forward(plain)
    batch = _batches(1)[0]
    reads = []
    extra = _weight_read_before_forward(model, lambda g: reads.append(storage.flat_params[0].grad))
    ref_extra = (plain.up.weight * 1.0).sum()
    (_loss(model(batch)) + extra).backward()
    (_loss(reference(batch)) + ref_extra).backward()
    assert reads  # the hook ran mid-backward
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, plain.get_parameter(name).grad), name


def test_a_backward_that_raises_leaves_no_gradient_in_the_slots_it_filled():
    """After a backward raised halfway, the slots it filled read zero where the next gives no gradient."""
    plain = Block()
    model, storage = _per_tensor(plain)
    batch = _batches(1)[0]

    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("stop here")

    extra = _weight_read_before_forward(model, fail)
    with pytest.raises(RuntimeError, match="stop here"):
        (_loss(model(batch)) + extra).backward()
    del extra
    assert model.up.weight.grad is None
    model.zero_grad()  # the plain model too keeps what that backward accumulated before it raised
    _loss(model.embed(batch)).backward()  # a direct call: only the embedding gets a gradient
    _loss(nn.functional.embedding(batch, plain.embed.weight.to(torch.bfloat16))).backward()
    grads = dict(storage.named_grads())
    assert torch.equal(grads["embed.weight"], plain.embed.weight.grad)
    assert model.up.weight.grad is None and grads["up.weight"] is None
    assert not storage.views_of([storage.flat_params[0].grad])["up.weight"].any()  # the plain model's zeros


def _hooks_of(model: nn.Module) -> list[list[object]]:
    return [list((p._post_accumulate_grad_hooks or {}).values()) for p in model.parameters()]


def test_no_library_hook_on_the_leaves_while_nothing_waits_for_the_flat_gradient(monkeypatch):
    """No hook on the flat parameter: the leaves carry none of the library's hooks (a user's leaf hook runs
    once per backward, with the reference's gradient), the gradients are the reference's, and a user's hook
    that raises leaves the hooks as they were."""
    plain = Block()
    model, storage = _per_tensor(plain)
    reference = cast_per_forward(plain)
    landed: list[int] = []
    monkeypatch.setattr(LeafGrads, "landed", lambda self, task: landed.append(task))
    seen: list[torch.Tensor] = []
    model.up.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    hooks = _hooks_of(model)
    assert len(model.up.weight._post_accumulate_grad_hooks) == 1  # the user's only
    batch = _batches(1)[0]
    _loss(model(batch)).backward()
    _loss(reference(batch)).backward()
    assert landed == [] and len(seen) == 1 and torch.equal(seen[0], plain.up.weight.grad)
    assert _hooks_of(model) == hooks
    for name, grad in storage.named_grads():
        assert torch.equal(grad, plain.get_parameter(name).grad), name

    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("stop here")

    failing = model.up.weight.register_post_accumulate_grad_hook(fail)  # raises after the gradients landed
    with pytest.raises(RuntimeError, match="stop here"):
        _loss(model(batch)).backward()
    failing.remove()
    assert _hooks_of(model) == hooks and landed == []


def test_a_hook_put_on_the_flat_parameter_after_the_forward_runs_in_that_backward():
    """The leaves' hooks stay for a backward that something waits for, even one hooked after the forward."""
    plain = Block()
    model, storage = _per_tensor(plain)
    reference = cast_per_forward(plain)
    batch = _batches(1)[0]
    out = model(batch)
    flat = storage.flat_params[0]
    got: list[torch.Tensor] = []
    flat.register_post_accumulate_grad_hook(lambda p: got.append(p.grad.clone()))
    _loss(out).backward()
    _loss(reference(batch)).backward()
    assert len(got) == 1
    expected = storage.views_of([got[0]])
    for name, param in plain.named_parameters():
        assert torch.equal(expected[name], param.grad), name


def test_a_forward_that_raises_puts_the_leaves_back():
    """An exception inside the forward: every module holds its float32 leaf again, nothing half-swapped."""
    model, _ = _per_tensor(Block())
    leaves = {n: p for n, p in model.named_parameters()}
    with pytest.raises(IndexError):
        model(torch.tensor([[99]]))
    assert {n: p for n, p in model.named_parameters()} == leaves
    assert all(p.dtype == torch.float32 and p.is_leaf for p in model.parameters())


def _leaf_cast_nodes(out: torch.Tensor) -> int:
    """Count the ``_LeafCastBackward`` nodes of ``out``'s graph."""
    seen, todo, count = set(), [out.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == "_LeafCastBackward"
        todo.extend(next_node for next_node, _ in node.next_functions)
    return count


def test_one_cast_node_per_group_in_one_process_and_one_per_module_where_a_process_group_exists(world1):
    """DDP reduces a module's gradients as soon as its backward is done; one process needs one node."""
    plain = Block()
    dist = torch.distributed
    dist.destroy_process_group()  # first: one process
    model, _ = _per_tensor(plain)
    reference = cast_per_forward(plain)
    batch = _batches(1)[0]
    out = _loss(model(batch))
    assert _leaf_cast_nodes(out) == 1
    out.backward()
    _loss(reference(batch)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(torch.equal(g, plain.get_parameter(n).grad) for n, g in grads.items())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the fixture ends it
    model.zero_grad()
    out = _loss(model(batch))
    assert _leaf_cast_nodes(out) == 4  # embed, norm, up, down (head's weight is embed's)
    out.backward()
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())


def test_owners_hooks_are_out_only_inside_the_forward_and_come_back_in_their_place():
    """Inside the forward the owners have no hooks (the fast call path); after it, a hook registered on an
    owner meanwhile runs after the library's (it sees the bf16 weight) and its handle removes it."""
    model, _ = _per_tensor(Block())
    seen: dict[str, object] = {}

    def user_hook(module: nn.Module, args: object) -> None:
        seen["dtype"] = module.weight.dtype

    def inside(module: nn.Module, args: object) -> None:
        seen["hooks"] = len(model.up._forward_pre_hooks) + len(model.up._forward_hooks)
        seen["handle"] = model.up.register_forward_pre_hook(user_hook)

    registering = model.register_forward_pre_hook(inside)
    model(_batches(1)[0])
    registering.remove()
    assert seen["hooks"] == 0
    assert seen.pop("dtype") == torch.bfloat16  # up ran after the hook was registered, as on a plain model
    model.up(torch.randn(2, 8, dtype=torch.bfloat16))
    assert seen["dtype"] == torch.bfloat16
    assert model.up.weight.dtype == torch.float32
    seen["handle"].remove()  # type: ignore[attr-defined]
    assert len(model.up._forward_pre_hooks) == 1  # the library's only
    model(_batches(1)[0])
    assert len(model.up._forward_pre_hooks) == len(model.up._forward_hooks) == 1
    with pytest.raises(IndexError):
        model(torch.tensor([[99]]))
    assert len(model.up._forward_pre_hooks) == len(model.up._forward_hooks) == 1


def test_compile_in_per_tensor_mode_is_one_graph_with_eager_results():
    """torch.compile of the per-tensor model: one graph, no break; outputs and gradients equal eager."""
    torch._dynamo.reset()
    for make in (
        Block,
        lambda: nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4)),
    ):
        torch.manual_seed(0)
        eager_model = make()
        eager, _ = _per_tensor(eager_model)
        model, _ = _per_tensor(eager_model)
        x = _batches(1)[0] if isinstance(eager_model, Block) else torch.randn(5, 8)
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_count == 1 and explained.graph_break_count == 0
        compiled = torch.compile(model, backend="aot_eager")
        out, expected = compiled(x), eager(x)
        assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
        _loss(out).backward()
        _loss(expected).backward()
        for a, b in zip(model.parameters(), eager.parameters()):
            assert torch.equal(a.grad, b.grad)
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        torch.optim.SGD(eager.parameters(), lr=0.1).step()
        assert torch.equal(compiled(x), eager(x))
        torch._dynamo.reset()


def test_modes_switch_with_the_policy_kept_and_removal_leaves_plain_float32_parameters():
    """flatten()/unflatten() in the middle of training: one run; the leaves regain torch's own class."""
    plain = Block()
    model, storage = _per_tensor(plain)
    reference = cast_per_forward(plain)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step, batch in enumerate(_batches(4)):
        if step == 2:
            storage.flatten()
        if step == 3:
            storage.unflatten()
        out = model(batch)
        assert torch.equal(out, reference(batch))
        _loss(out).backward()
        _loss(reference(batch)).backward()
        if step != 2:  # in flat mode an optimizer of the leaves refuses to step (it would step nothing)
            opt.step()
            ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        model.zero_grad()
    remove_flat_storage(model)
    assert {type(p) for p in model.parameters()} == {nn.Parameter}
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert model(_batches(1)[0]).dtype == torch.float32


def test_torch_save_of_a_per_tensor_model_keeps_the_policy_and_the_mode():
    """torch.save / load: per-tensor mode again, leaves float32 masters, forward bf16 as before."""
    model, _ = _per_tensor(Block())
    batch = _batches(1)[0]
    expected = model(batch)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    storage = get_flat_storage(loaded)
    assert not storage.is_flattened and storage.mixed_precision == {"0": BF16}
    assert loaded.up.weight.dtype == torch.float32 and torch.equal(loaded(batch), expected)
