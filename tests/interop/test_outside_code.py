"""What importing the package changes outside it: each wrapper that ``_outside/registry.py`` lists.

With the real libraries (torch's DCP and FSDP, Lightning, torchao; timm in
``tests/interop/test_timm.py``, which runs it in a subprocess): every function listed is wrapped
once its module is imported, keeps the original's name, docstring, signature and ``__wrapped__``,
gives the original's result on a model without a flattened storage, and works beside a user's
own wrapper of the same function, installed before or after it. With
``FLATTEN_PARAMETRIZE_NO_PATCHES`` set, a fresh interpreter wraps none and has no finder of
ours on ``sys.meta_path``. ``docs/outside-code.md`` lists exactly the registry.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import operator
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as dsd
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import OptimStateKeyType

from flatten_parametrize import register_flat_storage
from flatten_parametrize._outside.on_import import is_ours
from flatten_parametrize._outside.registry import OUTSIDE, SWITCH, OutsideWrapper, switched_off

from _helpers import mlp

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "outside-code.md"

pytestmark = pytest.mark.filterwarnings(
    "ignore:Deprecation. TorchAODType is deprecated",
    "ignore:.*Int8DynActInt4WeightQATQuantizer.*deprecated",
    "ignore:.*is deprecated and will be removed",
)

#: Outside modules that the test environment does not hold in this process (timm: a subprocess of its own).
ELSEWHERE = {"timm.optim._param_groups"}
LISTED = [
    pytest.param(module, function, id=f"{module}.{function}")
    for wrapper in OUTSIDE
    for module, function in wrapper.functions
    if module not in ELSEWHERE
]


def _get(module: str, function: str) -> Callable[..., Any]:
    return operator.attrgetter(function)(importlib.import_module(module))


@pytest.mark.parametrize(("module", "function"), LISTED)
def test_every_listed_function_is_wrapped_once_with_the_originals_name_docstring_and_signature(
    module: str, function: str
) -> None:
    wrapped = _get(module, function)
    assert is_ours(wrapped), f"{module}.{function} is not wrapped"
    original = wrapped.__wrapped__
    assert not is_ours(original), "wrapped twice"
    assert wrapped.__name__ == original.__name__ == function.rpartition(".")[2]
    assert wrapped.__qualname__ == original.__qualname__
    assert wrapped.__doc__ == original.__doc__
    unbound = getattr(wrapped, "__func__", wrapped)  # a class method is looked up bound to its class
    assert inspect.signature(unbound) == inspect.signature(original)


def test_fsdps_rekey_stays_a_static_method() -> None:
    assert isinstance(FSDP.__dict__["rekey_optim_state_dict"], staticmethod)


def test_torchs_reparametrization_methods_keep_their_kind() -> None:
    kinds = {"WeightNorm": staticmethod, "SpectralNorm": staticmethod, "BasePruningMethod": classmethod}
    for module, function, _ in TORCH_RENAMES.values():  # the modules, not the functions of their names
        cls = _owner(importlib.import_module(module), function)[0]
        if isinstance(cls, type):
            assert isinstance(cls.__dict__["apply"], kinds[cls.__name__])


# ------------------------------------------------------------ the original's result without a storage


def _trained(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(0))).sum().backward()
    opt.step()
    return opt


def _owner(module: ModuleType, name: str) -> tuple[Any, str]:
    """The object holding ``name`` in ``module`` (a class for ``Class.method``) and the attribute's name."""
    path, _, attr = name.rpartition(".")
    return (operator.attrgetter(path)(module) if path else module), attr


@pytest.fixture
def originals(monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType, str], None]:
    """Put the original of a wrapped function back for the test (``restore(module, name)``)."""

    def restore(module: ModuleType, name: str) -> None:
        owner, attr = _owner(module, name)
        raw = owner.__dict__[attr]
        if isinstance(raw, (staticmethod, classmethod)):
            monkeypatch.setattr(owner, attr, type(raw)(raw.__func__.__wrapped__))
        else:
            monkeypatch.setattr(owner, attr, raw.__wrapped__)

    return restore


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _dcp_round_trip() -> tuple[Any, Any, Any]:
    """``get_state_dict`` of a plain model and Adam, and the state ``set_state_dict`` gives fresh ones."""
    model = mlp(depth=2, width=4, seed=0)
    saved = dsd.get_state_dict(model, _trained(model))
    fresh = mlp(depth=2, width=4, seed=1)
    opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    dsd.set_state_dict(fresh, opt, model_state_dict=saved[0], optim_state_dict=saved[1])
    return saved, fresh.state_dict(), opt.state_dict()


