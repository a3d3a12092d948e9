"""Whole-model serialization: pickle, torch.save, deepcopy, spawn/forkserver processes.

The registered module loads as a flattened model again (same groups, layout, mode, ties,
requires_grad, one storage); a submodule pickled or deep-copied on its own is a standalone
plain module with ordinary parameters. Each case against a plain twin.
"""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.multiprocessing as tmp
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage

from _helpers import Mixed, TiedLM, WithOwnParam, assert_same_values, mlp, train_steps, twin, values

#: ``tests/``, where ``_helpers.py`` lives (a fresh interpreter needs it on its path).
TESTS = Path(__file__).resolve().parents[2]


def _input(model: nn.Module) -> torch.Tensor:
    if isinstance(model, TiedLM):
        return torch.randint(0, 11, (3, 5))
    return torch.randn(5, 4 if isinstance(model, Mixed) else 3 if isinstance(model, WithOwnParam) else 5)


CASES: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "tied-align": (TiedLM, {"align": 4}),
    "mixed-auto": (Mixed, {}),
    "own-param-named": (WithOwnParam, {"groups": {"scale": ["scale"], "rest": ["fc.*", "bn.*"]}}),
    "mlp-partial": (mlp, {"groups": [["0.*", "4.weight"]]}),
}


def _round_trip(model: nn.Module, how: str) -> Any:
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
    return copy.deepcopy(model)


def _float_mean_square(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The mean square of the output in float32 (the cases' outputs have several dtypes)."""
    return model(batch).float().pow(2).mean()


def assert_same_flattened(loaded: nn.Module, original: nn.Module) -> None:
    """Same class name, groups, layout, mode, ties, requires_grad; one storage of its own."""
    a, b = get_flat_storage(loaded), get_flat_storage(original)
    assert a is not None and a is not b
    assert type(loaded).__name__ == type(original).__name__ and isinstance(loaded, type(original).__mro__[1])
    assert a.group_names == b.group_names and a.param_infos == b.param_infos
    assert a.is_flattened == b.is_flattened
    for fa, fb in zip(a.flat_params, b.flat_params):
        assert torch.equal(fa, fb) and fa.requires_grad == fb.requires_grad
        assert fa.metadata() == fb.metadata() and fa.offsets == fb.offsets
        assert fa.data_ptr() != fb.data_ptr()
    with a.unflattened():
        params = dict(loaded.named_parameters(remove_duplicate=False))
    flats = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in a.flat_params]
    for info in a.param_infos:
        for name in (info.name, *info.aliases):
            assert any(lo <= params[name].data_ptr() < hi for lo, hi in flats), name  # one storage
    assert_same_values(values(loaded), values(original))


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_registered_module_loads_as_the_same_flattened_model(case, how):
    """A round trip gives a flattened model equal to the original that trains like the plain twin."""
    factory, kwargs = CASES[case]
    plain = factory()
    flat = twin(plain)
    register_flat_storage(flat, **kwargs)
    loaded = _round_trip(flat, how)
    assert_same_flattened(loaded, flat)
    x = _input(plain)
    for model in (plain, loaded):
        train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), [x] * 2, _float_mean_square)
    assert_same_values(values(loaded), values(plain), rtol=1e-5, atol=1e-6)
    assert torch.allclose(loaded(x), plain(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_an_unflattened_model_loads_unflattened_with_its_pending_changes(how):
    """Unflattened mode survives, with a parameter reassigned there (values pickled, not the old buffer)."""
    plain = TiedLM()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    storage.unflatten()
    new = nn.Parameter(torch.randn(6, 6))
    flat.body.weight = new
    plain.body.weight = nn.Parameter(new.detach().clone())
    loaded = _round_trip(flat, how)
    assert not get_flat_storage(loaded).is_flattened
    assert_same_values(values(loaded), values(plain))
    get_flat_storage(loaded).flatten()
    assert_same_values(values(loaded), values(plain))


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_a_submodule_alone_is_a_standalone_plain_module(how):
    """`model[0]` alone: its original class, ordinary parameters holding its values, independent."""
    plain = TiedLM()
    flat = twin(plain)
    register_flat_storage(flat)
    for name in ("body", "head", "norm"):
        alone = _round_trip(getattr(flat, name), how)
        reference = getattr(plain, name)
        assert type(alone) is type(reference)
        assert [n for n, _ in alone.named_parameters()] == [n for n, _ in reference.named_parameters()]
        assert all(type(p) is nn.Parameter for p in alone.parameters())
        assert_same_values(values(alone), values(reference))
        with torch.no_grad():
            for p in alone.parameters():
                p.add_(1)
        assert_same_values(values(flat), values(plain))  # the copy is independent


def test_a_submodule_alone_keeps_ties_inside_it():
    """A subtree holding both names of a tied parameter gives one parameter for both."""
    model = nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), nn.Linear(3, 1))
    model[0][1].weight = model[0][0].weight
    register_flat_storage(model)
    # deepcopy: also through a container without parameters of its own (one context per call)
    alone = copy.deepcopy(model[0])
    assert type(alone[0]) is nn.Linear and alone[0].weight is alone[1].weight
    assert torch.equal(alone[0].weight, model[0][0].weight)
    lm = TiedLM()
    register_flat_storage(lm)
    for alone_lm in (pickle.loads(pickle.dumps(lm.head)), copy.deepcopy(lm.head)):
        assert torch.equal(alone_lm.weight, lm.embed.weight)


