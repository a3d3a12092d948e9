"""FSDP2 state dicts and distributed checkpoints of a flattened model, against the plain twin under FSDP2.

Two launches with the real launcher (``python -m torch.distributed.run``, gloo on 127.0.0.1) of
``tests/_fsdp2_checkpoints.py`` on one directory: ``train`` on 2 ranks (state-dict values after training,
checkpoints written three ways and loaded on 2 ranks), then ``load`` on 1 rank (the same checkpoints
loaded under FSDP2 on one rank and without FSDP).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flatten_parametrize import register_flat_storage

from _gloo_pool import free_port

TESTS = Path(__file__).resolve().parents[1]  # tests/: the launched script lives there
ROOT = TESTS.parent
GETTERS = ["model.state_dict()", "get_model_state_dict", "get_model_state_dict, full", "flat_state_dict()"]
MODES = ["grad", "no_grad", "inference_mode"]
FORMS = ["plain", "flat"]
HOWS = ["load_state_dict", "set_model_state_dict", "full", "broadcast_from_rank0"]
TOL = {"rtol": 0.0, "atol": 1e-6}


def _launch(mode: str, nproc: int, outdir: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(TESTS / "_fsdp2_checkpoints.py"), mode, str(outdir),
    ]  # fmt: skip
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    if done.returncode != 0:
        errors = "\n".join(p.read_text() for p in sorted(outdir.glob(f"{mode}.*.err")))
        # the ranks' own tracebacks, then the launcher's summary (a rank killed by a signal writes none)
        report = f"{errors}\n--- launcher ---\n{done.stderr[-3000:]}"
        pytest.fail(f"the {nproc} {mode} process(es) failed (exit {done.returncode}):\n{report}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    outdir = tmp_path_factory.mktemp("fsdp2_checkpoints")
    _launch("train", 2, outdir)
    _launch("load", 1, outdir)
    names = {"values": 2, "checkpoints": 2, "load": 1}
    return {
        name: [torch.load(outdir / f"{name}.{rank}.pt", weights_only=False) for rank in range(world)]
        for name, world in names.items()
    }


def _unflattened(entries: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The plain-named full values of a state dict (a ``flat_state_dict()`` split by the layout)."""
    if "flat_param_0" not in entries:
        return {key: entry["full"] for key, entry in entries.items()}
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 3))
    storage = register_flat_storage(model)
    flat = entries["flat_param_0"]["full"]
    return {
        info.name: flat[info.offset : info.offset + info.numel].view(info.shape)
        for info in storage.param_infos
    }


# ------------------------------------------------------------------- values after training (issue 6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("getter", GETTERS)
def test_fsdp2_state_dict_values_follow_training_in_every_grad_mode(runs, getter, mode):
    """After 3 steps (state dicts taken after step 1 too), every way and grad mode gives the plain twin's
    trained weights; where the plain model's raises (a DTensor refuses detach() under inference_mode),
    the flattened model's gives those weights or raises the same error."""
    for result in runs["values"]:
        trained = result["plain, trained"]
        taken = result[f"flat, {getter}, {mode}"]
        plain = result.get(f"plain, {getter}, {mode}")
        if isinstance(taken, str):
            assert isinstance(plain, str) and taken == plain
            continue
        got = _unflattened(taken)
        assert sorted(got) == sorted(trained)
        for key, value in trained.items():
            torch.testing.assert_close(got[key], value, **TOL, msg=key)


@pytest.mark.slow
def test_fsdp2_flat_model_trains_like_the_plain_model(runs):
    for result in runs["values"]:
        for key, value in result["plain, trained"].items():
            torch.testing.assert_close(result["flat, trained"][key], value, **TOL, msg=key)


@pytest.mark.slow
def test_fsdp2_inference_mode_state_dict_works_where_the_plain_models_raises(runs):
    """model.state_dict() and flat_state_dict() under inference_mode: values (torch refuses the plain one)."""
    for result in runs["values"]:
        assert (
            "Cannot set version_counter for inference tensor"
            in result["plain, model.state_dict(), inference_mode"]
        )
        assert not isinstance(result["flat, model.state_dict(), inference_mode"], str)
        assert not isinstance(result["flat, flat_state_dict(), inference_mode"], str)


