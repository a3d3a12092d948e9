"""Per-tensor mode (``_core/grad/leaf_slots.py``): unflattened leaves keep their gradients in the flat one.

Each case trains a flattened model inside a persistent ``storage.unflatten()``
against a plain twin from the same seed.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from flatten_parametrize import register_flat_storage

from _helpers import TiedLM, mlp, twin


def _pair(model: nn.Module | None = None) -> tuple[nn.Module, nn.Module, object]:
    plain = model if model is not None else mlp(3, 6)
    flat = twin(plain)
    storage = register_flat_storage(flat)
    storage.unflatten()
    return plain, flat, storage


def _in_flat_grad(param: torch.Tensor, flat_grad: torch.Tensor) -> bool:
    """Whether ``param.grad`` is a view into ``flat_grad``'s memory."""
    start = flat_grad.data_ptr()
    end = start + flat_grad.numel() * flat_grad.element_size()
    return param.grad is not None and start <= param.grad.data_ptr() < end


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    return model(x).pow(2).mean()


def test_leaf_gradients_are_views_of_one_flat_gradient_per_group():
    """After a per-tensor backward each leaf's `.grad` is its slot of `flat_param.grad`, plain values."""
    plain, flat, storage = _pair()
    for m in (plain, flat):
        _loss(m, 0).backward()
    flat_grad = storage["0"].grad
    assert flat_grad is not None and flat_grad.shape == storage["0"].shape
    for (name, p), q in zip(flat.named_parameters(), plain.parameters()):
        assert _in_flat_grad(p, flat_grad), name
        assert torch.equal(p.grad, q.grad), name
    assert dict(storage.named_grads()).keys() == dict(plain.named_parameters()).keys()
    for name, grad in storage.named_grads():
        assert torch.equal(grad, plain.get_parameter(name).grad)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_and_training_behave_as_on_the_plain_model(set_to_none):
    """SGD with momentum over the leaves trains as the plain model; zero_grad gives None or zeros as there."""
    plain, flat, storage = _pair()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, flat)]
    for step in range(3):
        for m, opt in zip((plain, flat), opts):
            opt.zero_grad(set_to_none=set_to_none)
            _loss(m, step).backward()
            opt.step()
    for p, q in zip(flat.parameters(), plain.parameters()):
        assert torch.equal(p, q)
    for opt in opts:
        opt.zero_grad(set_to_none=set_to_none)
    if set_to_none:
        assert all(p.grad is None for p in flat.parameters()) and storage["0"].grad is None
    else:
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in flat.parameters())
        assert torch.equal(storage["0"].grad, torch.zeros_like(storage["0"]))


def test_a_parameter_that_got_no_gradient_keeps_none_and_its_slot_reads_zero():
    """A layer outside the graph keeps `.grad is None`; the flat gradient holds zeros there."""
    plain, flat, storage = _pair()
    x = torch.randn(2, 6)
    for m in (plain, flat):
        m[0](x).sum().backward()
    assert [p.grad is None for p in flat.parameters()] == [p.grad is None for p in plain.parameters()]
    assert flat[2].weight.grad is None
    views = storage.views_of([storage["0"].grad])
    assert torch.equal(views["2.weight"], torch.zeros_like(flat[2].weight))
    assert torch.equal(views["0.weight"], plain[0].weight.grad)


def test_a_new_flat_gradient_is_written_whole_padding_and_slots_without_gradient_zero(monkeypatch):
    """A flat gradient made at the end of backward starts empty (dirty memory here: NaN); each element of
    it is written once: the padding between slots and a slot whose leaf got no gradient read zero."""
    plain = mlp(3, 6)
    flat = twin(plain)
    storage = register_flat_storage(flat, align=16)  # padding after every slot
    storage.unflatten()
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: real(*a, **k).fill_(float("nan")))
    x = torch.randn(2, 6)
    for step in range(2):
        storage["0"].grad = None  # as ZeRO-2 lets it go after each reduction
        plain.zero_grad()
        for m in (plain, flat):
            m[0](x).sum().backward()  # layer 2 outside the graph
        grad = storage["0"].grad
        assert not grad.isnan().any(), step
        views = storage.views_of([grad])
        assert torch.equal(views["0.weight"], plain[0].weight.grad)
        assert not views["2.weight"].any() and flat[2].weight.grad is None
        assert grad.abs().sum() == sum(p.grad.abs().sum() for p in plain.parameters() if p.grad is not None)