def test_dcp_state_dicts_of_a_plain_model_are_the_originals(originals: Any) -> None:
    got = _dcp_round_trip()
    (dcp,) = [w for w in OUTSIDE if dsd.__name__ in w.modules]
    for _, name in dcp.functions:
        originals(dsd, name)
    assert not is_ours(dsd._get_optim_state_dict)
    expected = _dcp_round_trip()
    assert _same(got, expected)


def test_fsdps_rekey_of_a_plain_model_is_the_originals() -> None:
    model = mlp(depth=2, width=4, seed=0)
    by_id = _trained(model).state_dict()
    original = FSDP.rekey_optim_state_dict.__wrapped__
    by_name = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model)
    assert _same(by_name, original(by_id, OptimStateKeyType.PARAM_NAME, model))
    assert list(by_name["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert _same(
        FSDP.rekey_optim_state_dict(by_name, OptimStateKeyType.PARAM_ID, model),
        original(by_name, OptimStateKeyType.PARAM_ID, model),
    )


def test_lightnings_loader_of_a_plain_model_is_the_originals() -> None:
    from lightning.fabric.strategies import model_parallel

    load = model_parallel._load_raw_module_state
    source = mlp(depth=2, width=4, seed=0).state_dict()
    by_ours, by_original = mlp(depth=2, width=4, seed=1), mlp(depth=2, width=4, seed=1)
    load(source, by_ours)
    load.__wrapped__(source, by_original)
    assert _same(by_ours.state_dict(), source) and _same(by_original.state_dict(), source)
    partial = {k: v for k, v in source.items() if k != "0.bias"}
    errors = []
    for call in (load, load.__wrapped__):
        with pytest.raises(RuntimeError, match="Missing key") as caught:
            call(partial, mlp(depth=2, width=4, seed=1))
        errors.append(str(caught.value))
    assert errors[0] == errors[1]


def _quantized(run: Callable[[nn.Module], None]) -> tuple[list[str], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    run(model)
    return [type(m).__name__ for m in model.modules()], model(torch.ones(2, 64)).detach()


def _torchao_calls() -> dict[str, tuple[str, str, Callable[[nn.Module], None]]]:
    """name -> (module, wrapped function, a call of torchao's public API that reaches it)."""
    from torchao.float8 import convert_to_float8_training
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from torchao.quantization.qat import Int8DynActInt4WeightQATQuantizer

    quantizer = Int8DynActInt4WeightQATQuantizer(groupsize=32)
    return {
        "quantize_": (
            "torchao.quantization.quant_api",
            "_replace_with_custom_fn_if_matches_filter",
            lambda m: quantize_(m, Int8WeightOnlyConfig()),
        ),
        "convert_to_float8_training": (
            "torchao.float8.float8_linear_utils",
            "swap_linear_layers",
            convert_to_float8_training,
        ),
        "QAT prepare": (
            "torchao.quantization.qat.linear",
            "Int8DynActInt4WeightQATQuantizer.prepare",
            lambda m: quantizer.prepare(m),  # looked up at each call, as the other calls do
        ),
        "QAT prepare, convert": (
            "torchao.quantization.qat.linear",
            "Int8DynActInt4WeightQATQuantizer.convert",
            lambda m: quantizer.convert(quantizer.prepare(m)),
        ),
    }


@pytest.mark.parametrize(
    "call", ["quantize_", "convert_to_float8_training", "QAT prepare", "QAT prepare, convert"]
)
def test_torchaos_swaps_of_a_plain_model_are_the_originals(call: str, originals: Any) -> None:
    module, function, run = _torchao_calls()[call]
    got = _quantized(run)
    originals(importlib.import_module(module), function)
    assert not is_ours(_get(module, function))
    expected = _quantized(run)
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])