# ------------------------------------------------------------------------- sharding (issue 7)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grad", "no_grad"])
@pytest.mark.parametrize("getter", ["model.state_dict()", "get_model_state_dict"])
def test_fsdp2_state_dict_values_are_sharded_like_the_plain_models(runs, getter, mode):
    """Each name a Shard(0) DTensor over the plain model's mesh holding its local rows: its bytes per rank."""
    for result in runs["values"]:
        plain, flat = result[f"plain, {getter}, {mode}"], result[f"flat, {getter}, {mode}"]
        assert list(flat) == list(plain)
        for key, entry in plain.items():
            assert entry["placements"] == ("S(0)",)
            for field in ("placements", "local shape", "local bytes", "mesh"):
                assert flat[key][field] == entry[field], (key, field)
            assert torch.equal(flat[key]["full"], entry["full"]), key
        assert sum(e["local bytes"] for e in flat.values()) == sum(e["local bytes"] for e in plain.values())


@pytest.mark.slow
def test_fsdp2_full_state_dict_has_plain_tensors_of_the_plain_shapes(runs):
    for result in runs["values"]:
        plain, flat = (
            result["plain, get_model_state_dict, full, grad"],
            result["flat, get_model_state_dict, full, grad"],
        )
        assert list(flat) == list(plain)
        for key, entry in plain.items():
            assert flat[key]["placements"] is None and flat[key]["local shape"] == entry["local shape"]


@pytest.mark.slow
def test_fsdp2_flat_state_dict_is_fsdp2s_shard_of_the_flat_buffer(runs):
    """flat_state_dict(): the flat parameter as FSDP2 holds it (Shard(0), torch.chunk's piece of it)."""
    for rank, result in enumerate(runs["values"]):
        entry = result["flat, flat_state_dict(), grad"]["flat_param_0"]
        numel = entry["full"].numel()
        step = math.ceil(numel / 2)
        assert entry["placements"] == ("S(0)",)
        assert entry["local shape"] == (min(numel, (rank + 1) * step) - rank * step,)


@pytest.mark.slow
def test_fsdp2_state_dict_moves_each_element_once_and_loads_without_gathering(runs):
    """Saving: one all_to_all_single per group, each rank sending at most its shard of the buffer (no
    full_tensor); loading those values back: the same exchange reversed, each rank sending its rows; the
    plain model's needs neither."""
    for result in runs["values"]:
        numel = result["flat, flat_state_dict(), grad"]["flat_param_0"]["full"].numel()
        for traffic in ("saving", "loading"):
            assert result[f"plain, {traffic} traffic"] == {
                "all_to_all": 0, "sent": 0, "sent to itself": 0, "full_tensor": 0,
            }  # fmt: skip
            flat = result[f"flat, {traffic} traffic"]
            assert flat["all_to_all"] == 1 and flat["full_tensor"] == 0
        rows = sum(e["local bytes"] for e in result["plain, model.state_dict(), grad"].values()) // 4
        assert result["flat, saving traffic"]["sent"] <= math.ceil(numel / 2)  # at most its buffer shard
        assert result["flat, loading traffic"]["sent"] == rows  # exactly its rows
        for key, value in result["flat, trained"].items():
            assert torch.equal(result["flat, loaded"][key], value), key