def test_micro_batches_accumulate_in_place_in_the_flat_gradient():
    """Backwards without zero_grad add into the same memory (no copy after the first), as the plain model."""
    plain, flat, _ = _pair()
    for m in (plain, flat):
        _loss(m, 0).backward()
    ptrs = [p.grad.data_ptr() for p in flat.parameters()]
    for m in (plain, flat):
        _loss(m, 1).backward()
    assert [p.grad.data_ptr() for p in flat.parameters()] == ptrs
    for p, q in zip(flat.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_each_backward_lands_the_leaves_gradients_in_their_slots_by_its_end():
    """After zero_grad() and backward every leaf's `.grad` is in the flat gradient before any read of it."""
    _, flat, storage = _pair()
    flat_param = storage.flat_params[0]
    torch_grad = vars(torch._C.TensorBase)["grad"]  # the slot itself, not FlatParameter.grad's read
    for step in range(2):
        flat.zero_grad()
        _loss(flat, step).backward()
        flat_grad = torch_grad.__get__(flat_param)
        assert flat_grad is not None
        assert all(_in_flat_grad(p, flat_grad) for p in flat.parameters())


def test_a_gradient_penalty_with_create_graph_differentiates_as_on_the_plain_model():
    """backward(create_graph=True) keeps each leaf's gradient and graph; the flat gradient has the values."""
    plain, flat, storage = _pair()
    for model in (plain, flat):
        _loss(model, 0).backward(create_graph=True)
    assert all(p.grad.requires_grad for p in flat.parameters())
    flat_grad = storage.flat_params[0].grad
    assert torch.equal(flat_grad, torch.cat([p.grad.detach().reshape(-1) for p in flat.parameters()]))
    for model in (plain, flat):
        penalty = sum(p.grad.pow(2).sum() for p in model.parameters())
        model.zero_grad()
        penalty.backward()
    for mine, theirs in zip(flat.parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


def test_a_flat_clip_in_per_tensor_mode_clips_the_leaves_gradients():
    """`clip_grad_norm_(storage.flat_params)` clips the leaves' gradients as clipping the plain model does."""
    plain, flat, storage = _pair()
    for m in (plain, flat):
        (_loss(m, 0) * 100).backward()
    total = nn.utils.clip_grad_norm_(storage.flat_params, 0.5)
    expected = nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    torch.testing.assert_close(total, expected)
    for p, q in zip(flat.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_per_submodule_clipping_and_freezing_act_as_on_the_plain_model():
    """clip_grad_norm_(model[0].parameters()) and freezing model[2] see the submodules' own parameters."""
    plain, flat, _ = _pair()
    assert len(list(flat[0].parameters())) == 2 and len(list(flat[2].parameters())) == 2
    optimizers = []
    for model in (plain, flat):
        model[2].requires_grad_(False)
        optimizers.append(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5))
    for step in range(3):
        norms = []
        for model, opt in zip((plain, flat), optimizers):
            opt.zero_grad()
            _loss(model, step).backward()
            norms.append(nn.utils.clip_grad_norm_(model[0].parameters(), 1e-3))
            opt.step()
        assert torch.equal(norms[0], norms[1]) and norms[0] > 1e-3  # it clipped
        assert flat[2].weight.grad is None
    for mine, theirs in zip(flat.parameters(), plain.parameters()):
        assert torch.equal(mine, theirs)


def test_gradients_assigned_either_way_reach_the_other():
    """`leaf.grad = t` lands in the flat gradient; `flat_param.grad = g` gives every leaf a view of g."""
    _, flat, storage = _pair()
    _loss(flat, 0).backward()
    new = torch.full_like(flat[0].bias, 7.0)
    flat[0].bias.grad = new
    assert torch.equal(storage.views_of([storage["0"].grad])["0.bias"], new)
    assert _in_flat_grad(flat[0].bias, storage["0"].grad)
    replacement = torch.arange(storage["0"].numel(), dtype=torch.float32)
    storage["0"].grad = replacement
    for name, p in flat.named_parameters():
        assert _in_flat_grad(p, replacement), name
    storage["0"].grad = None
    assert all(p.grad is None for p in flat.parameters())


def test_gradients_survive_the_mode_toggles():
    """flatten() after a per-tensor backward keeps the flat gradient; unflatten() gives the views back."""
    plain, flat, storage = _pair()
    for m in (plain, flat):
        _loss(m, 0).backward()
    before = storage["0"].grad.clone()
    storage.flatten()
    assert torch.equal(storage["0"].grad, before)
    storage.unflatten()
    for p, q in zip(flat.parameters(), plain.parameters()):
        assert _in_flat_grad(p, storage["0"].grad) and torch.equal(p.grad, q.grad)


def test_tied_weights_accumulate_both_uses_in_one_slot():
    """A tied embedding and head: one leaf, one slot, the plain model's summed gradient."""
    plain, flat, storage = _pair(TiedLM())
    tokens = torch.randint(0, 11, (3, 4))
    for m in (plain, flat):
        m(tokens).pow(2).mean().backward()
    assert flat.head.weight is flat.embed.weight
    assert _in_flat_grad(flat.embed.weight, storage["0"].grad)
    assert torch.equal(flat.embed.weight.grad, plain.embed.weight.grad)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_in_per_tensor_mode_keeps_its_gradients_in_its_own_flat_gradient(how):
    """A deep copy or pickle of an unflattened model trains on its own memory, not the original's."""
    plain, flat, storage = _pair()
    copied = copy.deepcopy(flat) if how == "deepcopy" else pickle.loads(pickle.dumps(flat))
    from flatten_parametrize import get_flat_storage

    copy_storage = get_flat_storage(copied)
    assert not copy_storage.is_flattened
    for m in (plain, copied):
        _loss(m, 0).backward()
    assert storage["0"].grad is None and all(p.grad is None for p in flat.parameters())
    for p, q in zip(copied.parameters(), plain.parameters()):
        assert _in_flat_grad(p, copy_storage["0"].grad) and torch.equal(p.grad, q.grad)


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
        lambda ps: torch.optim.Muon([p for p in ps if p.ndim == 2], lr=1e-2),
    ],
    ids=["adamw-foreach", "adamw-fused", "adafactor", "muon"],
)
def test_per_tensor_training_of_a_transformer_equals_the_plain_model(make):
    """AdamW (foreach, fused), Adafactor and Muon over the leaves give the plain model's weights, bitwise."""
    plain = _encoder()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    storage.unflatten()
    opts = [make(list(m.parameters())) for m in (plain, flat)]
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(2, 5, 16, generator=gen)
        for m, opt in zip((plain, flat), opts):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for (name, p), q in zip(flat.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert sum(t.numel() for s in opts[1].state.values() for t in s.values() if torch.is_tensor(t)) == sum(
        t.numel() for s in opts[0].state.values() for t in s.values() if torch.is_tensor(t)
    )


class _Unreached(torch.autograd.Function):
    """Multiply by ``w.sum()`` and give ``w`` no gradient: its accumulator runs without one."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w.sum()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _TwoStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Unreached.apply(self.second(self.first(x)), self.scale)


@pytest.mark.parametrize("unreached", [False, True], ids=["every leaf", "a leaf without a gradient"])
def test_a_groups_flat_gradient_is_final_during_backward_once_its_last_leaf_landed(unreached):
    """The flat parameter's post-accumulate hooks run once a backward, as soon as the group's leaves landed.

    The later layer's group finishes first, while the first layer has no gradient yet (grad sync and
    ``ShardedOptimizer`` start its reduction there); a leaf that gets no gradient does not hold it back.
    """
    model = _TwoStages()
    second = [model.second, model.scale] if unreached else [model.second]
    storage = register_flat_storage(
        model, {"first": [model.first, *([] if unreached else [model.scale])], "second": second}
    )
    storage.unflatten()
    seen: list[tuple[str, bool]] = []
    for name in storage.group_names:
        storage[name].register_post_accumulate_grad_hook(
            lambda flat, name=name: seen.append((name, model.first.weight.grad is None))
        )
    for _ in range(2):
        model.zero_grad()
        model(torch.randn(2, 3)).sum().backward()
    assert seen == [("second", True), ("first", False)] * 2
    assert model.scale.grad is None  # as on the plain model


@pytest.mark.parametrize("policy", [False, True], ids=["float32", "bfloat16 policy"])
def test_a_leafs_post_accumulate_grad_hook_fires_once_per_backward_with_its_gradient(policy: bool):
    """The fix docs/troubleshooting.md gives for torch's refusal of the hook on a flat-mode view."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = mlp(depth=2, width=4, seed=0)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if policy else None
    storage = register_flat_storage(model, mixed_precision=mixed)
    with pytest.raises(
        RuntimeError, match="post accumulate grad hooks cannot be registered on non-leaf tensors"
    ):
        model[0].weight.register_post_accumulate_grad_hook(lambda p: None)  # flat mode: a view
    storage.unflatten()
    seen: list[torch.Tensor] = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    for _ in range(2):
        model.zero_grad()
        model(torch.randn(3, 4)).float().sum().backward()
        assert len(seen) == 1 and torch.equal(seen.pop(), dict(storage.named_grads())["0.weight"])


