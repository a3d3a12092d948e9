"""torch.compile: one graph, no breaks, eager results, no extra recompilation."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounter

from flatten_parametrize import get_flat_storage, register_flat_storage

from _helpers import TiedLM, train_steps


def _mlp(depth: int = 4) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(8, 8), nn.Tanh())])


def _train(model: nn.Module, step_fn, steps: int = 10) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    return train_steps(model, opt, [x] * steps, lambda _, batch: step_fn(batch).pow(2).mean())


def test_flattened_model_traces_as_one_graph_without_breaks():
    """The library's hot path adds no graph break."""
    model = _mlp()
    register_flat_storage(model)
    explanation = torch._dynamo.explain(model)(torch.randn(2, 8))
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0


def test_compiled_graph_splits_each_group_once():
    """Inside the registered module's forward every view comes from one split per group."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes: list[str] = []

    def keep(gm, _inputs):
        codes.append(gm.code)
        return make_boxed_func(gm.forward)

    model = _mlp(depth=10)
    register_flat_storage(model, {"w": ["*.weight"], "b": ["*.bias"]})
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    compiled(torch.randn(2, 8)).sum().backward()
    forward, backward = codes
    assert forward.count("torch.ops.aten.split_with_sizes.default(") == 2
    assert backward.count("torch.ops.aten.cat.default(") == 2


def test_training_loop_recompiles_no_more_than_the_plain_model():
    """Ten compiled training steps compile as many frames as the plain model's."""
    plain = _mlp()
    model = copy.deepcopy(plain)
    register_flat_storage(model)
    counts = []
    for m in (plain, model):
        torch._dynamo.reset()
        counter = CompileCounter()
        _train(m, torch.compile(m, backend=counter))
        counts.append(counter.frame_count)
    assert counts[1] == counts[0] == 1


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _compiled_training(model: nn.Module, make_opt, batch: torch.Tensor, *, whole_step: bool):
    """Train 4 steps, the step or the model compiled; return frames, graph breaks, losses."""
    opt = make_opt(model.parameters())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounter()
    forward = model if whole_step else torch.compile(model, backend=counter)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = forward(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run = torch.compile(step, backend=counter) if whole_step else step
    losses = [run(batch).item() for _ in range(4)]
    return counter.frame_count, _graph_breaks(), losses


_OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
}


@pytest.mark.parametrize("whole_step", [True, False], ids=["compiled-step", "compiled-model"])
@pytest.mark.parametrize("optimizer", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("arch", ["sequential", "user-module"])
def test_compiled_training_has_the_plain_models_frames_and_breaks(arch, optimizer, whole_step):
    """Forward, backward, step and zero_grad compiled: the plain model's frames and breaks, its results."""
    torch.manual_seed(0)
    plain = _mlp() if arch == "sequential" else TiedLM()
    model = copy.deepcopy(plain)
    register_flat_storage(model)
    batch = torch.randn(6, 8) if arch == "sequential" else torch.randint(0, 11, (3, 4))
    frames, breaks, losses = _compiled_training(model, _OPTIMIZERS[optimizer], batch, whole_step=whole_step)
    plain_frames, plain_breaks, plain_losses = _compiled_training(
        plain, _OPTIMIZERS[optimizer], batch, whole_step=whole_step
    )
    assert (frames, breaks) == (plain_frames, plain_breaks)
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-5)
    for (key, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=key)


def test_a_compiled_user_module_takes_its_views_from_one_split_per_group():
    """torch.compile of a user module (hooks outside the compiled forward): no split per view."""
    torch.manual_seed(0)
    plain = TiedLM()
    model = copy.deepcopy(plain)
    register_flat_storage(model, {"a": ["embed.*", "norm.*"], "b": ["body.*"]})
    codes: list[str] = []

    def keep(gm, _inputs):
        codes.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    tokens = torch.randint(0, 11, (3, 4))
    torch.compile(model, backend=keep)(tokens).pow(2).mean().backward()
    plain(tokens).pow(2).mean().backward()
    assert len(codes) == 1 and codes[0].count(".split(") <= 2
    for name, grad in get_flat_storage(model).named_grads():
        torch.testing.assert_close(grad, plain.get_parameter(name).grad, msg=name)


def test_a_data_write_lands_before_a_compiled_user_modules_forward():
    """`layer.weight.data = t` before a call of torch.compile(model) is seen by that call."""
    torch.manual_seed(0)
    plain = TiedLM()
    model = copy.deepcopy(plain)
    register_flat_storage(model)
    tokens = torch.randint(0, 11, (3, 4))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    compiled(tokens)
    new = torch.randn(6, 6)
    model.body.weight.data = new.clone()
    plain.body.weight.data = new.clone()
    torch.testing.assert_close(compiled(tokens), plain(tokens))
    torch.testing.assert_close(model.state_dict()["body.weight"], new)


@pytest.fixture
def fresh_inductor_cache() -> Iterator[None]:
    """Compile with inductor into an empty cache directory, removed afterwards.

    Inductor's on-disk caches (FX graph cache, precompiled header) are keyed without the
    vector ISA that ATEN_CPU_CAPABILITY selects (torch 2.13): after a run under avx512, a
    run under avx2 on the same machine reuses the kernel source generated for 16-lane
    vectors, builds it with 8-lane ones and computes wrong values (0.73 off), and one under
    default fails to compile it (``at::vec`` undeclared). A private cache makes the test
    depend on this run only.
    """
    from torch._inductor.utils import fresh_inductor_cache

    with fresh_inductor_cache():
        yield


@pytest.mark.usefixtures("fresh_inductor_cache")
def test_compiled_default_backend_matches_eager_training():
    """With the default backend a flattened model compiles and trains like the eager plain model."""
    plain = TiedLM()
    model = copy.deepcopy(plain)
    register_flat_storage(model)
    tokens = torch.randint(0, 11, (3, 4), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = torch.compile(model)
    torch.testing.assert_close(compiled(tokens), plain(tokens), rtol=1e-5, atol=1e-5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(3):
        for fn, o in ((compiled, opt), (plain, ref)):
            o.zero_grad()
            fn(tokens).pow(2).mean().backward()
            o.step()
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    for (key, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=key)


def test_compiling_a_submodule_still_reads_the_flat_buffer():
    """A compiled submodule (outside the registered module's forward) sees current values."""
    model = _mlp()
    storage = register_flat_storage(model)
    torch._dynamo.reset()
    layer = torch.compile(model[0], backend="aot_eager")
    x = torch.randn(2, 8)
    torch.testing.assert_close(layer(x), model[0](x))
    with torch.no_grad():
        storage["0"].mul_(2)
    torch.testing.assert_close(layer(x), model[0](x))