#: name -> (module, wrapped method, a call of torch's public API that reaches it).
TORCH_RENAMES: dict[str, tuple[str, str, Callable[[nn.Module], Any]]] = {
    "weight_norm": ("torch.nn.utils.weight_norm", "WeightNorm.apply", torch.nn.utils.weight_norm),
    "remove_weight_norm": (
        "torch.nn.utils.weight_norm",
        "WeightNorm.remove",
        lambda m: torch.nn.utils.remove_weight_norm(torch.nn.utils.weight_norm(m)),
    ),
    "spectral_norm": ("torch.nn.utils.spectral_norm", "SpectralNorm.apply", torch.nn.utils.spectral_norm),
    "remove_spectral_norm": (
        "torch.nn.utils.spectral_norm",
        "SpectralNorm.remove",
        lambda m: torch.nn.utils.remove_spectral_norm(torch.nn.utils.spectral_norm(m)),
    ),
    "register_parametrization": (
        "torch.nn.utils.parametrize",
        "register_parametrization",
        torch.nn.utils.parametrizations.orthogonal,
    ),
    "remove_parametrizations": (
        "torch.nn.utils.parametrize",
        "remove_parametrizations",
        lambda m: torch.nn.utils.parametrize.remove_parametrizations(
            torch.nn.utils.parametrizations.orthogonal(m), "weight"
        ),
    ),
    "l1_unstructured": (
        "torch.nn.utils.prune",
        "BasePruningMethod.apply",
        lambda m: torch.nn.utils.prune.l1_unstructured(m, "weight", amount=0.5),
    ),
    "prune.remove": (
        "torch.nn.utils.prune",
        "BasePruningMethod.remove",
        lambda m: torch.nn.utils.prune.remove(
            torch.nn.utils.prune.l1_unstructured(m, "weight", 0.5), "weight"
        ),
    ),
}


def _renamed(run: Callable[[nn.Module], Any]) -> tuple[list[str], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    run(model[0])  # spectral_norm draws its vectors from the generator seeded above
    return [n for n, _ in model.named_parameters()], model(torch.ones(2, 4)).detach()


@pytest.mark.filterwarnings("ignore:.*deprecated in favor of")
@pytest.mark.parametrize("call", list(TORCH_RENAMES))
def test_torchs_renames_of_a_plain_model_are_the_originals(call: str, originals: Any) -> None:
    module, function, run = TORCH_RENAMES[call]
    got = _renamed(run)
    originals(importlib.import_module(module), function)
    assert not is_ours(_get(module, function))
    expected = _renamed(run)
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])


def _layer_sync(package: str) -> Callable[[nn.Module], Any]:
    """Lightning's ``TorchSyncBatchNorm`` (of ``package``): convert the model, then revert it."""

    def run(model: nn.Module) -> Any:
        plugin = importlib.import_module(f"{package}.plugins.layer_sync").TorchSyncBatchNorm()
        return plugin.revert(plugin.apply(model))

    return run


#: name -> (module, wrapped function, a call of the library's public API that reaches it).
MODULE_SWAPS: dict[str, tuple[str, str, Callable[[nn.Module], Any]]] = {
    "convert_sync_batchnorm": (
        "torch.nn.modules.batchnorm",
        "SyncBatchNorm.convert_sync_batchnorm",
        nn.SyncBatchNorm.convert_sync_batchnorm,
    ),
    "fuse_modules": (
        "torch.ao.quantization.fuse_modules",
        "_fuse_modules_helper",
        lambda m: torch.ao.quantization.fuse_modules(m.eval(), [["0", "1", "2"]], inplace=True),
    ),
    "quantize_dynamic": (
        "torch.ao.quantization.quantize",
        "_convert",
        lambda m: torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, dtype=torch.qint8, inplace=True),
    ),
    "lightning revert": (
        "lightning.pytorch.plugins.layer_sync",
        "TorchSyncBatchNorm.revert",
        _layer_sync("lightning.pytorch"),
    ),
    "pytorch_lightning revert": (
        "pytorch_lightning.plugins.layer_sync",
        "TorchSyncBatchNorm.revert",
        _layer_sync("pytorch_lightning"),
    ),
}


def _bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))


def _swapped(run: Callable[[nn.Module], Any]) -> tuple[list[str], list[str], torch.Tensor]:
    model = _bn_net()
    run(model)
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0))
    return [type(m).__name__ for m in model], list(model.state_dict()), model(x).detach()


