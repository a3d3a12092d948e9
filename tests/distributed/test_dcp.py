"""``torch.distributed.checkpoint`` (DCP) of flattened models: the plain model's checkpoints, every engine.

Three torchrun launches of ``tests/_dcp_checkpoints.py`` (gloo on 127.0.0.1): on 2 ranks the plain
model under DDP trains 5 Adam steps uninterrupted (the reference), and 8 setups (plain and
flattened; DDP with a plain or an attached optimizer, the storage's grad sync, ``ShardedOptimizer``
ZeRO-1 and -2, FSDP2) train 3 steps and save ``get_state_dict(model, optimizer)`` with ``dcp.save``
or ``dcp.async_save`` (full and sharded options, the flattened optimizer form); those checkpoints
are loaded with ``set_state_dict`` (``strict`` both ways) into fresh setups on 2, 1 and 3 ranks,
across forms, and 2 more steps must give the reference's losses and weights. Single-process tests
below check the pieces that need no launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from flatten_parametrize import ShardedOptimizer, register_flat_storage

from _gloo_pool import free_port
from _helpers import mlp

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
#: The uninterrupted run's numbers are met to this (1 and 3 ranks sum the batch in another order).
TOL = 1e-6


def _launch(outdir: Path, world: int, mode: str) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(TESTS / "_dcp_checkpoints.py"), str(outdir), mode,
    ]  # fmt: skip
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    result = outdir / f"{mode}-{world}.pt"
    if done.returncode != 0 or not result.exists():
        pytest.fail(f"the {world} DCP processes failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
    return torch.load(result, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    outdir = tmp_path_factory.mktemp("dcp")
    out = {2: _launch(outdir, 2, "save")}  # the checkpoints, then the 2-rank resumes
    out[1] = _launch(outdir, 1, "resume")
    out[3] = _launch(outdir, 3, "resume")
    return out


def _differences(run: dict[str, Any], reference: dict[str, Any], key: str) -> str | None:
    """Return what differs between resume ``key`` and the uninterrupted run, or ``None``."""
    got = run[key]
    if "error" in got:
        return f"{key}: {got['error'][:400]}"
    wrong = [
        name for name, value in reference["saved"].items() if not torch.equal(got["loaded"][name], value)
    ]
    if wrong:
        return f"{key}: loaded weights differ: {wrong}"
    if "losses" not in got:
        return None
    loss = max(abs(a - b) for a, b in zip(got["losses"], reference["losses"][-2:]))
    weight = max((got["weights"][n] - v).abs().max().item() for n, v in reference["weights"].items())
    if loss > TOL or weight > TOL:
        return f"{key}: 2 more steps differ by {loss:.2e} (loss), {weight:.2e} (weights)"
    return None


def _resumes(runs: dict[int, dict[str, Any]], *, world: int | None = None, match: str = "") -> list[str]:
    reference = runs[2]["reference"]
    failures, checked = [], 0
    for size, run in runs.items():
        if world is not None and size != world:
            continue
        for key in run:
            if key.startswith("resume ") and match in key:
                checked += 1
                failure = _differences(run, reference, key)
                if failure is not None:
                    failures.append(f"{size} ranks, {failure}")
    assert checked, f"no resume matched {match!r}"
    return failures


@pytest.mark.slow
def test_dcp_state_dict_module_is_wrapped_when_imported_after_the_library(runs):
    """The launched script imports flatten_parametrize first, DCP after: the post-import wrap ran."""
    assert [run["dcp imported before"] for run in runs.values()] == [False, False, False]
    assert [run["wrapped"] for run in runs.values()] == [True, True, True]
    assert all(run["library"].startswith(str(ROOT)) for run in runs.values())


@pytest.mark.slow
def test_every_setup_trains_like_the_plain_model_before_its_checkpoint(runs):
    reference = runs[2]["reference"]["losses"][:3]
    for key, losses in runs[2].items():
        if key.startswith("trained "):
            assert max(abs(a - b) for a, b in zip(losses, reference)) <= TOL, key


@pytest.mark.slow
def test_sharded_optimizer_resumes_adam_moments_through_get_state_dict(runs):
    """Issue 19.1: ZeRO-1/2 resumed with dcp.load of get_state_dict restarted Adam (3.5e-3 off); now not."""
    assert _resumes(runs, match="zero") == []


@pytest.mark.slow
def test_set_state_dict_loads_a_ddp_wrapped_flattened_model(runs):
    """Issue 19.2: set_state_dict under DDP raised ``Missing key: flat_param_0``; now it resumes."""
    assert _resumes(runs, world=2, match="-> flat-ddp") == []


@pytest.mark.slow
def test_attached_optimizer_checkpoints_through_get_state_dict(runs):
    """Issue 19.3: get_state_dict of an attached optimizer raised ``KeyError: 1``; now it resumes."""
    assert _resumes(runs, match="attached") == []


@pytest.mark.slow
def test_optimizer_state_in_a_checkpoint_is_keyed_like_the_plain_models(runs):
    """Issue 19.4: the flattened setups write the plain model's 12 optimizer tensors, by its names."""
    plain = runs[2]["tensors plain-ddp"]["keys"]
    assert len(plain) == 12 and "app.optim.state.0.weight.exp_avg" in plain
    for key, tensors in runs[2].items():
        if key.startswith("tensors ") and "fsdp2" not in key:
            assert tensors["keys"] == plain, key
    assert runs[2]["tensors flat-fsdp2"]["keys"] == runs[2]["tensors plain-fsdp2"]["keys"] == plain


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 1, 3])
def test_every_checkpoint_resumes_across_forms_and_engines_like_the_uninterrupted_run(runs, world):
    """Weights torch.equal after load; 2 more steps give the uninterrupted losses and weights (1e-6)."""
    assert _resumes(runs, world=world) == []


