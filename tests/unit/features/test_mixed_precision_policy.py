"""Mixed precision on the flat buffers (``register_flat_storage(..., mixed_precision=policy)``).

The reference needs no library (``_helpers.cast_per_forward``): a plain model whose
float32 weights are cast to ``param_dtype`` for each forward and whose low-precision
gradients are accumulated into its float32 parameters.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from _mixed_precision_cases import Block, CountCasts, cast_sizes
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.checkpoint import checkpoint

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage

from _helpers import TiedLM, assert_unchanged, cast_per_forward, core_of, snapshot, twin

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _batches(n: int, vocab: int = 13) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randint(0, vocab, (4, 5)) for _ in range(n)]


# ------------------------------------------------------------------------------ semantics


def test_views_are_the_compute_dtype_and_the_master_keeps_float32():
    """In flat mode ``layer.weight`` is bfloat16; the flat parameter, state dicts, named_grads float32."""
    model = Block()
    storage = register_flat_storage(model, mixed_precision=BF16)
    assert storage.mixed_precision == {"0": BF16}
    assert model.up.weight.dtype == torch.bfloat16 and model.head.weight is model.embed.weight
    assert storage["0"].dtype == torch.float32
    assert [p.dtype for p in model.parameters()] == [torch.float32]
    assert {v.dtype for v in model.state_dict().values()} == {torch.float32}
    assert {v.dtype for k, v in storage.flat_state_dict().items() if k.startswith("flat_param")} == {
        torch.float32
    }
    _loss(model(_batches(1)[0])).backward()
    assert storage["0"].grad.dtype == torch.float32
    assert {g.dtype for _, g in storage.named_grads()} == {torch.float32}


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_training_matches_the_cast_per_forward_reference(micro_batches):
    """Outputs bit-equal the reference's; masters allclose 1e-6 after AdamW steps with micro-batches."""
    plain = Block()
    model = twin(plain)
    storage = register_flat_storage(model, mixed_precision=BF16)
    reference = cast_per_forward(plain)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    batches = _batches(3 * micro_batches)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for batch in batches[step * micro_batches : (step + 1) * micro_batches]:
            out, expected = model(batch), reference(batch)
            assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
            _loss(out).backward()
            _loss(expected).backward()
        for name, grad in storage.named_grads():
            assert grad.dtype == torch.float32
            torch.testing.assert_close(grad, plain.get_parameter(name).grad, rtol=0, atol=0)
        opt.step()
        ref_opt.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, plain.state_dict()[name], rtol=1e-6, atol=1e-6)


def test_micro_batches_accumulate_in_the_master_dtype():
    """Two backwards add their gradients in float32: the sum of each one's float32 gradient, bit for bit."""
    model = Block()
    storage = register_flat_storage(model, mixed_precision=BF16)
    a, b = _batches(2)
    _loss(model(a)).backward()
    first = storage["0"].grad.clone()
    storage["0"].grad = None
    _loss(model(b)).backward()
    second = storage["0"].grad.clone()
    storage["0"].grad = None
    _loss(model(a)).backward()
    _loss(model(b)).backward()
    assert storage["0"].grad.dtype == torch.float32 and torch.equal(storage["0"].grad, first + second)


def test_a_forward_after_which_nothing_changed_casts_nothing():
    """No float32->bf16 cast per forward while the master is unchanged; one per group per step."""
    model = Block()
    storage = register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]}, mixed_precision=BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = _batches(4)
    _loss(model(batches[0])).backward()  # the first use casts each group once
    with CountCasts(cast_sizes(storage)) as counter:
        for batch in batches:
            _loss(model(batch)).backward()
        with torch.no_grad():
            model(batches[0])
        with torch.inference_mode():
            model(batches[0])
    assert counter.casts == 0
    for _ in range(2):
        with CountCasts(cast_sizes(storage)) as counter:
            opt.step()
            opt.zero_grad()
            for batch in batches:  # 4 micro-batches
                _loss(model(batch)).backward()
        assert counter.casts == len(storage.group_names)


