"""torch's SyncBatchNorm conversion, Lightning's revert of it and torch.ao's fusion on a flattened model.

``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` (Lightning's ``Trainer(sync_batchnorm=True)``
calls it through its ``TorchSyncBatchNorm`` plugin when fitting starts, and the plugin's
``revert`` at teardown) moves each batch norm's parameters into a new module with
``new.weight = old.weight``: in flat mode torch refused it with "cannot assign
'torch.FloatTensor' as parameter 'weight'". ``torch.ao.quantization.fuse_modules`` looks its
fuser up by exact module class and failed with "NotImplementedError: Cannot fuse eval modules".
Each runs here with the real library on a flattened model and on its plain twin from the same
seed (``_outside/module_swaps.py``): classes, state-dict keys, outputs and training are the plain
twin's, in flat and in per-tensor mode, and a parameter that moved keeps its slot.

A ``SyncBatchNorm`` computes as a ``BatchNorm`` without a process group (and refuses CPU
inputs with one, on the plain model too), so the twins train in one process.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.ao.quantization as tq
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import nn
from torch.nn.utils.parametrize import type_before_parametrizations

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage

from _helpers import assert_same_values, train_steps, values

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.ao.quantization is deprecated")

X = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(0))
MODES = ["flat", "per-tensor"]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8)
    )


def _twins(mode: str) -> tuple[nn.Sequential, nn.Sequential, Any]:
    plain, model = _net(), _net()
    storage = register_flat_storage(model)
    if mode == "per-tensor":
        storage.unflatten()
    return plain, model, storage


def _train(model: nn.Module) -> None:
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), [X, X])


def _assert_as_plain(model: nn.Module, plain: nn.Module) -> None:
    classes = [type_before_parametrizations(m) for m in model.modules()]  # flat mode's are parametrized
    assert classes[1:] == [type(m) for m in plain.modules()][1:]
    assert_same_values(values(model), values(plain))
    assert torch.equal(model(X), plain(X))


@pytest.mark.parametrize("mode", MODES)
def test_lightnings_sync_batchnorm_plugin_converts_and_reverts_as_on_the_plain_model(mode: str) -> None:
    plain, model, storage = _twins(mode)
    flat, numel = storage.flat_params[0], storage.flat_params[0].numel()
    plugin = TorchSyncBatchNorm()  # what Trainer(sync_batchnorm=True) applies and reverts
    for m in (plain, model):
        assert plugin.apply(m) is m
    assert isinstance(model[1], nn.SyncBatchNorm) and isinstance(model[5], nn.SyncBatchNorm)
    _train(model)
    _train(plain)
    _assert_as_plain(model, plain)
    assert storage.is_flattened == (mode == "flat")
    assert storage.flat_params[0] is flat and flat.numel() == numel  # a change of owner: same slots
    assert "dead space" not in storage.summary()
    for m in (plain, model):
        assert plugin.revert(m) is m
    assert type_before_parametrizations(model[1]).__name__ == "_BatchNormXd"
    _train(model)
    _train(plain)
    _assert_as_plain(model, plain)
    assert storage.flat_params[0] is flat and "dead space" not in storage.summary()
    remove_flat_storage(model)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    _assert_as_plain(model, plain)


def test_convert_sync_batchnorm_of_a_model_wrapping_the_registered_one_keeps_the_flat_mode() -> None:
    plain, model, storage = _twins("flat")
    outer, plain_outer = nn.Sequential(model), nn.Sequential(plain)
    for m in (outer, plain_outer):
        nn.SyncBatchNorm.convert_sync_batchnorm(m)
    assert storage.is_flattened and [n for n, _ in model.named_parameters()] == ["flat_param_0"]
    _train(model)
    _train(plain)
    _assert_as_plain(model, plain)


def _fused(model: nn.Module, qat: bool, inplace: bool) -> nn.Module:
    model.train(qat)
    fuse = tq.fuse_modules_qat if qat else tq.fuse_modules
    return fuse(model, [["0", "1", "2"]], inplace=inplace)


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "a copy"])
@pytest.mark.parametrize("qat", [False, True], ids=["eval", "qat"])
@pytest.mark.parametrize("mode", MODES)
def test_fuse_modules_gives_the_plain_models_fused_model(mode: str, qat: bool, inplace: bool) -> None:
    plain, model, storage = _twins(mode)
    before = [type_before_parametrizations(m) for m in model]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="a submodule replaced after registration leaves")
        fused_plain = _fused(plain, qat, inplace)
        fused = _fused(model, qat, inplace)
    assert (fused is model) == inplace
    _assert_as_plain(fused, fused_plain)
    if not inplace:  # the original is left as it was, in its mode
        assert [type_before_parametrizations(m) for m in model] == before and storage.is_flattened == (
            mode == "flat"
        )
    fused_storage = get_flat_storage(fused)
    assert "dead space" not in fused_storage.summary()  # moved modules renamed, folded weights gone
    if qat:  # the QAT module holds the conv and the norm themselves: their slots stay, under their new names
        names = [info.name for info in fused_storage.param_infos]
        assert names == [n for n, _ in fused_plain.named_parameters()]
        _train(fused)
        _train(fused_plain)
        _assert_as_plain(fused, fused_plain)


def _qat_net() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(tq.QuantStub(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3), tq.DeQuantStub())
    model.qconfig = tq.get_default_qat_qconfig("x86")
    return model


@pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max")
@pytest.mark.parametrize("mode", MODES)
def test_eager_qat_prepares_trains_and_converts_as_on_the_plain_model(mode: str) -> None:
    """torch.ao's prepare_qat swaps each Linear for a QAT Linear that re-hosts its parameters."""
    plain, model = _qat_net(), _qat_net()
    storage = register_flat_storage(model)
    if mode == "per-tensor":
        storage.unflatten()
    flat = storage.flat_params[0]
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    for m in (plain, model):
        tq.prepare_qat(m.train(), inplace=True)
    assert storage.flat_params[0] is flat and [info.name for info in storage.param_infos] == [
        "1.weight",
        "1.bias",
        "3.weight",
        "3.bias",
    ]
    for m in (plain, model):
        train_steps(m, torch.optim.SGD(m.parameters(), lr=0.1), [x] * 3)
    assert torch.equal(model(x), plain(x))
    for m in (plain, model):
        tq.convert(m.eval(), inplace=True)
    assert type(model[1]) is type(plain[1]) and torch.equal(model(x), plain(x))