@pytest.mark.slow
def test_broadcast_from_rank0_loads_fsdp2_model_and_optimizer_in_either_form(runs):
    """full_state_dict=True, broadcast_from_rank0=True: rank 0's full dicts resume either form under FSDP2
    (strict both ways; the other ranks given empty dicts, or zeros that the broadcast overwrites)."""
    keys = [k for k in runs[2] if "broadcast_from_rank0" in k]
    assert len(keys) == 8
    assert _resumes(runs, world=2, match="broadcast_from_rank0") == []


@pytest.mark.slow
def test_broadcast_from_rank0_refusal_raises_on_every_rank(runs):
    """A rank-0 dict that cannot become one flat state raises on every rank, not on rank 0 alone (a hang)."""
    errors = runs[2]["broadcast refused"]
    assert len(errors) == 2
    assert all(e.startswith("ValueError: ") and "needs equal scalar optimizer state" in e for e in errors)
    assert "set_state_dict failed on rank 0, so on every rank" in errors[1]


@pytest.mark.slow
def test_dcp_of_model_state_dict_loads_in_place_across_forms(runs):
    """dcp.save(model.state_dict()) / dcp.load into model.state_dict(): the views take the values."""
    reference = runs[2]["reference"]
    for run in runs.values():
        keys = [k for k in run if k.startswith("weights ")]
        assert len(keys) == 4
        assert [_differences(run, reference, k) for k in keys] == [None] * 4


# ------------------------------------------------------------------------- single process (1 rank)


