"""Every write path lands under a mixed-precision policy as it does without one.

EMA libraries (the real ``torch_ema`` and ``ema_pytorch``), hand-written steps and init
helpers write through ``.data``, which moves no version counter. Each case runs on a
flattened model with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` against the
reference of ``_helpers.cast_per_forward``: a plain float32 twin whose weights are cast
to bfloat16 for each forward. Same bfloat16 weights give bit-equal outputs, so outputs,
losses and masters are compared with ``torch.equal``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch
from ema_pytorch import EMA
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.checkpoint import checkpoint
from torch_ema import ExponentialMovingAverage

from flatten_parametrize import register_flat_storage
from flatten_parametrize._core.view_cache import WRITE_SCANS
from flatten_parametrize._features.mixed_precision.feature import CASTS

from _helpers import cast_per_forward, twin

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def _pair() -> tuple[nn.Module, nn.Module, Any]:
    """A plain float32 model and its flattened twin under the bfloat16 policy."""
    plain = _net()
    model = twin(plain)
    return plain, model, register_flat_storage(model, mixed_precision=BF16)


def _batches(n: int) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(6, 8) for _ in range(n)]


def _loss(out: torch.Tensor) -> float:
    return out.float().pow(2).mean()


def _sgd_step(opt: torch.optim.Optimizer, forward: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> Any:
    opt.zero_grad()
    loss = _loss(forward(batch))
    loss.backward()
    opt.step()
    return loss.item()


def _assert_same_masters(model: nn.Module, plain: nn.Module) -> None:
    """The flattened model's float32 values (its state dict) equal the plain model's, bit for bit."""
    state, expected = model.state_dict(), plain.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], value), name


def _assert_same_outputs(model: nn.Module, reference: Callable[[torch.Tensor], torch.Tensor]) -> None:
    for batch in _batches(2):
        assert torch.equal(model(batch), reference(batch))


@contextmanager
def _maybe_unflattened(storage: Any, unflattened: bool) -> Iterator[None]:
    with storage.unflattened() if unflattened else nullcontext():
        yield


# ------------------------------------------------------------------------------ EMA libraries


@pytest.mark.parametrize("unflattened", [False, True], ids=["flat", "in-unflattened"])
def test_torch_ema_evaluates_the_ema_weights_and_restores_the_training_weights(unflattened):
    """torch_ema's ``average_parameters()`` evaluates the EMA weights; after it, training goes on exactly.

    In flat mode the EMA tracks the flat parameters; with ``unflattened()`` it tracks
    the float32 leaf parameters. Either way the evaluation runs in bfloat16 (per-tensor
    mode keeps the policy), ``restore()`` writes the training weights back through
    ``.data`` and the next steps equal the reference's.
    """
    plain, model, storage = _pair()
    reference = cast_per_forward(plain)
    with _maybe_unflattened(storage, unflattened):
        ema = ExponentialMovingAverage(model.parameters(), decay=0.5)
    plain_ema = ExponentialMovingAverage(plain.parameters(), decay=0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    batches = _batches(6)
    for batch in batches[:3]:
        assert _sgd_step(opt, model, batch) == _sgd_step(plain_opt, reference, batch)
        with _maybe_unflattened(storage, unflattened):
            ema.update()
        plain_ema.update()
    evaluate = reference
    trained = reference(batches[0])
    with _maybe_unflattened(storage, unflattened), ema.average_parameters(), plain_ema.average_parameters():
        assert not torch.equal(reference(batches[0]), trained)  # the EMA weights are in
        for batch in batches:
            assert torch.equal(model(batch), evaluate(batch))
    _assert_same_masters(model, plain)
    for batch in batches[3:]:
        assert _sgd_step(opt, model, batch) == _sgd_step(plain_opt, reference, batch)
    _assert_same_masters(model, plain)
    _assert_same_outputs(model, reference)


@pytest.mark.parametrize("unflattened", [False, True], ids=["flat", "in-unflattened"])
def test_ema_pytorch_ema_model_follows_every_update(unflattened):
    """ema_pytorch's EMA model (a deep copy updated through ``.data``) computes with each update's weights."""
    plain, model, storage = _pair()
    reference = cast_per_forward(plain)
    with _maybe_unflattened(storage, unflattened):
        ema = EMA(model, beta=0.5, update_after_step=0, update_every=1)
    plain_ema = EMA(plain, beta=0.5, update_after_step=0, update_every=1)
    # The EMA copy of the flattened model keeps its policy, in either mode.
    ema_reference = cast_per_forward(plain_ema.ema_model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    seen = []
    for batch in _batches(5):
        assert _sgd_step(opt, model, batch) == _sgd_step(plain_opt, reference, batch)
        with _maybe_unflattened(storage, unflattened):
            ema.update()
        plain_ema.update()
        out, expected = ema(batch), ema_reference(batch)
        assert torch.equal(out, expected)
        seen.append(out)
    assert not torch.equal(seen[0], seen[-1])  # the EMA model moved
    _assert_same_masters(model, plain)


def test_swapping_ema_weights_in_through_data_copy_evaluates_them():
    """``p.data.copy_(ema_p)`` for evaluation, then the training weights back the same way."""
    plain, model, _ = _pair()
    reference = cast_per_forward(plain)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    averages = [[p.detach().clone() for p in m.parameters()] for m in (model, plain)]
    for batch in _batches(3):
        runs = ((model, opt, model, averages[0]), (plain, plain_opt, reference, averages[1]))
        for m, o, forward, avg in runs:
            _sgd_step(o, forward, batch)
            with torch.no_grad():
                for a, p in zip(avg, m.parameters()):
                    a.lerp_(p, 0.5)
    backups = [[p.detach().clone() for p in m.parameters()] for m in (model, plain)]
    for m, avg in ((model, averages[0]), (plain, averages[1])):
        for p, a in zip(m.parameters(), avg):
            p.data.copy_(a)
    _assert_same_outputs(model, reference)
    for m, backup in ((model, backups[0]), (plain, backups[1])):
        for p, b in zip(m.parameters(), backup):
            p.data.copy_(b)
    _assert_same_outputs(model, reference)
    _assert_same_masters(model, plain)


# --------------------------------------------------------------------------- hand-written steps


@pytest.mark.parametrize("where", ["flat parameters", "leaves in unflattened()"])
def test_a_hand_written_data_step_trains_as_the_reference(where):
    """``p.data.add_(p.grad, alpha=-lr)``: every forward uses the stepped weights; one cast per step."""
    plain, model, storage = _pair()
    reference = cast_per_forward(plain)
    in_unflattened = where != "flat parameters"
    for step, batch in enumerate(_batches(4)):
        casts = CASTS["groups"]
        for m, forward in ((model, model), (plain, reference)):
            m.zero_grad()
            loss = _loss(forward(batch))
            loss.backward()
            with _maybe_unflattened(storage, in_unflattened and m is model):
                for p in m.parameters():
                    p.data.add_(p.grad, alpha=-0.1)
            if m is model:
                flat_loss = loss.item()
        assert flat_loss == loss.item(), step
        if step:  # the cast of the stepped master, once per group (the first forward made the copy)
            assert CASTS["groups"] - casts == 1
    _assert_same_masters(model, plain)
    _assert_same_outputs(model, reference)


# ------------------------------------------------------------------------ init after registration


@pytest.mark.parametrize(
    "init",
    [
        lambda w: w.data.fill_(0.5),
        lambda w: w.data.zero_(),
        lambda w: w.data.normal_(0.0, 0.02),
        lambda w: w.data.uniform_(-0.1, 0.1),
        lambda w: nn.init.trunc_normal_(w.data, std=0.02),
        lambda w: w.data.mul_(3.0),
    ],
    ids=["fill_", "zero_", "normal_", "uniform_", "trunc_normal_", "mul_"],
)
def test_init_through_data_after_registration_lands_rounded(init):
    """``layer.weight.data.normal_()`` after registering (init helpers) lands in the master, rounded to bf16.

    The state dict holds it at once, and training goes on as the plain model
    started from those values (the write happened in a bfloat16 view, so the
    master gets the bfloat16 values: "lands rounded").
    """
    plain, model, _ = _pair()
    for m in (model, plain):
        torch.manual_seed(5)
        for layer in (m[0], m[3]):
            init(layer.weight)
            init(layer.bias)
    state = model.state_dict()
    for name in ("0.weight", "0.bias", "3.weight", "3.bias"):
        assert torch.equal(state[name], model.get_parameter(name).float())  # what forward uses
        assert torch.equal(state[name].to(torch.bfloat16).float(), state[name])  # a bf16 value
    rounded = {k: v.to(torch.bfloat16).float() for k, v in plain.state_dict().items()}
    if torch.equal(state["0.weight"], rounded["0.weight"]):  # the same draws (all but normal_ here)
        assert all(torch.equal(state[k], rounded[k]) for k in rounded)
    plain.load_state_dict(state)  # the reference starts from what landed
    reference = cast_per_forward(plain)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for batch in _batches(3):
        assert _sgd_step(opt, model, batch) == _sgd_step(plain_opt, reference, batch)
    _assert_same_masters(model, plain)


def test_init_through_data_matches_the_plain_model_exactly_where_bf16_holds_the_value():
    """``fill_(0.5)`` through ``.data`` after registering: bit-equal to the plain model, through training."""
    plain, model, _ = _pair()
    for m in (model, plain):
        m[0].weight.data.fill_(0.5)
        m[3].bias.data.zero_()
    _assert_same_masters(model, plain)
    reference = cast_per_forward(plain)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for batch in _batches(3):
        assert _sgd_step(opt, model, batch) == _sgd_step(plain_opt, reference, batch)
    _assert_same_masters(model, plain)


def test_transformers_init_weights_after_registration_lands():
    """transformers' ``_init_weights`` applied after registering lands in the masters and trains on."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    register_flat_storage(model, mixed_precision=BF16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.apply(model._init_weights)  # after registration: writes into the bfloat16 views
    state = model.state_dict()
    changed = [k for k in state if not torch.equal(state[k], before[k])]
    assert any(k.endswith("c_attn.weight") for k in changed)
    for name in changed:  # every re-initialized value landed: the master's cast is what the view holds
        assert torch.equal(state[name].to(torch.bfloat16), model.get_parameter(name)), name
    plain = transformers.GPT2LMHeadModel(config).eval()
    plain.load_state_dict(state)
    tokens = torch.randint(0, 50, (2, 8))
    weights = {n: p.to(torch.bfloat16) for n, p in plain.named_parameters()}
    expected = torch.func.functional_call(plain, weights, (tokens,)).logits
    assert torch.equal(model(tokens).logits, expected)