@pytest.mark.slow
def test_dcp_state_dict_calls_gather_and_scatter_no_more_than_for_the_plain_model(runs):
    """DCP maps each key to its attribute (reading it); a flattened attribute resolves without reading its
    view, which under FSDP2 would all-gather the whole group per key. What remains beyond the plain
    model's collectives is the library's exchange of rows (``alltoall``: one when DCP checks its options,
    one per state dict taken or loaded; each set call below takes one first)."""
    exchanges = {
        "get_model_state_dict": 2, "get_model_state_dict, full": 2,
        "set_model_state_dict": 5, "set_model_state_dict, full": 5,
    }  # fmt: skip
    for result in runs["values"]:
        plain, flat = result["plain, DCP collectives"], result["flat, DCP collectives"]
        assert set(plain) == set(flat) == {
            "get_model_state_dict", "get_model_state_dict, full",
            "set_model_state_dict", "set_model_state_dict, full",
        }  # fmt: skip
        assert plain["get_model_state_dict, full"]  # the counter sees DTensor's gathers
        for call, counts in plain.items():
            others = {op: n for op, n in flat[call].items() if "alltoall" not in op}
            assert others == counts, call
            assert flat[call].get("c10d.alltoall_base_", 0) == exchanges[call], call


@pytest.mark.slow
def test_fsdp2_state_dict_values_are_freed_with_the_state_dict(runs):
    """The library keeps no reference to the values it made: dropping the state dict frees them."""
    for result in runs["values"]:
        assert result["plain, freed with its state dict"] and result["flat, freed with its state dict"]


# ------------------------------------------------------------------------------ checkpoints


@pytest.mark.slow
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("dst", FORMS)
@pytest.mark.parametrize("src", FORMS)
def test_fsdp2_checkpoint_resumes_on_2_ranks_in_either_form(runs, src, dst, how):
    """Saved at step 3 on 2 ranks, loaded on 2: the saved weights exactly (the plain model's load too),
    then 2 steps give the uninterrupted run's losses and weights."""
    for result in runs["checkpoints"]:
        run, plain = result[f"{src} -> {dst}, {how}"], result[f"{src} -> plain, {how}"]
        uninterrupted = result[f"{src}, uninterrupted"]
        for key, value in result[f"{src}, saved"].items():
            assert torch.equal(run["loaded"][key], value), key
            assert torch.equal(run["loaded"][key], plain["loaded"][key]), key
        assert run["losses"] == pytest.approx(uninterrupted["losses"], abs=1e-6)
        for key, value in uninterrupted["weights"].items():
            torch.testing.assert_close(run["weights"][key], value, **TOL, msg=key)


@pytest.mark.slow
def test_fsdp2_both_forms_save_the_same_checkpoint_values(runs):
    for result in runs["checkpoints"]:
        for key, value in result["plain, saved"].items():
            torch.testing.assert_close(result["flat, saved"][key], value, **TOL, msg=key)
        assert result["flat, uninterrupted"]["losses"] == pytest.approx(
            result["plain, uninterrupted"]["losses"], abs=1e-6
        )


@pytest.mark.slow
@pytest.mark.parametrize("how", [*HOWS, "no FSDP, state_dict", "no FSDP, sharded", "no FSDP, full"])
@pytest.mark.parametrize("dst", FORMS)
@pytest.mark.parametrize("src", FORMS)
def test_fsdp2_checkpoint_of_2_ranks_resumes_on_1_rank_in_either_form(runs, src, dst, how):
    """Loaded on 1 rank (FSDP2 on one rank, or no FSDP): the saved weights exactly; 2 steps on both ranks'
    batches give the uninterrupted 2-rank run's weights and the mean of its ranks' losses."""
    saved = runs["checkpoints"][0][f"{src}, saved"]
    uninterrupted = [result[f"{src}, uninterrupted"] for result in runs["checkpoints"]]
    run, plain = runs["load"][0][f"{src} -> {dst}, {how}"], runs["load"][0][f"{src} -> plain, {how}"]
    for key, value in saved.items():
        assert torch.equal(run["loaded"][key], value), key
        assert torch.equal(run["loaded"][key], plain["loaded"][key]), key
    mean = [sum(u["losses"][i] for u in uninterrupted) / 2 for i in range(2)]
    assert run["losses"] == pytest.approx(mean, abs=1e-6)
    for key, value in uninterrupted[0]["weights"].items():
        torch.testing.assert_close(run["weights"][key], value, **TOL, msg=key)