@pytest.mark.parametrize("inplace", [True, False], ids=["inplace", "a copy"])
@pytest.mark.parametrize("mode", MODES)
def test_quantize_dynamic_gives_the_plain_models_quantized_model(mode: str, inplace: bool) -> None:
    plain, model, storage = _twins(mode)
    quantized_plain = tq.quantize_dynamic(plain.eval(), {nn.Linear}, dtype=torch.qint8)
    quantized = tq.quantize_dynamic(model.eval(), {nn.Linear}, dtype=torch.qint8, inplace=inplace)
    assert (quantized is model) == inplace
    classes = [type_before_parametrizations(m) for m in quantized]
    assert classes[3:] == [type(m) for m in quantized_plain][3:]  # the quantized Linear
    assert torch.equal(quantized(X), quantized_plain(X))
    if not inplace:  # the original is left as it was, in its mode
        assert type_before_parametrizations(model[4]) is nn.Linear and storage.is_flattened == (
            mode == "flat"
        )


@pytest.mark.parametrize("mode", MODES)
def test_quantizing_every_flattened_module_removes_the_storage_with_a_warning(mode: str) -> None:
    """Nothing left to flatten: said when it happens, and a later call on the storage says why it is gone."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    storage = register_flat_storage(model)
    if mode == "per-tensor":
        storage.unflatten()
    gone = r"no tensor of the flat storage is left in the model \(0.weight, 0.bias, 2.weight, 2.bias: "
    x = torch.randn(4, 6)
    quantized_plain = tq.quantize_dynamic(plain, {nn.Linear}, dtype=torch.qint8)
    if mode == "flat":  # converted on the plain model, then laid out again: nothing is left
        with pytest.warns(UserWarning, match=gone):
            tq.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
        assert get_flat_storage(model) is None
        removed_by = r"torch.ao.quantization's convert \(quantize_dynamic, prepare_qat, quantize\)"
    else:  # a plain model already: the next call on the storage finds the modules replaced
        tq.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
        with pytest.warns(UserWarning, match=gone), pytest.raises(RuntimeError, match="detached"):
            storage.flat_state_dict()
        removed_by = r"per-tensor mode \(submodule 0 was replaced or deleted\)"
    assert get_flat_storage(model) is None and [type(m) for m in model] == [type(m) for m in quantized_plain]
    assert torch.equal(model(x), quantized_plain(x))
    with pytest.raises(RuntimeError, match=f"this flat storage is detached: {removed_by} removed it, as no "):
        storage.flat_state_dict()
