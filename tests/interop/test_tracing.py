"""Tracing and export of a flattened model read the flat parameters: jit.trace, torch.export, ONNX.

Each against a plain twin; `requires_grad=False` weights must not be baked in as constants either.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage

from _helpers import twin


def _pair(frozen: bool = True) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    if frozen:
        plain[2].requires_grad_(False)  # a frozen group of its own
    flat = twin(plain)
    register_flat_storage(flat)
    return plain, flat


def test_jit_trace_in_flat_mode_reads_the_flat_parameters():
    """The traced graph reads every flat parameter: no constants, output equal to the plain model's."""
    plain, flat = _pair()
    x = torch.randn(5, 3)
    traced = torch.jit.trace(flat, x)
    graph = str(traced.graph)
    assert 'prim::GetAttr[name="flat_param_0"]' in graph and 'prim::GetAttr[name="flat_param_1"]' in graph
    assert torch.equal(traced(x), plain(x))


def test_a_traced_model_follows_a_replaced_flat_buffer_like_a_traced_plain_model():
    """After the flat buffers are replaced (.data, frozen group too), the traced module uses them."""
    plain, flat = _pair()
    x = torch.randn(5, 3)
    traced_flat, traced_plain = torch.jit.trace(flat, x), torch.jit.trace(plain, x)
    for param in (*flat.parameters(), *plain.parameters()):
        param.data = param.data * 2 + 1
    assert torch.equal(traced_flat(x), traced_plain(x))
    assert torch.equal(traced_flat(x), flat(x))


def test_a_traced_model_trains_the_flat_parameters():
    """Backward through the traced module reaches the flat parameter like the eager module."""
    plain, flat = _pair(frozen=False)
    x = torch.randn(5, 3)
    traced = torch.jit.trace(flat, x)
    traced(x).sum().backward()
    plain(x).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    assert torch.equal(get_flat_storage(flat)["0"].grad, grads)


def test_jit_trace_of_a_submodule_is_refused_with_the_way_out():
    """A traced submodule does not own the flat parameter: RuntimeError saying what to trace instead."""
    _, flat = _pair()
    with pytest.raises(
        RuntimeError,
        match=r"torch\.jit\.trace reached 0\.weight outside the forward.*"
        r"Trace the module given to register_flat_storage",
    ):
        torch.jit.trace(flat[0], torch.randn(2, 3))


def test_jit_script_in_flat_mode_is_refused_with_the_way_out():
    """torch.jit.script cannot compile the generated classes: RuntimeError naming a plain copy and trace."""
    _, flat = _pair()
    with pytest.raises(
        RuntimeError, match=r"torch\.jit\.script cannot compile Sequential.*remove_flat_storage"
    ):
        torch.jit.script(flat)


def test_jit_script_of_a_removed_copy_equals_the_plain_model():
    """The documented way out works: script a deep copy after removing its storage."""
    plain, flat = _pair()
    copy_of = copy.deepcopy(flat)
    remove_flat_storage(copy_of)
    x = torch.randn(5, 3)
    assert torch.equal(torch.jit.script(copy_of)(x), torch.jit.script(plain)(x))


def test_torch_export_lifts_the_flat_parameters_as_inputs():
    """torch.export records the flat parameters as parameters (not constants); the program equals the twin."""
    plain, flat = _pair()
    x = torch.randn(5, 3)
    program = torch.export.export(flat, (x,))
    lifted = set(program.graph_signature.parameters)
    assert {"flat_param_0", "flat_param_1"} <= lifted
    assert not program.constants or all("flat" not in k for k in program.constants)
    assert torch.equal(program.module()(x), plain(x))


@pytest.mark.skipif(importlib.util.find_spec("onnx") is None, reason="onnx is not installed")
@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_export_keeps_the_weights_as_initializers(tmp_path, dynamo):
    """Both ONNX exporters store the weights as initializers: the legacy one under the plain names
    (as for the plain model), the torch.export-based one as the flat parameters."""
    if dynamo and importlib.util.find_spec("onnxscript") is None:
        pytest.skip("onnxscript is not installed")
    import onnx

    plain, flat = _pair()
    x = torch.randn(5, 3)
    path = tmp_path / "model.onnx"
    torch.onnx.export(flat, (x,), str(path), dynamo=dynamo)
    names = [init.name for init in onnx.load(str(path)).graph.initializer]
    if dynamo:
        assert {"flat_param_0", "flat_param_1"} <= set(names)
    else:
        assert names == [name for name, _ in plain.named_parameters()]