@pytest.mark.parametrize(
    "change",
    [
        "optimizer",
        "fused_optimizer",
        "in_place",
        "load",
        "flat_load",
        "data",
        "to",
        "broadcast_like",
        "unflattened",
    ],
)
def test_every_change_of_the_master_reaches_the_views(change):
    """After any write to the master, the next forward (and a submodule alone) sees its bf16 cast."""
    model = Block()
    storage = register_flat_storage(model, mixed_precision=BF16)
    flat = storage["0"]
    batch = _batches(1)[0]
    model(batch)
    new = torch.randn_like(flat)
    if change == "optimizer":
        _loss(model(batch)).backward()
        torch.optim.SGD(model.parameters(), lr=1.0).step()
    elif change == "fused_optimizer":  # torch's fused kernels leave _version as it was
        _loss(model(batch)).backward()
        torch.optim.AdamW(model.parameters(), lr=1.0, fused=True).step()
    elif change == "in_place":
        with torch.no_grad():
            flat.mul_(3)
    elif change == "load":
        state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(state)
    elif change == "flat_load":
        state = storage.flat_state_dict()
        state["flat_param_0"] = new
        model.load_state_dict(state)
    elif change == "data":
        flat.data = new.clone()
    elif change == "to":
        model.to(torch.float64)
    elif change == "broadcast_like":
        with torch.no_grad():
            flat.detach().copy_(new)
            torch.autograd.graph.increment_version(flat)
    elif change == "unflattened":
        with storage.unflattened(), torch.no_grad():
            model.up.weight.add_(1.0)
    master = dict(storage.views_of(storage.flat_params))
    assert model.up.weight.dtype == torch.bfloat16
    assert torch.equal(model.up.weight, master["up.weight"].to(torch.bfloat16))  # a submodule read
    model(batch)
    assert torch.equal(model.down.weight, master["down.weight"].to(torch.bfloat16))


def test_a_write_into_a_view_lands_in_the_master():
    """``with no_grad: layer.weight.fill_(v)`` in flat mode reaches the float32 master and the state dict."""
    model = Block()
    register_flat_storage(model, mixed_precision=BF16)
    before = model.state_dict()["up.weight"].clone()
    with torch.no_grad():
        model.up.weight.fill_(0.5)
        torch.nn.init.zeros_(model.down.bias)
    state = model.state_dict()
    assert torch.equal(state["up.weight"], torch.full_like(before, 0.5))
    assert torch.equal(state["down.bias"], torch.zeros(8))
    assert torch.equal(state["down.weight"], twin(Block()).state_dict()["down.weight"])  # untouched


def test_a_write_into_a_view_and_a_master_step_unseen_between_raises():
    """A view written, then the master stepped before any sync point: a clear error, not a silent loss."""
    model = Block()
    storage = register_flat_storage(model, mixed_precision=BF16)
    flat = storage["0"]
    with torch.no_grad():
        model.up.weight.fill_(0.5)
        flat.add_(1.0)  # an optimizer step, say
    with pytest.raises(RuntimeError, match=r"in-place write into a torch\.bfloat16 view"):
        model.up.weight  # noqa: B018
    assert torch.equal(model.up.weight, dict(storage.views_of(storage.flat_params))["up.weight"].bfloat16())