# ------------------------------------------------------------------- other aliases handed out


@pytest.mark.parametrize("alias", ["named_views", "state_dict", "views_of(flat_params)", "flat_state_dict"])
def test_data_writes_through_the_aliases_the_library_hands_out_land(alias):
    """Writes through ``.data`` of ``named_views()``, state-dict values and ``views_of`` reach the forward."""
    plain, model, storage = _pair()
    reference = cast_per_forward(plain)
    model(_batches(1)[0])  # views and compute copy made
    if alias == "named_views":
        target = dict(storage.named_views())["0.weight"]
    elif alias == "state_dict":
        target = model.state_dict()["0.weight"]
    elif alias == "flat_state_dict":
        target = storage.flat_state_dict()["flat_param_0"][:128].view(16, 8)
    else:
        target = storage.views_of(storage.flat_params)["0.weight"]
    target.data.fill_(0.25)
    plain[0].weight.data.fill_(0.25)
    _assert_same_outputs(model, reference)
    _assert_same_masters(model, plain)


# ---------------------------------------------------------------- what cannot be seen, and the cost


def test_a_view_data_write_and_an_unseen_master_change_raise_and_the_master_wins():
    """A ``.data`` write into a view and an in-place change of the master before any sync point: refused."""
    _, model, _ = _pair()
    flat = next(model.parameters())
    with torch.no_grad():
        model[0].weight.data.fill_(0.5)
        flat.mul_(2.0)  # a step by hand, without `.data`
        expected = flat.detach()[:128].view(16, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"a write through `\.data` of 0\.weight .* was dropped"):
        model(_batches(1)[0])
    assert torch.equal(model[0].weight, expected)  # consistent again: the master's cast