@pytest.mark.filterwarnings("ignore:.*torch.ao.quantization is deprecated")
@pytest.mark.parametrize("call", list(MODULE_SWAPS))
def test_module_swaps_of_a_plain_model_are_the_originals(call: str, originals: Any) -> None:
    module, function, run = MODULE_SWAPS[call]
    got = _swapped(run)
    originals(importlib.import_module(module), function)
    assert not is_ours(_get(module, function))
    expected = _swapped(run)
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


# ------------------------------------------------------------------------ beside a user's own wrapper


def _counting(function: Callable[..., Any], calls: list[str]) -> Callable[..., Any]:
    """A user's wrapper: records each call, then calls ``function``."""

    @functools.wraps(function)
    def users_wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(function.__name__)
        return function(*args, **kwargs)

    return users_wrapper


class UsersWrapper:
    """``wrap(module, name)``: a user's wrapper of ``module.name``, put after or before ours."""

    def __init__(self, order: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.order = order
        self.monkeypatch = monkeypatch
        #: The name of the function each call of the user's wrapper went to.
        self.calls: list[str] = []

    def __call__(self, module: ModuleType, name: str) -> list[str]:
        owner, attr = _owner(module, name)
        raw = owner.__dict__[attr]
        kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        ours = raw.__func__ if kind is not None else raw
        users = _counting(ours if self.order == "after ours" else ours.__wrapped__, self.calls)
        self.monkeypatch.setattr(owner, attr, kind(users) if kind is not None else users)
        if self.order == "before ours":
            (patch,) = {w.patch for w in OUTSIDE if module.__name__ in w.modules}
            patch(module)  # ours wraps theirs (as when their module is imported after ours)
            assert getattr(owner, attr).__wrapped__ is users, "ours did not wrap the user's wrapper"
        return self.calls


@pytest.fixture(params=["after ours", "before ours"])
def users_wrapper(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> UsersWrapper:
    return UsersWrapper(request.param, monkeypatch)


def _flat_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp(depth=2, width=4, seed=0)
    register_flat_storage(model)
    return model, _trained(model)


def test_dcp_works_beside_a_users_wrapper(users_wrapper: UsersWrapper) -> None:
    calls = users_wrapper(dsd, "_get_optim_state_dict")
    model, opt = _flat_model()
    model_state, optim_state = dsd.get_state_dict(model, opt)
    assert calls == ["_get_optim_state_dict"]
    assert list(model_state) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert sorted(optim_state["state"]) == sorted(model_state)  # ours split the flat state


def test_fsdps_rekey_works_beside_a_users_wrapper(users_wrapper: UsersWrapper) -> None:
    module = importlib.import_module("torch.distributed.fsdp.fully_sharded_data_parallel")
    calls = users_wrapper(module, "FullyShardedDataParallel.rekey_optim_state_dict")
    model, _ = _flat_model()
    plain = mlp(depth=2, width=4, seed=0)
    by_id = _trained(plain).state_dict()
    by_name = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model)
    assert list(by_name["state"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # ours: the plain names
    # a flattened model is re-keyed by ours alone: a wrapper it wraps is not called (the page says so)
    assert calls == (["rekey_optim_state_dict"] if users_wrapper.order == "after ours" else [])
    calls.clear()
    assert _same(FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, plain), by_name)
    assert calls == ["rekey_optim_state_dict"]


def test_lightnings_loader_works_beside_a_users_wrapper(users_wrapper: UsersWrapper) -> None:
    from lightning.fabric.strategies import model_parallel

    calls = users_wrapper(model_parallel, "_load_raw_module_state")
    source = mlp(depth=2, width=4, seed=0).state_dict()
    model = mlp(depth=2, width=4, seed=1)
    model_parallel._load_raw_module_state(source, model)
    assert calls == ["_load_raw_module_state"]
    assert _same(model.state_dict(), source)


@pytest.mark.parametrize("call", ["quantize_", "convert_to_float8_training", "QAT prepare"])
def test_torchaos_swaps_work_beside_a_users_wrapper(call: str, users_wrapper: UsersWrapper) -> None:
    module, function, run = _torchao_calls()[call]
    calls = users_wrapper(importlib.import_module(module), function)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    storage = register_flat_storage(model)
    flat = storage.flat_params[0]
    with (
        pytest.warns(UserWarning, match="left the flat storage")
        if call == "quantize_"
        else contextlib.nullcontext()
    ):
        run(model)  # in flat mode: refused by torch unless ours runs it on the plain model
    assert calls and calls[0] == function.rpartition(".")[2]
    assert storage.is_flattened
    if call != "quantize_":
        assert storage.flat_params[0] is flat  # a change of owner, not of slot


@pytest.mark.filterwarnings("ignore:.*deprecated in favor of")
@pytest.mark.parametrize("call", list(TORCH_RENAMES))
def test_torchs_renames_work_beside_a_users_wrapper(call: str, users_wrapper: UsersWrapper) -> None:
    module, function, run = TORCH_RENAMES[call]
    calls = users_wrapper(importlib.import_module(module), function)
    model = mlp(depth=2, width=4, seed=0)
    storage = register_flat_storage(model)
    run(model[0])  # in flat mode: torch's KeyError or TypeError unless ours runs it on the plain model
    assert calls and calls[-1] == function.rpartition(".")[2]
    assert storage.is_flattened


@pytest.mark.filterwarnings("ignore:.*torch.ao.quantization is deprecated")
@pytest.mark.parametrize("call", list(MODULE_SWAPS))
def test_module_swaps_work_beside_a_users_wrapper(call: str, users_wrapper: UsersWrapper) -> None:
    module, function, run = MODULE_SWAPS[call]
    calls = users_wrapper(importlib.import_module(module), function)
    model = _bn_net()
    storage = register_flat_storage(model)
    flat = storage.flat_params[0]
    run(
        model
    )  # in flat mode: torch's TypeError or NotImplementedError unless ours runs it on the plain model
    assert calls and calls[-1] == function.rpartition(".")[2]
    assert storage.is_flattened and storage.flat_params[0] is flat


# -------------------------------------------------------------------------------------- the switch


def test_the_switch_is_read_as_set_unless_empty_or_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, expected in (("", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(SWITCH, value)
        assert switched_off() is expected, value
    monkeypatch.delenv(SWITCH)
    assert switched_off() is False


_PROBE = """
import importlib, json, operator, sys
import flatten_parametrize
from flatten_parametrize._outside.on_import import is_ours
from flatten_parametrize._outside.registry import OUTSIDE
finders = [type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith("flatten_parametrize")]
wrapped = {}
for wrapper in OUTSIDE:
    for module, function in wrapper.functions:
        try:
            found = operator.attrgetter(function)(importlib.import_module(module))
        except ImportError:
            continue
        wrapped[module + "." + function] = is_ours(found)
print(json.dumps({"finders": finders, "wrapped": wrapped}))
"""


def _probe(switch: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != SWITCH}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if switch is not None:
        env[SWITCH] = switch
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_with_the_switch_set_a_fresh_interpreter_wraps_nothing_and_installs_no_finder() -> None:
    off = _probe("1")
    assert off["finders"] == []
    assert off["wrapped"] and not any(off["wrapped"].values()), off["wrapped"]
    on = _probe(None)  # the same probe without the switch: every function found is wrapped
    assert on["wrapped"].keys() == off["wrapped"].keys()
    assert all(on["wrapped"].values()), on["wrapped"]


# ----------------------------------------------------------------------------------------- the page


def page_section(wrapper: OutsideWrapper) -> str:
    """The Markdown section of ``docs/outside-code.md`` that says what ``wrapper`` wraps."""
    functions = ", ".join(f"`{module}.{function}`" for module, function in wrapper.functions)
    return "\n".join(
        [
            f"### {wrapper.feature}",
            "",
            f"- **Wraps**: {functions}.",
            f"- **Why**: {wrapper.why}.",
            f"- **With a flattened storage**: {wrapper.changes}.",
            f"- **Unchanged**: models without a flattened storage; {wrapper.unchanged}.",
            f"- **With `{SWITCH}=1`**: {wrapper.left_out}.",
        ]
    )


def test_the_page_lists_every_wrapper_of_the_registry_and_no_other() -> None:
    """docs/outside-code.md has one section per registry entry, as ``page_section`` writes it."""
    text = PAGE.read_text()
    for wrapper in OUTSIDE:
        assert page_section(wrapper) in text, f"docs/outside-code.md should hold:\n\n{page_section(wrapper)}"
    features = [line[4:] for line in text.splitlines() if line.startswith("### ")]
    assert features == [wrapper.feature for wrapper in OUTSIDE]