def test_unflattened_keeps_the_policy_and_removal_gives_the_float32_plain_model():
    """``unflattened()``: float32 leaves, bf16 forward (see ..._per_tensor.py); removal: float32."""
    model = Block()
    storage = register_flat_storage(model, mixed_precision=BF16)
    with storage.unflattened():
        assert model.up.weight.dtype == torch.float32 and model(_batches(1)[0]).dtype == torch.bfloat16
    expected = model.state_dict()
    remove_flat_storage(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {type(p) for p in model.parameters()} == {nn.Parameter}
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert model(_batches(1)[0]).dtype == torch.float32
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_a_group_with_a_policy_and_one_without():
    """``{"main": policy}`` computes the linears in bf16 and keeps the norm (no policy) in float32."""
    model = Block()
    norm = ["norm.*"]
    storage = register_flat_storage(
        model,
        {"main": ["embed.*", "up.*", "down.*"], "norms": norm},
        mixed_precision={"main": BF16, "norms": None},
    )
    assert storage.mixed_precision == {"main": BF16, "norms": None}
    assert model.up.weight.dtype == torch.bfloat16 and model.norm.weight.dtype == torch.float32
    out = model(_batches(1)[0])  # LayerNorm upcasts: float32 weights on a bf16 input
    _loss(out).backward()
    assert storage["main"].grad.dtype == torch.float32 and storage["norms"].grad.dtype == torch.float32


def test_frozen_group_is_served_in_the_compute_dtype():
    """A frozen group gets a compute copy too (no gradient); the trainable one trains."""
    model = Block()
    model.embed.requires_grad_(False)
    storage = register_flat_storage(model, mixed_precision=BF16)
    assert len(storage.group_names) == 2
    assert model.embed.weight.dtype == torch.bfloat16 and model.up.weight.dtype == torch.bfloat16
    _loss(model(_batches(1)[0])).backward()
    frozen, trained = sorted(storage.flat_params, key=lambda f: f.requires_grad)
    assert frozen.grad is None and trained.grad.dtype == torch.float32


def test_cast_forward_inputs_and_output_dtype_as_fsdp2():
    """Floating inputs go to param_dtype (unless cast_forward_inputs=False); output_dtype casts outputs."""
    model = nn.Sequential(nn.Linear(4, 3))
    register_flat_storage(
        model, mixed_precision=MixedPrecisionPolicy(torch.bfloat16, output_dtype=torch.float32)
    )
    assert model(torch.randn(2, 4)).dtype == torch.float32
    model = nn.Sequential(nn.Linear(4, 3))
    register_flat_storage(
        model, mixed_precision=MixedPrecisionPolicy(torch.bfloat16, cast_forward_inputs=False)
    )
    with pytest.raises(RuntimeError, match="dtype"):
        model(torch.randn(2, 4))
    assert model(torch.randn(2, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_reduce_dtype_defaults_to_param_dtype():
    """The group's gradient buffer carries reduce_dtype (None: param_dtype), as FSDP2 reduces."""
    model = Block()
    policy = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32)
    storage = register_flat_storage(
        model, {"a": ["up.*"], "b": ["down.*"]}, mixed_precision={"a": BF16, "b": policy}
    )
    buffers = [g.grads.reduce_dtype for g in core_of(storage).groups()]
    assert buffers == [torch.bfloat16, torch.float32]


# ------------------------------------------------------------------------------ works with


def test_using_serves_the_given_tensors_in_the_compute_dtype():
    """``using(t)`` serves bf16 casts of ``t`` and gradients flow into ``t`` in its dtype."""
    model = Block()
    storage = register_flat_storage(model, mixed_precision=BF16)
    other = (storage["0"].detach() * 2).requires_grad_()
    with storage.using([other]):
        out = model(_batches(1)[0])
        assert torch.equal(model.up.weight, storage.views_of([other])["up.weight"].bfloat16())
    _loss(out).backward()
    assert other.grad is not None and other.grad.dtype == torch.float32
    assert torch.equal(model.up.weight, dict(storage.views_of(storage.flat_params))["up.weight"].bfloat16())


def test_functional_call_with_the_flat_parameter_name():
    """``functional_call(model, {"flat_param_0": t})`` computes with bf16 casts of ``t``."""
    plain = Block()
    model = twin(plain)
    storage = register_flat_storage(model, mixed_precision=BF16)
    t = storage["0"].detach().clone()
    batch = _batches(1)[0]
    out = torch.func.functional_call(model, {"flat_param_0": t}, (batch,))
    assert torch.equal(out, cast_per_forward(plain)(batch))


def test_stack_and_call_stacked():
    """``call_stacked`` over two copies equals the reference vmapped over two copies of its weights."""
    plain = Block()
    model = twin(plain)
    storage = register_flat_storage(model, mixed_precision=BF16)
    batch = _batches(1)[0]
    out = storage.call_stacked(storage.stack(2), batch)
    stacked = {
        name: p.detach().unsqueeze(0).repeat(2, *[1] * p.dim()) for name, p in plain.named_parameters()
    }

    def one(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        cast = {name: w.to(torch.bfloat16) for name, w in weights.items()}
        return torch.func.functional_call(plain, cast, (batch,))

    expected = torch.vmap(one)(stacked)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_activation_checkpointing():
    """Non-reentrant checkpointing of a block gives the same float32 gradients as without."""
    model = Block()
    storage = register_flat_storage(model, mixed_precision=BF16)
    batch = _batches(1)[0]
    h = model.embed(batch)
    _loss(
        model.head(checkpoint(lambda t: t + model.down(model.up(model.norm(t))), h, use_reentrant=False))
    ).backward()
    ckpt = storage["0"].grad.clone()
    storage["0"].grad = None
    h = model.embed(batch)
    _loss(model.head(h + model.down(model.up(model.norm(h))))).backward()
    assert torch.equal(storage["0"].grad, ckpt)


def test_compile_is_one_graph_with_eager_results():
    """``torch.compile`` of the flattened model: one graph, no break, outputs and grads equal to eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    model = twin(eager)
    eager_storage = register_flat_storage(eager, mixed_precision=BF16)
    storage = register_flat_storage(model, mixed_precision=BF16)
    x = torch.randn(5, 8)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    compiled = torch.compile(model, backend="aot_eager")
    out = compiled(x)
    expected = eager(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    _loss(out).backward()
    _loss(expected).backward()
    assert storage["0"].grad.dtype == torch.float32 and torch.equal(
        storage["0"].grad, eager_storage["0"].grad
    )
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.optim.SGD(eager.parameters(), lr=0.1).step()
    assert torch.equal(compiled(x), eager(x))  # the updated master, cast inside the graph


def test_deepcopy_and_pickle_keep_the_policy():
    """A deep copy and a pickled copy are mixed-precision models of their own (float32 masters)."""
    model = Block()
    register_flat_storage(model, mixed_precision=BF16)
    batch = _batches(1)[0]
    expected = model(batch)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (
        copy.deepcopy(model),
        torch.load(buf, weights_only=False),
        pickle.loads(pickle.dumps(model)),
    ):
        storage = get_flat_storage(other)
        assert storage.mixed_precision == {"0": BF16}
        assert other.up.weight.dtype == torch.bfloat16 and storage["0"].dtype == torch.float32
        assert torch.equal(other(batch), expected)
        with torch.no_grad():
            storage["0"].add_(1.0)
        assert not torch.equal(model.up.weight, other.up.weight)


def test_fp16_with_grad_scaler_trains_as_the_plain_model():
    """float16 compute with GradScaler("cpu"): scale, unscale_, inf checks, skipped steps as the reference."""
    policy = MixedPrecisionPolicy(param_dtype=torch.float16)
    plain = Block()
    model = twin(plain)
    register_flat_storage(model, mixed_precision=policy)
    reference = cast_per_forward(plain, torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=2.0**20
    )  # overflows at first: the first steps are skipped
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    for batch in _batches(6):
        for m, o, s, f in ((model, opt, scaler, model), (plain, ref_opt, ref_scaler, reference)):
            o.zero_grad()
            out = f(batch)
            s.scale(out.float().pow(2).sum() * 1e3).backward()
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            s.step(o)
            s.update()
    assert scaler.get_scale() == ref_scaler.get_scale() < 2.0**20
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, plain.state_dict()[name], rtol=1e-5, atol=1e-6)


def test_exist_ok_needs_the_same_policy():
    """``exist_ok=True`` returns the storage for the same policy and refuses another one."""
    model = Block()
    storage = register_flat_storage(model, mixed_precision=BF16)
    assert register_flat_storage(model, exist_ok=True, mixed_precision=BF16) is storage
    with pytest.raises(RuntimeError, match="another mixed_precision"):
        register_flat_storage(model, exist_ok=True)


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("policy", "error", "match"),
    [
        ("bf16", TypeError, "MixedPrecisionPolicy, or a mapping"),
        (torch.bfloat16, TypeError, "got dtype torch.bfloat16"),
        ({"nope": BF16}, ValueError, "group 'nope', which this storage does not have"),
        ({0: BF16}, TypeError, "keyed by group name"),
        ({"0": "bf16"}, TypeError, "for group '0'"),
        (MixedPrecisionPolicy(param_dtype=torch.int64), ValueError, "floating-point dtype; got torch.int64"),
        (MixedPrecisionPolicy(param_dtype=16), TypeError, "param_dtype must be a floating-point torch.dtype"),  # type: ignore[arg-type]
        (MixedPrecisionPolicy(torch.bfloat16, cast_forward_inputs=1), TypeError, "cast_forward_inputs"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_policy_is_refused_and_changes_nothing(policy, error, match):
    """A bad ``mixed_precision`` is a clear TypeError/ValueError; the model is unregistered and unchanged."""
    model = TiedLM()
    snap = snapshot(model)
    with pytest.raises(error, match=match):
        register_flat_storage(model, mixed_precision=policy)
    assert get_flat_storage(model) is None
    assert_unchanged(model, snap)


def test_disagreeing_module_casts_are_refused():
    """Two groups asking for different input dtypes of the registered module's forward: a ValueError."""
    model = Block()
    half = MixedPrecisionPolicy(param_dtype=torch.float16)
    with pytest.raises(ValueError, match="disagree on cast_forward_inputs"):
        register_flat_storage(model, {"a": ["up.*"], "b": ["down.*"]}, mixed_precision={"a": BF16, "b": half})
    assert get_flat_storage(model) is None