def test_a_backward_lands_the_gradients_with_one_call_per_group_and_no_hook_on_the_leaves(monkeypatch):
    """Nothing hooks the flat parameter: no library hook on any leaf; the forward's output arms each group
    once per backward, and after zero_grad() autograd adds every gradient into its slot (the same tensors
    every step), with the plain model's values."""
    from flatten_parametrize._core.grad.leaf_slots import LeafGrads

    plain, flat, storage = _pair()
    assert all(not p._post_accumulate_grad_hooks for p in flat.parameters())
    armed: list[int] = []
    arm = LeafGrads.arm
    monkeypatch.setattr(
        LeafGrads, "arm", lambda self, task, point: (armed.append(task), arm(self, task, point))
    )
    monkeypatch.setattr(LeafGrads, "landed", lambda self, task: pytest.fail("a leaf hook ran"))
    slots = None
    for step in range(3):
        for m in (plain, flat):
            m.zero_grad()
            _loss(m, step).backward()
        assert len(armed) == step + 1 and len(set(armed)) == step + 1
        if slots is None:
            slots = [p.grad for p in flat.parameters()]
        assert all(p.grad is slot for p, slot in zip(flat.parameters(), slots))
        flat_grad = vars(torch._C.TensorBase)["grad"].__get__(storage["0"])
        assert all(_in_flat_grad(p, flat_grad) for p in flat.parameters())
        for p, q in zip(flat.parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad)