def test_a_view_data_write_lands_before_an_optimizer_step_without_a_forward():
    """The optimizer reads the flat gradient first, which lands a `.data` write into a view; then it steps."""
    plain, model, _ = _pair()
    reference = cast_per_forward(plain)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    batch = _batches(1)[0]
    for m, o, forward in ((model, opt, model), (plain, plain_opt, reference)):
        o.zero_grad()
        _loss(forward(batch)).backward()
        m[3].weight.data.fill_(0.5)  # after backward, before the step
        o.step()
    _assert_same_masters(model, plain)
    _assert_same_outputs(model, reference)


def test_reads_inside_forward_and_backward_compare_nothing():
    """Only views served outside the forward are compared: training, eval and recomputation compare none."""
    plain, model, storage = _pair()

    class Checkpointed(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=False)

    wrapped = Checkpointed(twin(plain))
    register_flat_storage(wrapped, mixed_precision=BF16)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, wrapped)]
    batches = _batches(4)
    _sgd_step(opts[0], model, batches[0])
    _sgd_step(opts[1], wrapped, batches[0])
    before = WRITE_SCANS["exposed"]
    for batch in batches:
        _sgd_step(opts[0], model, batch)
        _sgd_step(opts[1], wrapped, batch)  # backward recomputes the forward: not "outside"
        with torch.no_grad():
            model(batch)
    assert WRITE_SCANS["exposed"] == before
    # A weight read outside the forward (logging it, say): that one slot is compared at each sync
    # point (gradient reads, forwards) until its view is dropped (the next step makes new views).
    _ = model[0].weight.norm().item()
    _sgd_step(opts[0], model, batches[0])
    _sgd_step(opts[0], model, batches[0])
    compared = WRITE_SCANS["exposed"] - before
    assert 0 < compared <= 12
    for batch in batches:
        _sgd_step(opts[0], model, batch)
    assert WRITE_SCANS["exposed"] - before == compared  # nothing left to compare
    assert storage.is_flattened