def _adam_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("top_level", [False, True])
@pytest.mark.parametrize("wrap", ["none", "ddp", "compile", "checkpoint"])
def test_dcp_maps_each_flattened_name_as_for_the_plain_model(world1, wrap, top_level):
    """DCP's name mapping (``_get_fqns``, which the library answers without reading the view) gives the
    plain model's names, with and without the wrappers' prefixes, for nested and top-level names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint import state_dict as dsd

    def build(flat: bool) -> nn.Module:
        torch.manual_seed(0)
        inner: nn.Module = nn.Linear(3, 2) if top_level else nn.Sequential(mlp(), nn.Linear(3, 2))
        if wrap == "checkpoint" and not top_level:
            inner[1] = checkpoint_wrapper(inner[1])
        if flat:
            register_flat_storage(inner)
        if wrap == "ddp":
            return DistributedDataParallel(inner)
        return torch.compile(inner) if wrap == "compile" else inner

    plain, model = build(False), build(True)
    names = list(plain.state_dict())
    assert names == list(model.state_dict()) and len(names) == (2 if top_level else 8)
    for options in ({}, {"skip_ddp_prefix": False, "skip_compiler_prefix": False}):
        assert [dsd._get_fqns(model, n, **options) for n in names] == [
            dsd._get_fqns(plain, n, **options) for n in names
        ]


def test_sharded_optimizer_state_is_empty_until_the_first_step(world1):
    """As a torch optimizer's: DCP's _init_optim_state takes a non-empty ``state`` for an initialized one."""
    model = mlp()
    storage = register_flat_storage(model)
    opt = ShardedOptimizer(storage, torch.optim.Adam, lr=0.1)
    assert dict(opt.state) == {}
    _adam_steps(model, opt, range(1))
    assert set(opt.state[storage["0"]]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("kind", ["plain", "attached", "sharded"])
def test_get_state_dict_of_a_fresh_flattened_optimizer_has_the_plain_models_entries(world1, kind):
    """A fresh optimizer's get_state_dict has every plain entry (what dcp.load fills), weights unchanged."""
    plain = mlp()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.1)
    model = mlp()
    storage = register_flat_storage(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if kind == "sharded":
        opt: torch.optim.Optimizer = ShardedOptimizer(storage, torch.optim.Adam, lr=0.1)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        if kind == "attached":
            storage.attach_optimizer(opt)
    _, expected = get_state_dict(plain, plain_opt)
    _, got = get_state_dict(model, opt)
    assert {k: sorted(v) for k, v in got["state"].items()} == {
        k: sorted(v) for k, v in expected["state"].items()
    }
    for name, entry in got["state"].items():
        assert entry["exp_avg"].shape == expected["state"][name]["exp_avg"].shape
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("flatten", [False, True])
def test_plain_and_flat_optimizer_state_dicts_of_dcp_convert_both_ways(world1, tmp_path, flatten):
    """get_state_dict of the plain model loads into the flattened one under DDP and back: same 2 steps."""
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    runs = {}
    for src, dst in [("plain", "flat"), ("flat", "plain")]:
        models = {}
        for form in (src, dst):
            model = mlp()
            if form == "flat":
                register_flat_storage(model)
            wrapped = DistributedDataParallel(model)
            models[form] = (wrapped, torch.optim.Adam(wrapped.parameters(), lr=0.1))
        _adam_steps(*models[src], range(3))
        path = tmp_path / f"{src}-{flatten}"
        msd, osd = get_state_dict(*models[src], options=options)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
        msd, osd = get_state_dict(*models[dst], options=options)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            *models[dst], model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )
        runs[(src, dst)] = (_adam_steps(*models[src], range(3, 5)), _adam_steps(*models[dst], range(3, 5)))
    for key, (uninterrupted, resumed) in runs.items():
        assert resumed == uninterrupted, key


def test_set_state_dict_refuses_unequal_step_counts_within_a_flat_group(world1):
    """A plain checkpoint whose members were stepped differently cannot be one flat state: ValueError."""
    plain = mlp()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.1)
    _adam_steps(plain, plain_opt, range(1))
    _, osd = get_state_dict(plain, plain_opt)
    osd["state"]["0.bias"]["step"] = osd["state"]["0.bias"]["step"] + 1
    model = mlp()
    register_flat_storage(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _, fresh = get_state_dict(model, opt)
    before = {k: v.clone() for k, v in fresh["state"]["0.weight"].items()}
    with pytest.raises(ValueError, match=r"equal scalar optimizer state within a flat group; state 'step'"):
        set_state_dict(
            model, opt, model_state_dict={}, optim_state_dict=osd, options=StateDictOptions(strict=False)
        )
    _, after = get_state_dict(model, opt)
    assert all(torch.equal(after["state"]["0.weight"][k], v) for k, v in before.items())


def test_set_state_dict_strict_names_the_missing_plain_parameter(world1):
    """strict: a member of a flat group without state is reported by its plain name, as torch does."""
    plain = mlp()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.1)
    _adam_steps(plain, plain_opt, range(1))
    _, osd = get_state_dict(plain, plain_opt)
    del osd["state"]["2.bias"]
    model = mlp()
    register_flat_storage(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"Missing optimizer state for parameter '2\.bias'"):
        set_state_dict(
            model, opt, model_state_dict={}, optim_state_dict=osd, options=StateDictOptions(strict=True)
        )
    set_state_dict(
        model, opt, model_state_dict={}, optim_state_dict=osd, options=StateDictOptions(strict=False)
    )
    flat = opt.state[model.flat_param_0]
    assert int(flat["step"]) == 1
