"""Engines composed around a flattened model, each against the plain twin under the same engine.

- record-less flat state dicts (what DeepSpeed's ``zero_to_fp32`` and fairscale's wrapper write):
  they load when size and dtype match, with one warning; a mismatch is refused (``test_errors.py``);
- FSDP2 applied after registration, then ``.to()`` / ``.double()`` / ``to_empty()``, and its state
  dicts loaded across forms (2 gloo ranks);
- Lightning's ``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model`` on 2 CPU
  processes: training, and resuming its distributed checkpoint (``tests/_model_parallel.py``);
- DeepSpeed ZeRO-1 and -2 on its CPU accelerator (2 gloo ranks): training, ``save_checkpoint`` /
  ``load_checkpoint``, and the consolidated weights of ``get_fp32_state_dict_from_zero_checkpoint``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage, weight_decay_groups

from _gloo_pool import free_port
from _helpers import assert_unchanged, mlp, save_result, snapshot, spawn_gloo, values

TESTS = Path(__file__).resolve().parents[1]  # tests/: the launched scripts live there
ROOT = TESTS.parent


def _net(seed: int = 0) -> nn.Sequential:
    """Two layers and a BatchNorm (buffers beside the flat parameter)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _with_stats(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        model(torch.randn(5, 6) * 3)  # running stats of its own
    return model


def _load_recording(model: nn.Module, state_dict: dict[str, Any], **kwargs: Any) -> tuple[Any, list[Any]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = model.load_state_dict(state_dict, **kwargs)
    return result, [w for w in caught if issubclass(w.category, UserWarning)]


# ------------------------------------------------------------------ record-less flat state dicts


def _fairscale_style(plain: nn.Module) -> dict[str, torch.Tensor]:
    """What fairscale's ``FlattenParamsWrapper.flat_state_dict()`` writes: one flat tensor, buffers."""
    flat = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
    return {"flat_param_0": flat, **{k: v.clone() for k, v in plain.named_buffers()}}


def _real_fairscale(plain: nn.Module) -> dict[str, torch.Tensor]:
    from fairscale.nn.misc import FlattenParamsWrapper  # the test extra has it: never skipped

    wrapper = FlattenParamsWrapper(_with_stats(_net(1)))
    wrapper.load_state_dict(plain.state_dict())
    return {k: v.clone() for k, v in wrapper.flat_state_dict().items()}


@pytest.mark.parametrize("source", ["fairscale-shaped", "fairscale"])
def test_fairscale_flat_dict_loads_into_the_flattened_model_with_one_warning(source):
    """A record-less flat dict whose size and dtype match: the plain model's values, one UserWarning."""
    plain = _with_stats(_net(1))
    sd = _fairscale_style(plain) if source == "fairscale-shaped" else _real_fairscale(plain)
    assert "flat_layout_0" not in sd
    model = _net(0)
    register_flat_storage(model)
    result, caught = _load_recording(model, sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "'flat_param_0'" in message and "the layout could not be checked" in message
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_zero_to_fp32_shaped_dict_of_several_groups_warns_once_naming_each():
    """zero_to_fp32's output for a model in decay/no-decay groups: one warning per load, naming each entry."""
    source = _with_stats(_net(1))
    expected = values(source)
    storage = register_flat_storage(source, weight_decay_groups(source))
    sd = {k: v.clone() for k, v in storage.flat_state_dict().items() if not k.startswith("flat_layout_")}
    entries = [k for k in sd if k.startswith("flat_param_")]
    assert len(entries) >= 2
    model = _net(0)
    register_flat_storage(model, weight_decay_groups(model))
    for _ in range(2):  # each load warns again: every record-less load is worth knowing about
        _, caught = _load_recording(model, dict(sd))
        assert len(caught) == 1
        assert ", ".join(f"'{k}'" for k in entries) in str(caught[0].message)
    for key, value in expected.items():
        assert torch.equal(model.state_dict()[key], value), key


def test_record_less_load_keeps_strict_and_atomicity():
    """strict reports a missing buffer by its name and changes nothing; strict=False loads the rest."""
    plain = _with_stats(_net(1))
    sd = _fairscale_style(plain)
    del sd["1.running_var"]
    model = _net(0)
    register_flat_storage(model)
    snap = snapshot(model)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "1.running_var"'):
        model.load_state_dict(sd)
    assert_unchanged(model, snap)
    result, caught = _load_recording(model, sd, strict=False)
    assert result.missing_keys == ["1.running_var"] and len(caught) == 1
    assert torch.equal(model[0].weight, plain[0].weight)


def test_a_flat_dict_with_its_record_loads_without_warning():
    """The library's own flat form keeps its layout check and stays silent."""
    source = _with_stats(_net(1))
    sd = register_flat_storage(source).flat_state_dict()
    model = _net(0)
    register_flat_storage(model)
    _, caught = _load_recording(model, sd)
    assert caught == []


# ------------------------------------------------------------------------------- FSDP2 (2 ranks)


def _fsdp2_worker(rank: int, world: int, outdir: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    def build(flat: bool, seed: int = 0, align: int = 1) -> nn.Module:
        model = mlp(depth=3, width=6, seed=seed)
        if flat:
            register_flat_storage(model, align=align)
        fully_shard(model)
        return model

    def full(model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}

    out: dict[str, Any] = {}
    for flat in (False, True):  # .to() then .double() after fully_shard, then training
        model = build(flat, align=4)
        model.to("cpu")
        model.double()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        for step in range(3):
            generator = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(4, 6, dtype=torch.float64, generator=generator)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        out[f"double, flat={flat}"] = full(model)
        if flat:
            storage = get_flat_storage(model)
            assert storage is not None
            out["flattened"] = {
                "registered": type(model.flat_param_0).__name__,
                "dtype": model.flat_param_0.dtype,
                "view": model[0].weight.dtype,
                "storage": [p.dtype for p in storage.flat_params],
            }
    model = build(True, align=16)  # to_empty() after fully_shard: the local shard's padding is zeroed
    storage = get_flat_storage(model)
    assert storage is not None
    torch.full((4096,), float("nan")).sum()  # leave NaNs in freed memory for to_empty to pick up
    model.to_empty(device="cpu")
    numel = model.flat_param_0.shape[0]
    padding = torch.ones(numel, dtype=torch.bool)
    for info in storage.param_infos:
        padding[info.offset : info.offset + info.numel] = False
    local = model.flat_param_0.to_local().detach()
    start = rank * math.ceil(numel / world)  # FSDP2 shards dim 0 in torch.chunk's pieces
    out["padding"] = local[padding[start : start + local.numel()]].clone()
    for src in (False, True):  # state dicts across forms, both ways of loading them
        for dst in (False, True):
            for how in ("load_state_dict", "set_model_state_dict"):
                a, b = build(src, seed=1), build(dst, seed=2)
                sd = get_model_state_dict(a)
                if how == "load_state_dict":
                    b.load_state_dict(sd)
                else:
                    set_model_state_dict(b, sd)
                out[f"{how}, flat={src} -> flat={dst}"] = (full(a), full(b))
    save_result(outdir, rank, "fsdp2", out)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    outdir = tmp_path_factory.mktemp("fsdp2")
    spawn_gloo(_fsdp2_worker, outdir, world=2)
    return [torch.load(outdir / f"fsdp2.{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.slow
def test_fsdp2_then_to_and_double_trains_like_the_plain_model(fsdp2):
    """register, fully_shard, .to("cpu"), .double(), 3 AdamW steps: the plain twin's weights; DTensor kept."""
    for result in fsdp2:
        plain, flat = result["double, flat=False"], result["double, flat=True"]
        assert list(flat) == list(plain)
        for key, value in plain.items():
            assert value.dtype == torch.float64
            torch.testing.assert_close(flat[key], value, rtol=1e-6, atol=1e-6, msg=key)
        assert result["flattened"] == {
            "registered": "DTensor",  # FSDP2's sharded parameter stays FSDP2's
            "dtype": torch.float64,
            "view": torch.float64,
            "storage": [torch.float64],
        }


@pytest.mark.slow
def test_fsdp2_then_to_empty_zeroes_the_padding_of_each_local_shard(fsdp2):
    for result in fsdp2:
        assert result["padding"].numel() > 0
        assert torch.equal(result["padding"], torch.zeros_like(result["padding"]))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["load_state_dict", "set_model_state_dict"])
@pytest.mark.parametrize(("src", "dst"), [(False, True), (True, False), (True, True)])
def test_fsdp2_state_dicts_load_across_forms(fsdp2, how, src, dst):
    """get_model_state_dict of one form loads into the other under FSDP2: the same full weights."""
    for result in fsdp2:
        saved, loaded = result[f"{how}, flat={src} -> flat={dst}"]
        assert list(saved) == list(loaded)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key


# ------------------------------------------------------------ Lightning ModelParallelStrategy


def _outer(seed: int = 0) -> nn.Module:
    """A flattenable body between two ordinary layers; its biases stay ordinary when only weights are flat."""
    torch.manual_seed(seed)
    model = nn.Module()
    model.pre, model.body, model.post = nn.Linear(2, 4), mlp(depth=2, width=4, seed=seed), nn.Linear(4, 2)
    return model


def test_fsdp_rekey_optim_state_dict_numbers_a_flattened_model_like_the_plain_one():
    """FSDP.rekey_optim_state_dict (Lightning's full checkpoint calls it): the plain model's ids and names."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    plain, flat = _outer(), _outer()
    register_flat_storage(flat.body, ["*.weight"])  # biases interleave as ordinary parameters
    opt = torch.optim.Adam(plain.parameters(), lr=0.1)
    plain.post(plain.body(plain.pre(torch.randn(3, 2)))).sum().backward()
    opt.step()
    by_id = opt.state_dict()
    by_name = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, plain)
    assert list(by_name["state"])[:3] == ["pre.weight", "pre.bias", "body.0.weight"]
    for key_type, osd in ((OptimStateKeyType.PARAM_ID, by_name), (OptimStateKeyType.PARAM_NAME, by_id)):
        expected = FSDP.rekey_optim_state_dict(osd, key_type, plain)
        got = FSDP.rekey_optim_state_dict(osd, key_type, flat)
        assert list(got["state"]) == list(expected["state"])
        assert all(got["state"][k] is v for k, v in expected["state"].items())
        assert got["param_groups"] == expected["param_groups"]


def test_fsdp_rekey_optim_state_dict_names_a_parameter_the_flattened_model_lacks():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    flat = _outer()
    register_flat_storage(flat.body)
    osd = {"state": {"body.9.weight": {}}, "param_groups": [{"lr": 0.1, "params": ["body.9.weight"]}]}
    with pytest.raises(KeyError, match=r"'body.9.weight' is none of its 8 parameters \(pre.weight, pre.bias"):
        FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_ID, flat)


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    outdir = tmp_path_factory.mktemp("model_parallel")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(TESTS / "_model_parallel.py"), str(outdir),
    ]  # fmt: skip
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    results = [outdir / f"result{rank}.pt" for rank in range(2)]
    if done.returncode != 0 or not all(p.exists() for p in results):
        pytest.fail(f"the 2 Lightning processes failed (exit {done.returncode}):\n{done.stderr[-6000:]}")
    return [torch.load(p, weights_only=False) for p in results]


@pytest.mark.slow
def test_model_parallel_strategy_trains_a_flattened_model_like_the_plain_one(model_parallel):
    """fully_shard in configure_model, then the strategy's .to(device): 6 AdamW steps, the plain weights."""
    for result in model_parallel:
        plain, flat = result["plain 6"], result["flat 6"]
        assert flat["steps"] == plain["steps"] == [(s, s % 2) for s in range(6)]
        for key, value in plain["weights"].items():
            torch.testing.assert_close(flat["weights"][key], value, rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["plain", "flat"])
def test_model_parallel_strategy_resumes_its_distributed_checkpoint(model_parallel, form):
    """Resumed from the step-4 distributed checkpoint, 2 more steps give the uninterrupted run's weights."""
    for result in model_parallel:
        resumed, uninterrupted = result[f"{form} resumed"], result[f"{form} 6"]
        assert resumed["steps"] == [(4, 0), (5, 1)]
        for key, value in uninterrupted["weights"].items():
            torch.testing.assert_close(resumed["weights"][key], value, rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.slow
def test_model_parallel_strategy_single_file_checkpoint_of_a_flattened_model_is_the_plain_one(model_parallel):
    """save_distributed_checkpoint=False: the plain model's keys, optimizer state by the plain positions."""
    for result in model_parallel:
        plain, flat = result["plain full file"], result["flat full file"]
        assert list(flat["state_dict"]) == list(plain["state_dict"]) == [
            "model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias",
        ]  # fmt: skip
        for key, value in plain["state_dict"].items():
            torch.testing.assert_close(flat["state_dict"][key], value, rtol=1e-6, atol=1e-6, msg=key)
        (plain_osd,), (flat_osd,) = plain["optimizer_states"], flat["optimizer_states"]
        assert list(flat_osd["state"]) == list(plain_osd["state"]) == [0, 1, 2, 3]
        assert flat_osd["param_groups"] == plain_osd["param_groups"]
        for index, state in plain_osd["state"].items():
            assert list(flat_osd["state"][index]) == list(state)
            for key, value in state.items():
                torch.testing.assert_close(flat_osd["state"][index][key], value, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["plain", "flat"])
@pytest.mark.parametrize("form", ["plain", "flat"])
def test_model_parallel_strategy_resumes_a_single_file_checkpoint_across_forms(model_parallel, source, form):
    """Resumed from the step-4 single file of either form, 2 more steps give the plain uninterrupted run."""
    for result in model_parallel:
        resumed, uninterrupted = result[f"{source} full -> {form}"], result["plain 6"]
        assert resumed["steps"] == [(4, 0), (5, 1)]
        for key, value in uninterrupted["weights"].items():
            torch.testing.assert_close(resumed["weights"][key], value, rtol=1e-6, atol=1e-6, msg=key)


# ---------------------------------------------------------------------- DeepSpeed (2 CPU ranks)

DS_CONFIGS = [(1, "deepspeed"), (1, "torch"), (2, "deepspeed"), (2, "torch")]


def _deepspeed_worker(rank: int, world: int, outdir: Path) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    deepspeed.init_distributed(dist_backend="gloo")

    def engine(flat: bool, stage: int, optimizer: str) -> Any:
        model = _net(0)
        # Running stats the same on every rank: DeepSpeed saves rank 0's buffers and loads them everywhere.
        model[1].momentum = 0.0
        if flat:
            register_flat_storage(model)
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": 0.5,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
        }
        opt = None
        if optimizer == "deepspeed":
            config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.01}}
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        wrapped, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), optimizer=opt, config=config
        )
        return wrapped

    def train(wrapped: Any, steps: range) -> None:
        for step in steps:
            generator = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)
            wrapped.backward(nn.functional.mse_loss(wrapped(x), y))
            wrapped.step()

    out: dict[str, Any] = {}
    for stage, optimizer in DS_CONFIGS:
        for flat in (False, True):
            name = f"stage {stage}, {optimizer}, {'flat' if flat else 'plain'}"
            directory = outdir / name.replace(", ", "-").replace(" ", "")
            wrapped = engine(flat, stage, optimizer)
            train(wrapped, range(3))
            wrapped.save_checkpoint(str(directory), tag="step3")
            run = {"3": values(wrapped.module), "dir": directory}
            train(wrapped, range(3, 5))
            run["5"] = values(wrapped.module)
            resumed = engine(flat, stage, optimizer)
            resumed.load_checkpoint(str(directory), tag="step3")
            train(resumed, range(3, 5))
            run["resumed"] = values(resumed.module)
            torch.distributed.barrier()
            if rank == 0:
                run["fp32"] = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag="step3")
                states = torch.load(directory / "step3" / "mp_rank_00_model_states.pt", weights_only=False)
                run["module"] = states["module"]
            out[name] = run
    for flat in (False, True):  # a checkpoint of the other form, stage 1, DeepSpeed's AdamW
        other = out[f"stage 1, deepspeed, {'plain' if flat else 'flat'}"]["dir"]
        wrapped = engine(flat, 1, "deepspeed")
        try:
            wrapped.load_checkpoint(str(other), tag="step3")
            refused = None
        except RuntimeError as error:
            refused = str(error)
        wrapped = engine(flat, 1, "deepspeed")
        wrapped.load_checkpoint(str(other), tag="step3", load_module_only=True)
        out[f"cross, flat={flat}"] = {"refused": refused, "module only": values(wrapped.module)}
    save_result(outdir, rank, "deepspeed", out)


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    outdir = tmp_path_factory.mktemp("deepspeed")
    # The first run on a machine builds DeepSpeed's CPU ops (shared-memory comm, Adam) just in time.
    # Ranks of their own: DeepSpeed's init_distributed sets up its accelerator and comm for good.
    spawn_gloo(_deepspeed_worker, outdir, world=2, deadline_s=600, collective_timeout_s=300, fresh=True)
    return [torch.load(outdir / f"deepspeed.{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "optimizer"), DS_CONFIGS)
def test_deepspeed_zero_trains_and_resumes_like_the_plain_model(deepspeed_runs, stage, optimizer):
    """ZeRO-1/2, clipping, DeepSpeed's or torch's AdamW: the plain weights; each form resumes its own."""
    initial = values(_net(0))
    for result in deepspeed_runs:
        plain, flat = (result[f"stage {stage}, {optimizer}, {form}"] for form in ("plain", "flat"))
        for key, value in plain["5"].items():
            if key.endswith(("weight", "bias")):
                assert not torch.allclose(value, initial[key]), key
            torch.testing.assert_close(flat["5"][key], value, rtol=1e-6, atol=1e-6, msg=key)
            for run in (plain, flat):
                torch.testing.assert_close(run["resumed"][key], run["5"][key], rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "optimizer"), DS_CONFIGS)
def test_deepspeed_consolidated_weights_load_into_the_flattened_model(deepspeed_runs, stage, optimizer):
    """get_fp32_state_dict_from_zero_checkpoint of a flattened run: a record-less flat dict that loads
    (one warning) and gives, through state_dict(), the plain run's consolidated weights; the module
    entry beside the partitions has the plain keys and loads into a plain model."""
    plain, flat = (deepspeed_runs[0][f"stage {stage}, {optimizer}, {form}"] for form in ("plain", "flat"))
    assert "flat_param_0" in flat["fp32"] and "flat_layout_0" not in flat["fp32"]
    model = _net(5)
    register_flat_storage(model)
    _, caught = _load_recording(model, flat["fp32"])
    assert len(caught) == 1 and "'flat_param_0'" in str(caught[0].message)
    consolidated = model.state_dict()
    assert sorted(consolidated) == sorted(plain["fp32"])
    for key, value in plain["fp32"].items():
        torch.testing.assert_close(consolidated[key], value, rtol=1e-6, atol=1e-6, msg=key)
        assert torch.equal(consolidated[key], flat["3"][key]), key  # fp32 training: master = weights
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "flat_param_0"'):
        _net(5).load_state_dict(flat["fp32"])  # the plain model cannot take the flat entry
    plain_model = _net(5)
    plain_model.load_state_dict(flat["module"])
    for key, value in plain["3"].items():
        torch.testing.assert_close(plain_model.state_dict()[key], value, rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("flat", [False, True], ids=["flat ckpt -> plain", "plain ckpt -> flat"])
def test_deepspeed_refuses_to_resume_across_forms_but_loads_the_module_only(deepspeed_runs, flat):
    """DeepSpeed's parameter-alignment check refuses the other form's partitions; load_module_only works."""
    for result in deepspeed_runs:
        cross = result[f"cross, flat={flat}"]
        assert cross["refused"] is not None and "parameter-alignment" in cross["refused"]
        other = result[f"stage 1, deepspeed, {'plain' if flat else 'flat'}"]["3"]
        for key, value in other.items():
            torch.testing.assert_close(cross["module only"][key], value, rtol=1e-6, atol=1e-6, msg=key)