def test_a_view_held_across_steps_is_still_seen():
    """A view kept by outside code (weight clipping by hand) shows each step's values and its writes land."""
    plain, model, _ = _pair()
    reference = cast_per_forward(plain)
    held = [model[0].weight, model[3].weight]
    plain_held = [plain[0].weight, plain[3].weight]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    bound = 0.0625  # exact in bfloat16
    for batch in _batches(4):
        loss, plain_loss = _sgd_step(opt, model, batch), _sgd_step(plain_opt, reference, batch)
        assert loss == pytest.approx(plain_loss, rel=1e-2)
        for w, p in zip(held, plain_held):  # WGAN-style clipping of weights kept since the start
            w.data.clamp_(-bound, bound)
            p.data.clamp_(-bound, bound)
    state = model.state_dict()
    for name in ("0.weight", "3.weight"):
        # The clip saw the bfloat16 view: what the forward uses is within the bound, and the master
        # is within it up to bfloat16 rounding (a value that rounds onto the bound was not written).
        assert state[name].to(torch.bfloat16).abs().max() <= bound
        assert state[name].abs().max() <= bound * (1 + 2**-8)
        assert (state[name].abs() == bound).sum() > 0  # the clipped elements landed
        torch.testing.assert_close(state[name], plain.state_dict()[name], rtol=0, atol=2e-3)