class _Raise(torch.autograd.Function):
    """The identity whose backward raises."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("stop here")


class _Stops(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(_Raise.apply(self.first(x)))


def test_a_leaf_that_a_node_gives_no_gradient_keeps_none_and_so_after_a_raise():
    """A leaf whose accumulation runs without a gradient, and one that a backward which raised never
    reached, keep `.grad is None` as on the plain model (no hook on the flat parameter)."""
    model = _TwoStages()
    storage = register_flat_storage(model)
    storage.unflatten()
    model(torch.randn(2, 3)).sum().backward()
    assert model.scale.grad is None and model.first.weight.grad is not None
    assert torch.equal(storage.views_of([storage["0"].grad])["scale"], torch.zeros(1))
    plain, model = _Stops(), _Stops()
    register_flat_storage(model).unflatten()
    for m in (plain, model):
        with pytest.raises(RuntimeError, match="stop here"):
            m(torch.randn(2, 3)).sum().backward()
    assert [p.grad is None for p in model.parameters()] == [p.grad is None for p in plain.parameters()]
    assert model.first.weight.grad is None and model.second.weight.grad is not None


def test_a_backward_that_skips_the_registered_modules_output_lands_at_the_next_read():
    """A submodule called on its own: the leaves get the plain model's gradients where autograd put them,
    and reading the flat gradient (or the next backward through the module) lands them in their slots."""
    plain, flat, storage = _pair()
    x = torch.randn(2, 6)
    for m in (plain, flat):
        m[0](x).sum().backward()
    assert torch.equal(flat[0].weight.grad, plain[0].weight.grad)
    flat_grad = storage["0"].grad
    assert _in_flat_grad(flat[0].weight, flat_grad) and flat[2].weight.grad is None
    assert torch.equal(storage.views_of([flat_grad])["0.weight"], plain[0].weight.grad)
    for m in (plain, flat):
        m[0](x).sum().backward()
        _loss(m, 1).backward()
    for p, q in zip(flat.parameters(), plain.parameters()):
        assert _in_flat_grad(p, storage["0"].grad) and torch.equal(p.grad, q.grad)


class _DictOut(nn.Module):
    """A model whose forward returns a dict (as transformers' models do), the loss inside it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        logits = self.head(self.body(x).tanh())
        return {"logits": logits, "aux": (logits.detach(), [logits.sum()]), "loss": logits.pow(2).mean()}


@pytest.mark.parametrize("root", ["loss", "logits"])
def test_a_backward_from_any_tensor_of_a_nested_output_lands_the_gradients_by_its_end(root):
    """Every tensor of a dict or tuple output is hooked: a backward from any of them lands each leaf's
    gradient in its slot by its end, with the plain model's values."""
    plain, model = _DictOut(), _DictOut()
    storage = register_flat_storage(model)
    storage.unflatten()
    torch_grad = vars(torch._C.TensorBase)["grad"]  # the slot itself, not FlatParameter.grad's read
    x = torch.randn(4, 6)
    for step in range(2):
        for m in (plain, model):
            m.zero_grad()
            out = m(x)
            (out[root] if root == "loss" else out[root].sum()).backward()
        flat_grad = torch_grad.__get__(storage["0"])
        for p, q in zip(model.parameters(), plain.parameters()):
            assert _in_flat_grad(p, flat_grad) and torch.equal(p.grad, q.grad), step
