"""torch.compile: one graph, no breaks, eager results, no extra recompilation."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounter

from flatten_parametrize import register_flat_storage

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