def test_shared_submodules_stay_shared_after_loading():
    """A submodule reached under two names is one module after loading."""
    layer = nn.Linear(3, 3)
    model = nn.Sequential(layer, nn.Tanh(), layer)
    register_flat_storage(model)
    loaded = pickle.loads(pickle.dumps(model))
    assert loaded[0] is loaded[2]
    x = torch.randn(2, 3)
    assert torch.equal(loaded(x), model(x))


def test_pickling_a_model_with_other_parametrizations_is_refused_like_torch():
    """A module parametrized before registration: torch pickles those only through state_dict()."""
    model = nn.Sequential(nn.Linear(3, 3))
    torch.nn.utils.parametrizations.weight_norm(model[0])
    register_flat_storage(model)
    with pytest.raises(
        RuntimeError, match=r"cannot pickle ParametrizedLinear: it was parametrized before.*state_dict\(\)"
    ):
        pickle.dumps(model)


def test_a_saved_model_loads_in_a_fresh_process_without_any_import(tmp_path):
    """`torch.load(path, weights_only=False)` in a fresh interpreter needs nothing but torch (and the
    model's own class, as for a plain model): flatten_parametrize is imported by the unpickler."""
    plain = TiedLM()
    flat = twin(plain)
    register_flat_storage(flat, align=4)
    path = tmp_path / "model.pt"
    torch.save(flat, path)
    x = torch.randint(0, 11, (3, 5))
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(TESTS)!r})  # the model's class: tests/_helpers.py\n"
        f"model = torch.load({str(path)!r}, weights_only=False)\n"
        "from flatten_parametrize import get_flat_storage\n"
        "assert get_flat_storage(model).param_infos[0].name == 'embed.weight'\n"
        f"torch.save(model(torch.load({str(tmp_path / 'x.pt')!r})), {str(tmp_path / 'out.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert torch.equal(torch.load(tmp_path / "out.pt"), plain(x))


def _train_in_child(rank: int, model: nn.Module, layer: nn.Module, x: torch.Tensor, out: Any) -> None:
    storage = get_flat_storage(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).pow(2).mean().backward()
    opt.step()
    result = io.BytesIO()  # bytes: tensors put in a queue would be shared with a process that exits
    torch.save(
        {
            "flattened": storage is not None and storage.is_flattened,
            "groups": storage.group_names,
            "tied": model.head.weight.data_ptr() == model.embed.weight.data_ptr(),
            "state": {k: v.clone() for k, v in model.state_dict().items()},
            "layer_type": type(layer).__name__,
            "layer_params": [n for n, _ in layer.named_parameters()],
            "layer_state": {k: v.clone() for k, v in layer.state_dict().items()},
        },
        result,
    )
    out.put(result.getvalue())


def _child_in_process(model: nn.Module, layer: nn.Module, x: torch.Tensor, out: Any) -> None:
    _train_in_child(0, model, layer, x, out)


def _check_child_result(data: bytes, plain: TiedLM, x: torch.Tensor) -> None:
    result = torch.load(io.BytesIO(data))
    assert result["flattened"] and result["groups"] == ["0"] and result["tied"]
    assert result["layer_type"] == "Linear" and result["layer_params"] == ["weight", "bias"]
    assert_same_values(result["layer_state"], values(plain.body))
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(x).pow(2).mean().backward()
    opt.step()
    assert_same_values(result["state"], values(plain), rtol=1e-6, atol=1e-7)


def test_a_flattened_model_crosses_a_spawn_boundary():
    """torch.multiprocessing.spawn(fn, args=(model, submodule)): flattened root, plain submodule, training."""
    plain = TiedLM()
    flat = twin(plain)
    register_flat_storage(flat)
    x = torch.randint(0, 11, (3, 5))
    queue = tmp.get_context("spawn").SimpleQueue()
    tmp.spawn(_train_in_child, args=(flat, flat.body, x, queue), nprocs=1, join=True)
    _check_child_result(queue.get(), plain, x)


@pytest.mark.skipif(sys.platform == "win32", reason="forkserver is POSIX only")
def test_a_flattened_model_crosses_a_forkserver_process_boundary():
    """mp.Process with the forkserver start method receives the same flattened model."""
    plain = TiedLM()
    flat = twin(plain)
    register_flat_storage(flat)
    x = torch.randint(0, 11, (3, 5))
    context = tmp.get_context("forkserver")
    queue = context.SimpleQueue()
    process = context.Process(target=_child_in_process, args=(flat, flat.body, x, queue))
    process.start()
    result = queue.get()
    process.join(timeout=120)
    assert process.exitcode == 0
    _check_child_result(result, plain, x)
