"""Data-parallel gradient sync (``_distributed/grad_sync.py``) and buckets (``bucket_cap_mb``).

Argument checks and the hook machinery run in this process with a gloo world
of size 1. Training across ranks runs in 2 spawned gloo processes on
127.0.0.1: one launch runs every working scenario (the tests then read its
results), another checks that a failing rank does not hang the others.
"""

from __future__ import annotations

import copy
import math
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from flatten_parametrize import register_flat_storage, remove_flat_storage
from flatten_parametrize._distributed import grad_sync as _distributed

from _helpers import (
    assert_same_values,
    core_of,
    grads,
    launch_gloo,
    launch_results,
    mlp,
    save_result,
    train_steps,
    values,
)

# ------------------------------------------------------------------ launching


# --------------------------------------------------------- 2-rank scenarios


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _batch(seed: int, n: int = 8, width: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=gen), torch.randn(n, width, generator=gen)


def _train_on_halves(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    plain: nn.Module,
    ref: torch.optim.Optimizer,
    rank: int,
    world: int,
    steps: int = 3,
) -> slice:
    """Train ``model`` on this rank's share of each batch, ``plain`` on the whole batch; return the share."""
    per_rank = 8 // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        _mse(model(x[mine]), y[mine]).backward()
        opt.step()
        ref.zero_grad()
        _mse(plain(x), y).backward()
        ref.step()
    return mine


def _scenario_sync_training(rank: int, world: int) -> dict[str, Any]:
    plain = mlp(depth=3, width=6)
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model, bucket_cap_mb=200 / 2**20)  # several small buckets
    storage.broadcast_params()
    storage.enable_grad_sync()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    _train_on_halves(model, opt, plain, ref, rank, world)
    return {"synced": values(model), "plain": values(plain), "groups": len(storage.group_names)}


def _scenario_no_sync(rank: int, world: int) -> dict[str, Any]:
    plain = mlp(depth=2, width=6)
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)
    storage.enable_grad_sync()
    x, y = _batch(10)
    micro = [slice(rank * 4, rank * 4 + 2), slice(rank * 4 + 2, rank * 4 + 4)]
    with storage.no_sync():
        (_mse(model(x[micro[0]]), y[micro[0]]) / 2).backward()
    local = storage["0"].grad.clone()
    (_mse(model(x[micro[1]]), y[micro[1]]) / 2).backward()
    _mse(plain(x), y).backward()
    plain_grad = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    return {"local": local, "synced": storage["0"].grad.clone(), "plain": plain_grad}


class _TwoBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


def _scenario_unused_group(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _TwoBranch()
    plain = copy.deepcopy(model)
    storage = register_flat_storage(model, {"a": [model.a], "b": [model.b]})
    storage.enable_grad_sync()
    steps = []
    for step in range(2):  # the second backward runs with the learned launch order
        model.zero_grad()
        plain.zero_grad()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        for m in (model, plain):
            out = m.a(x)
            if rank == 0:
                out = out + m.b(x)
            out.sum().backward()
        local_b = None if rank else torch.cat([plain.b.weight.grad.reshape(-1), plain.b.bias.grad])
        steps.append({"a": storage["a"].grad.clone(), "b": storage["b"].grad.clone(), "local_b": local_b})
    return {"steps": steps}


def _scenario_broadcast(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = nn.Linear(3, 2)
    storage = register_flat_storage(model)
    before = storage["0"].detach().clone()
    storage.broadcast_params(src=1)
    return {"before": before, "after": storage["0"].detach().clone()}


def _scenario_all_reduce_sum(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    storage = register_flat_storage(model)
    model(torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))).sum().backward()
    local = storage["0"].grad.clone()
    storage.all_reduce_grads(op="sum")
    return {"local": local, "reduced": storage["0"].grad.clone()}


def _scenario_outside_params(rank: int, world: int) -> dict[str, Any]:
    """Parameters no group holds, under grad sync, in both modes: left out at registration, then a head
    put in after it (a module holding slots replaced: its parameters are ordinary), then a frozen body
    whose backward reaches only them. Before, each rank trained them on its own half of the batch."""
    results: dict[str, Any] = {}
    for mode in ("flat", "per-tensor"):
        plain = mlp(depth=3, width=6)
        model = copy.deepcopy(plain)
        storage = register_flat_storage(model, ["0.*", "2.*"])  # layer 4 is left out
        storage.enable_grad_sync()
        if mode == "per-tensor":
            storage.unflatten()
        steps: list[dict[str, torch.Tensor]] = []
        for stage in range(2):
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            ref = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
            _train_on_halves(model, opt, plain, ref, rank, world, steps=2)
            steps.append(values(model))
            if stage == 0:
                torch.manual_seed(1)  # the same new head on every rank, as after a seeded reset_classifier
                head = nn.Linear(6, 6)
                plain[2] = copy.deepcopy(head)
                model[2] = head
        results[mode] = {
            "steps": steps,
            "plain": values(plain),
            "groups": [i.name for i in storage.param_infos],
        }
        plain = mlp(depth=2, width=6)
        plain[0].requires_grad_(False)
        model = copy.deepcopy(plain)
        storage = register_flat_storage(model, [model[0]])  # a frozen group; the head outside it
        storage.enable_grad_sync()
        if mode == "per-tensor":
            storage.unflatten()
        trained = [[p for p in m.parameters() if p.requires_grad] for m in (model, plain)]
        opt, ref = (torch.optim.SGD(params, lr=0.1) for params in trained)
        _train_on_halves(model, opt, plain, ref, rank, world, steps=2)
        results[f"{mode} frozen"] = {"synced": values(model), "plain": values(plain)}
    return results


def _scenario_outside_collectives(rank: int, world: int) -> dict[str, Any]:
    """broadcast_params, a gradient only rank 0 produced and one no rank did, all_reduce_grads: outside."""
    torch.manual_seed(rank)  # every rank starts from other weights
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    model.register_parameter("spare", nn.Parameter(torch.zeros(2)))  # never used
    storage = register_flat_storage(model, [model[0]])
    before = model[1].weight.detach().clone()
    storage.broadcast_params(src=1)
    after = model[1].weight.detach().clone()
    storage.enable_grad_sync()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    out = model[0](x)
    if rank == 0:  # rank 1's backward reaches only the flat group
        out = model[1](out)
    local = None
    with storage.no_sync():
        out.sum().backward(retain_graph=True)
        local = None if model[1].weight.grad is None else model[1].weight.grad.clone()
    model.zero_grad()
    out.sum().backward()
    averaged = model[1].weight.grad.clone()
    storage.disable_grad_sync()
    model.zero_grad()
    model[1](model[0](x)).sum().backward()
    summed_local = model[1].weight.grad.clone()
    storage.all_reduce_grads(op="sum")
    return {
        "before": before,
        "after": after,
        "local": local,
        "averaged": averaged,
        "spare": model.spare.grad,
        "summed local": summed_local,
        "summed": model[1].weight.grad.clone(),
    }


def _scenario_divided_in_backward(rank: int, world: int) -> dict[str, Any]:
    ops: list[str] = []
    real = _distributed._all_reduce

    def record(grad: torch.Tensor, group: Any, world: int, op: str, *rest: Any) -> Any:
        ops.append(op)
        return real(grad, group, world, op, *rest)

    _distributed._all_reduce = record
    try:
        plain = mlp(depth=2, width=128)  # segments large enough to divide while copying
        model = copy.deepcopy(plain)
        storage = register_flat_storage(model, bucket_cap_mb=0.07)
        storage.broadcast_params()
        storage.enable_grad_sync()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref = torch.optim.SGD(plain.parameters(), lr=0.1)
        per_rank = 8 // world
        for step in range(3):
            x, y = _batch(step, width=128)
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            opt.zero_grad()
            loss = _mse(model(x[mine]), y[mine])
            ref.zero_grad()
            plain_loss = _mse(plain(x), y)
            if step == 2:  # the flat parameters used directly too: a contribution not divided in backward
                loss = loss + 1e-2 * sum(flat.pow(2).sum() for flat in storage.flat_params)
                plain_loss = plain_loss + 1e-2 * sum(p.pow(2).sum() for p in plain.parameters())
            loss.backward()
            opt.step()
            plain_loss.backward()
            ref.step()
    finally:
        _distributed._all_reduce = real
    return {"synced": values(model), "plain": values(plain), "ops": ops}


def _scenario_per_tensor_sync(rank: int, world: int) -> dict[str, Any]:
    """Grad sync and all_reduce_grads() in per-tensor mode: Adafactor over the leaves on half batches."""
    plain = mlp(depth=3, width=6)
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)
    storage.enable_grad_sync()
    storage.unflatten()  # the whole run in per-tensor mode
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
    ref = torch.optim.Adafactor(plain.parameters(), lr=0.01)
    mine = _train_on_halves(model, opt, plain, ref, rank, world)
    synced = values(model)
    storage.disable_grad_sync()
    model.zero_grad()
    x, y = _batch(7)
    _mse(model(x[mine]), y[mine]).backward()
    storage.all_reduce_grads()
    plain.zero_grad()
    _mse(plain(x), y).backward()
    return {
        "synced": synced,
        "plain": values(plain),
        "reduced": {n: p.grad.clone() for n, p in model.named_parameters()},
        "plain_grads": grads(plain),
        "flattened": storage.is_flattened,
    }


def _scenario_per_tensor_fsdp2(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 (per layer and the root) and DCP over a per-tensor model, and plain FSDP2 from the same seed."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    plain = mlp(depth=3, width=6)
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)
    storage.unflatten()
    for m in (plain, model):
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(m)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (plain, model)]
    per_rank = 8 // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for step in range(3):
        x, y = _batch(step)
        for m, opt in zip((plain, model), opts):
            opt.zero_grad()
            _mse(m(x[mine]), y[mine]).backward()
            opt.step()
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    plain_full = {n: p.full_tensor().detach().clone() for n, p in plain.named_parameters()}
    model_sd, optim_sd = get_state_dict(model, opts[1])
    plain_model_sd, plain_optim_sd = get_state_dict(plain, opts[0])
    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder[0])
    for p in model.parameters():  # spoil the weights, then resume them from the checkpoint
        p.detach().zero_()
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=folder[0])
    set_state_dict(model, opts[1], model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    resumed = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    try:
        storage.flatten()
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    return {
        "flatten refusal": refusal,
        "still per-tensor": not storage.is_flattened
        and all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "trained": full,
        "plain": plain_full,
        "resumed": resumed,
        "model keys": (sorted(model_sd), sorted(plain_model_sd)),
        "optim keys": (sorted(optim_sd["state"]), sorted(plain_optim_sd["state"])),
    }


_SCENARIOS = {
    "sync_training": _scenario_sync_training,
    "per_tensor_sync": _scenario_per_tensor_sync,
    "per_tensor_fsdp2": _scenario_per_tensor_fsdp2,
    "divided_in_backward": _scenario_divided_in_backward,
    "no_sync": _scenario_no_sync,
    "unused_group": _scenario_unused_group,
    "broadcast": _scenario_broadcast,
    "all_reduce_sum": _scenario_all_reduce_sum,
    "outside_params": _scenario_outside_params,
    "outside_collectives": _scenario_outside_collectives,
}


def _failing_rank(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    model = nn.Linear(3, 2)
    storage = register_flat_storage(model)
    storage.enable_grad_sync(group)
    if rank == 1:
        try:
            raise ValueError("rank 1 fails on purpose")
        finally:
            time.sleep(6)  # alive but gone from the collectives: only a timeout frees rank 0
    start = time.monotonic()
    try:
        model(torch.ones(1, 3)).sum().backward()
    except RuntimeError as error:
        return {"error": str(error)[:500], "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


_SCENARIOS["failing_rank"] = _failing_rank  # last: it ends the launch


def _run_scenarios(rank: int, world: int, outdir: Path) -> None:
    for name, scenario in _SCENARIOS.items():
        save_result(outdir, rank, name, scenario(rank, world))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One launch of 2 ranks running every scenario; the last one makes rank 1 fail."""
    return launch_gloo(_run_scenarios, tmp_path_factory.mktemp("ranks"))


@pytest.mark.slow
def test_fsdp2_and_dcp_wrap_the_per_tensor_mode_as_a_plain_model(two_ranks):
    """fully_shard per layer on a per-tensor model trains like plain FSDP2; DCP saves plain keys, resumes."""
    for result in launch_results(two_ranks, "per_tensor_fsdp2"):
        assert_same_values(result["trained"], result["plain"])
        assert_same_values(result["resumed"], result["trained"])
        model_keys, plain_model_keys = result["model keys"]
        assert model_keys == plain_model_keys
        optim_keys, plain_optim_keys = result["optim keys"]
        assert optim_keys == plain_optim_keys
        refusal = result["flatten refusal"]
        assert refusal is not None
        assert re.search(r"cannot flatten: \S+ is a sharded DTensor \(fully_shard sharded", refusal)
        assert "keep training in per-tensor mode" in refusal
        assert result["still per-tensor"]


@pytest.mark.slow
def test_synced_training_equals_single_process_on_the_combined_batch(two_ranks):
    """Two ranks with grad sync, each on half the batch, end where one process on the whole batch ends."""
    first, second = launch_results(two_ranks, "sync_training")
    for result in (first, second):
        assert result["groups"] > 2
        assert_same_values(result["synced"], result["plain"], close=True)
    assert_same_values(first["synced"], second["synced"])


@pytest.mark.slow
def test_grad_sync_in_per_tensor_mode_trains_like_one_process(two_ranks):
    """Per-tensor mode: the leaves' gradients are the flat buckets, grad sync and all_reduce_grads average."""
    first, second = launch_results(two_ranks, "per_tensor_sync")
    for result in (first, second):
        assert result["flattened"] is False
        assert_same_values(result["synced"], result["plain"], close=True)
        assert_same_values(result["reduced"], result["plain_grads"], close=True)
    assert_same_values(first["synced"], second["synced"])


@pytest.mark.slow
def test_gradients_divided_in_backward_train_like_one_process(two_ranks):
    """With large segments backward divides by the world size and the collective only sums; same training."""
    for result in launch_results(two_ranks, "divided_in_backward"):
        assert set(result["ops"]) == {"sum"}, result["ops"]
        assert_same_values(result["synced"], result["plain"], close=True)


@pytest.mark.slow
def test_no_sync_accumulation_equals_the_plain_gradient(two_ranks):
    """Micro-batches under no_sync stay local; the next synced backward averages their sum."""
    first, second = launch_results(two_ranks, "no_sync")
    assert not torch.allclose(first["local"], second["local"])
    for result in (first, second):
        torch.testing.assert_close(result["synced"], result["plain"])


@pytest.mark.slow
def test_group_unused_on_one_rank_is_averaged_with_zeros(two_ranks):
    """A group one rank's backward does not reach gets the other ranks' gradient over world size; no hang."""
    first, second = (result["steps"] for result in launch_results(two_ranks, "unused_group"))
    for step0, step1 in zip(first, second):
        assert torch.equal(step0["a"], step1["a"])
        assert torch.equal(step0["b"], step1["b"])
        torch.testing.assert_close(step0["b"], step0["local_b"] / 2)


@pytest.mark.slow
def test_broadcast_params_copies_the_source_rank(two_ranks):
    """After broadcast_params(src=1) every rank holds rank 1's flat parameters."""
    first, second = launch_results(two_ranks, "broadcast")
    assert not torch.equal(first["before"], second["before"])
    assert torch.equal(first["after"], second["before"])
    assert torch.equal(second["after"], second["before"])


@pytest.mark.slow
def test_all_reduce_grads_sum_adds_the_ranks_gradients(two_ranks):
    """all_reduce_grads(op='sum') leaves the sum of every rank's gradient on every rank."""
    first, second = launch_results(two_ranks, "all_reduce_sum")
    for result in (first, second):
        torch.testing.assert_close(result["reduced"], first["local"] + second["local"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["flat", "per-tensor"])
def test_parameters_outside_the_groups_train_as_one_process_on_the_combined_batch(two_ranks, mode):
    """Left out at registration, a head put in after it, a frozen body: grad sync averages them too."""
    first, second = launch_results(two_ranks, "outside_params")
    for result in (first, second):
        assert_same_values(result[mode]["steps"][-1], result[mode]["plain"], close=True)
        assert_same_values(result[f"{mode} frozen"]["synced"], result[f"{mode} frozen"]["plain"], close=True)
    assert "4.weight" not in first[mode]["groups"]
    for before, after in zip(first[mode]["steps"], second[mode]["steps"]):
        assert_same_values(before, after)  # the ranks never drift apart
    assert_same_values(first[f"{mode} frozen"]["synced"], second[f"{mode} frozen"]["synced"])


@pytest.mark.slow
def test_collectives_cover_the_parameters_outside_the_groups(two_ranks):
    """broadcast_params copies them; a gradient one rank produced is averaged with zeros; none stays None."""
    first, second = launch_results(two_ranks, "outside_collectives")
    assert not torch.equal(first["before"], second["before"])
    assert torch.equal(first["after"], second["before"]) and torch.equal(second["after"], second["before"])
    assert second["local"] is None
    for result in (first, second):
        torch.testing.assert_close(result["averaged"], first["local"] / 2)
        assert result["spare"] is None
        torch.testing.assert_close(result["summed"], first["summed local"] + second["summed local"])


@pytest.mark.slow
def test_failing_rank_does_not_hang_the_others(two_ranks):
    """A rank that raises fails the launch; the other's synced backward raises after the group's timeout."""
    assert "rank 1 raised" in two_ranks["failure"]
    assert "ValueError: rank 1 fails on purpose" in two_ranks["failure"]
    survivor = torch.load(two_ranks["outdir"] / "failing_rank.0.pt", weights_only=False)
    assert survivor["error"] is not None
    assert survivor["seconds"] < 5  # the 2 s timeout, not rank 1's exit after 6 s
    assert two_ranks["seconds"] < 150


# ------------------------------------------------------- one process, world 1


@pytest.fixture
def collectives(world1, monkeypatch) -> list[tuple[str, torch.Tensor]]:
    """Record every all_reduce and broadcast as ``(kind, tensor)``."""
    calls: list[tuple[str, torch.Tensor]] = []
    for kind in ("all_reduce", "broadcast"):
        real = getattr(dist, kind)

        def record(tensor, *args, _real=real, _kind=kind, **kwargs):
            calls.append((_kind, tensor))
            return _real(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, kind, record)
    return calls


def _blocks(n: int = 3, width: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])


def _reduced_groups(storage, calls) -> list[str]:
    names = storage.group_names
    return [
        names[next(i for i, f in enumerate(storage.flat_params) if f.grad is t)]
        for kind, t in calls
        if kind == "all_reduce"
    ]


def test_collectives_on_a_storage_without_groups_work_on_the_parameters_outside(collectives):
    """Explicitly empty groups: every parameter is outside; the calls sync them as DDP would, no flat one."""
    model = _blocks()
    storage = register_flat_storage(model, [[]])
    storage.all_reduce_grads()  # no gradient anywhere: the count of ranks that produced one, one bucket
    assert all(p.grad is None for p in model.parameters())
    storage.broadcast_params()
    storage.enable_grad_sync()
    with storage.no_sync():
        model(torch.ones(1, 4)).sum().backward()
    assert [kind for kind, _ in collectives] == ["all_reduce", "all_reduce", "broadcast"]
    model(torch.ones(1, 4)).sum().backward()
    storage.disable_grad_sync()
    # the outside gradients' count and bucket, then the launch order agreed after the first synced backward
    assert [kind for kind, _ in collectives[3:]] == ["all_reduce", "all_reduce", "broadcast"]
    assert model[0].weight.grad is not None


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.all_reduce_grads(),
        lambda s: s.broadcast_params(),
        lambda s: s.enable_grad_sync(),
    ],
    ids=["all_reduce_grads", "broadcast_params", "enable_grad_sync"],
)
def test_collectives_need_an_initialized_process_group(call):
    """Without init_process_group every collective method raises and says to call it first."""
    model = nn.Linear(2, 2)
    storage = register_flat_storage(model)
    with pytest.raises(RuntimeError, match=r"no.*initialized.*call torch\.distributed\.init_process_group"):
        call(storage)


def test_all_reduce_grads_rejects_an_unknown_op(world1):
    """op must be 'mean' or 'sum'; the message lists them."""
    model = nn.Linear(2, 2)
    storage = register_flat_storage(model)
    with pytest.raises(ValueError, match=r"op must be one of \['mean', 'sum'\]; got 'avg'"):
        storage.all_reduce_grads(op="avg")


def test_all_reduce_grads_rejects_a_non_str_op(world1):
    """op is a str, not a ReduceOp."""
    model = nn.Linear(2, 2)
    storage = register_flat_storage(model)
    with pytest.raises(TypeError, match=r"op must be a str.*got RedOpType"):
        storage.all_reduce_grads(op=dist.ReduceOp.SUM)


@pytest.mark.parametrize(
    "call",
    [
        lambda s, g: s.all_reduce_grads(group=g),
        lambda s, g: s.broadcast_params(group=g),
        lambda s, g: s.enable_grad_sync(g),
    ],
    ids=["all_reduce_grads", "broadcast_params", "enable_grad_sync"],
)
def test_group_must_be_a_process_group(world1, call):
    """group is a ProcessGroup or None; anything else is a TypeError naming the fix."""
    model = nn.Linear(2, 2)
    storage = register_flat_storage(model)
    with pytest.raises(TypeError, match=r"group must be a torch.distributed ProcessGroup.*got str 'gloo'"):
        call(storage, "gloo")


def test_rank_outside_the_group_is_refused(world1):
    """A rank that dist.new_group left out (NON_GROUP_MEMBER) cannot take part."""
    model = nn.Linear(2, 2)
    storage = register_flat_storage(model)
    with pytest.raises(ValueError, match="this rank is not a member of the given process group"):
        storage.all_reduce_grads(group=dist.GroupMember.NON_GROUP_MEMBER)


def test_broadcast_params_checks_src(world1):
    """src is an int rank of the group: a str is a TypeError, a missing rank a ValueError."""
    model = nn.Linear(2, 2)
    storage = register_flat_storage(model)
    with pytest.raises(TypeError, match=r"src must be an int \(a global rank\); got str '0'"):
        storage.broadcast_params(src="0")
    with pytest.raises(ValueError, match=r"src must be a global rank of the process group, one of \[0\]"):
        storage.broadcast_params(src=1)


def test_enable_grad_sync_twice_is_refused(world1):
    """Enabling again needs disable_grad_sync() first."""
    model = nn.Linear(2, 2)
    storage = register_flat_storage(model)
    storage.enable_grad_sync()
    with pytest.raises(RuntimeError, match=r"already enabled.*call disable_grad_sync\(\) first"):
        storage.enable_grad_sync()


def test_all_reduce_grads_is_one_collective_per_group(collectives):
    """One all_reduce per group requiring grad; a missing .grad joins as zeros; frozen groups are skipped."""
    model = _blocks()
    model[2].requires_grad_(False)
    storage = register_flat_storage(model, [[model[0]], [model[1]], [model[2]]])
    model[0](torch.ones(1, 4)).sum().backward()
    before = storage["0"].grad.clone()
    storage.all_reduce_grads()
    assert _reduced_groups(storage, collectives) == ["0", "1"]
    assert torch.equal(storage["0"].grad, before)  # the mean over one rank
    assert torch.equal(storage["1"].grad, torch.zeros(20))
    assert storage["2"].grad is None


def test_all_reduce_grads_in_unflattened_mode_stays_unflattened(collectives):
    """In unflattened mode the leaf gradients are reduced through the flat buffer and stay views of it."""
    model = nn.Linear(2, 2)
    storage = register_flat_storage(model)
    with storage.unflattened():
        model(torch.ones(1, 2)).sum().backward()
        storage.all_reduce_grads()
        assert not storage.is_flattened
        assert model.weight.grad.data_ptr() == storage["0"].grad.data_ptr()
    assert len(collectives) == 1


def test_broadcast_params_is_one_collective_per_group_and_an_inplace_write(collectives):
    """One broadcast per group (frozen ones too); it bumps the version like any in-place write."""
    model = _blocks(2)
    model[1].requires_grad_(False)
    storage = register_flat_storage(model)
    versions = [f._version for f in storage.flat_params]
    storage.broadcast_params()
    assert [kind for kind, _ in collectives] == ["broadcast", "broadcast"]
    assert all(f._version > v for f, v in zip(storage.flat_params, versions))


def test_grad_sync_reduces_each_group_once_per_backward(collectives):
    """Every synced backward issues one all_reduce per group; values are the mean (world 1: unchanged)."""
    model = _blocks()
    plain = copy.deepcopy(model)
    storage = register_flat_storage(model, [[m] for m in model])
    storage.enable_grad_sync()
    for _ in range(3):
        collectives.clear()
        x = torch.randn(2, 4)
        model(x).sum().backward()
        plain(x).sum().backward()
        assert sorted(_reduced_groups(storage, collectives)) == ["0", "1", "2"]
    assert_same_values(grads(model), grads(plain), close=True)


def test_grad_sync_starts_collectives_during_backward_in_the_learned_order(world1, monkeypatch):
    """From the second backward on, a group's all_reduce starts as soon as its grad is final, mid-backward."""
    model = _blocks()
    storage = register_flat_storage(model, [[m] for m in model])
    storage.enable_grad_sync()
    events: list[str] = []
    real = dist.all_reduce

    def record(tensor, *args, **kwargs):
        group = next(i for i, f in enumerate(storage.flat_params) if f.grad is tensor)
        events.append(f"reduce {group}")
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", record)
    for name, flat in zip(storage.group_names, storage.flat_params):
        flat.register_post_accumulate_grad_hook(lambda _, name=name: events.append(f"ready {name}"))
    model(torch.randn(2, 4)).sum().backward()
    assert events == ["ready 2", "ready 1", "ready 0", "reduce 0", "reduce 1", "reduce 2"]
    events.clear()
    model(torch.randn(2, 4)).sum().backward()
    assert events == ["reduce 2", "ready 2", "reduce 1", "ready 1", "reduce 0", "ready 0"]


def test_no_sync_skips_collectives_until_the_next_synced_backward(collectives):
    """Backward inside no_sync issues no collective; the next one outside reduces the accumulated gradient."""
    model = nn.Linear(2, 2)
    storage = register_flat_storage(model)
    storage.enable_grad_sync()
    with storage.no_sync(), storage.no_sync():
        model(torch.ones(1, 2)).sum().backward()
    assert collectives == []
    model(torch.ones(1, 2)).sum().backward()
    assert _reduced_groups(storage, collectives) == ["0"]
    assert torch.equal(storage["0"].grad, torch.tensor([2.0, 2.0, 2.0, 2.0, 2.0, 2.0]))


def test_grad_sync_reduces_groups_the_backward_did_not_reach(collectives):
    """A group this backward did not reach is reduced too (as zeros): ranks issue the same collectives."""
    model = _TwoBranch()
    storage = register_flat_storage(model, {"a": [model.a], "b": [model.b]})
    storage.enable_grad_sync()
    model.a(torch.ones(1, 4)).sum().backward()
    assert sorted(_reduced_groups(storage, collectives)) == ["a", "b"]
    assert torch.equal(storage["b"].grad, torch.zeros(20))


def test_grad_sync_leaves_frozen_groups_alone(collectives):
    """A group that does not require grad gets no hook and no collective."""
    model = _blocks(2)
    model[0].requires_grad_(False)
    storage = register_flat_storage(model, [[model[0]], [model[1]]])
    storage.enable_grad_sync()
    model(torch.ones(1, 4)).sum().backward()
    assert _reduced_groups(storage, collectives) == ["1"]
    assert storage["0"].grad is None


def test_grad_sync_hooks_a_group_unfrozen_later_at_the_next_forward(collectives):
    """Nothing notifies requires_grad_(True): the forward's sync point (Feature.refresh) hooks the group."""
    model = _blocks(2)
    model[0].requires_grad_(False)
    storage = register_flat_storage(model, [[model[0]], [model[1]]])
    storage.enable_grad_sync()
    storage["0"].requires_grad_(True)
    model(torch.ones(1, 4)).sum().backward()
    assert sorted(_reduced_groups(storage, collectives)) == ["0", "1"]


def test_grad_sync_walks_the_module_again_only_after_a_registration(world1, monkeypatch):
    """A clean forward does not walk the module for parameters outside the groups; a registration does."""
    from flatten_parametrize._distributed import outside_params

    walks: list[int] = []
    real = outside_params.outside_params

    def counted(module: nn.Module) -> list[nn.Parameter]:
        walks.append(1)
        return real(module)

    monkeypatch.setattr(outside_params, "outside_params", counted)
    model = _blocks(2)
    storage = register_flat_storage(model)
    storage.enable_grad_sync()
    for _ in range(3):
        model(torch.ones(1, 4)).sum().backward()
    assert len(walks) == 1
    model.register_parameter("extra", nn.Parameter(torch.zeros(4)))
    model(torch.ones(1, 4)).sum().backward()
    assert len(walks) == 2
    assert len(model.extra._post_accumulate_grad_hooks or {}) == 1
    storage.disable_grad_sync()
    assert not model.extra._post_accumulate_grad_hooks


def test_grad_sync_reduces_the_parameters_outside_in_one_collective_per_dtype(collectives):
    """Outside parameters of two dtypes: how many ranks produced each gradient, then one bucket per dtype."""
    model = _blocks(3)
    model[2].double()
    storage = register_flat_storage(model, [model[0]])
    storage.enable_grad_sync()
    collectives.clear()
    model[2](model[1](model[0](torch.ones(1, 4))).double()).sum().backward()
    reduced = [(t.dtype, t.numel()) for kind, t in collectives if kind == "all_reduce"]
    assert reduced == [(torch.float32, 20), (torch.float32, 4), (torch.float32, 20), (torch.float64, 20)]


def test_grad_sync_works_with_non_reentrant_checkpointing(collectives):
    """Activation checkpointing with use_reentrant=False keeps one all_reduce per group per backward."""
    model = _blocks()
    storage = register_flat_storage(model, [[m] for m in model])
    storage.enable_grad_sync()
    for _ in range(2):
        collectives.clear()
        hidden = checkpoint(model[1], model[0](torch.randn(2, 4)), use_reentrant=False)
        model[2](hidden).sum().backward()
        assert sorted(_reduced_groups(storage, collectives)) == ["0", "1", "2"]


@pytest.mark.parametrize("block", [1, 2], ids=["middle", "last"])
def test_grad_sync_refuses_reentrant_checkpointing(collectives, block):
    """A flat gradient produced by a nested (reentrant) backward is refused, not reduced twice."""
    model = _blocks()
    storage = register_flat_storage(model, [[m] for m in model])
    storage.enable_grad_sync()
    hidden = torch.randn(2, 4)
    for i, layer in enumerate(model):
        hidden = checkpoint(layer, hidden, use_reentrant=True) if i == block else layer(hidden)
    with pytest.raises(RuntimeError, match=r"nested \(reentrant\) backward run by CheckpointFunction"):
        hidden.sum().backward()
    collectives.clear()
    model.zero_grad()
    model(torch.randn(2, 4)).sum().backward()  # sync recovers for the next plain backward
    assert sorted(_reduced_groups(storage, collectives)) == ["0", "1", "2"]


def _sync_hooks(model: nn.Module, storage) -> int:
    on_flat = sum(
        len(f._post_accumulate_grad_hooks or {}) + len(f._backward_hooks or {}) for f in storage.flat_params
    )
    prescale = sum(len(group.views.grads.hooks) for group in core_of(storage).groups())
    forward = len(model._forward_pre_hooks) - 1  # the library's own one (trace_split): sync adds none
    return on_flat + prescale + forward


def test_disable_grad_sync_removes_every_hook(collectives):
    """disable_grad_sync() removes every hook and the claims; backward then issues nothing."""
    model = _blocks(2)
    storage = register_flat_storage(model, [[m] for m in model])
    storage.enable_grad_sync()
    assert _sync_hooks(model, storage) == 6  # per group: 2 hooks and the prescale
    storage.disable_grad_sync()
    assert _sync_hooks(model, storage) == 0
    model(torch.ones(1, 4)).sum().backward()
    assert collectives == []
    storage.disable_grad_sync()  # again: nothing to do


def test_remove_flat_storage_removes_sync_hooks(world1):
    """remove_flat_storage leaves no hook of grad sync on the module or the old flat parameters."""
    model = _blocks(2)
    storage = register_flat_storage(model)
    flats = storage.flat_params
    storage.enable_grad_sync()
    remove_flat_storage(model)
    assert not any(f._post_accumulate_grad_hooks or f._backward_hooks for f in flats)
    assert dict(model._forward_pre_hooks) == {}


def test_grad_sync_follows_flat_parameters_replaced_by_to(collectives):
    """module.to() that replaces the flat parameter objects hooks the new ones at once (on_rebacked)."""
    model = _blocks(2)
    storage = register_flat_storage(model)
    storage.enable_grad_sync()
    old = storage["0"]
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert storage["0"] is not old
    assert len(storage["0"]._post_accumulate_grad_hooks) == 1 and not old._post_accumulate_grad_hooks
    model(torch.ones(1, 4, dtype=torch.float64)).sum().backward()
    assert _reduced_groups(storage, collectives) == ["0"]
    assert not old._post_accumulate_grad_hooks and not old._backward_hooks


def test_deep_copy_of_a_synced_model_does_not_sync(collectives):
    """A deep copy does not sync: its flat parameters and gradient buffers carry no hook."""
    model = _blocks(2)
    storage = register_flat_storage(model)
    storage.enable_grad_sync()
    clone = copy.deepcopy(model)
    clone(torch.ones(1, 4)).sum().backward()
    assert collectives == []
    from flatten_parametrize import get_flat_storage

    assert _sync_hooks(clone, get_flat_storage(clone)) == 0


def test_failed_collective_raises_from_backward_and_sync_recovers(world1, monkeypatch):
    """A collective that fails (e.g. a timeout) raises from backward; the next backward syncs normally."""

    class _Failed:
        def wait(self) -> None:
            raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")

    model = nn.Linear(2, 2)
    storage = register_flat_storage(model)
    storage.enable_grad_sync()
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: _Failed())
    with pytest.raises(RuntimeError, match="Timed out"):
        model(torch.ones(1, 2)).sum().backward()
    monkeypatch.setattr(dist, "all_reduce", real)
    model.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    assert torch.equal(storage["0"].grad, torch.ones(6))


# ------------------------------- dividing in backward, with two simulated equal ranks


@pytest.fixture
def equal_ranks(world1, monkeypatch) -> list[str]:
    """Pretend a world of 2 whose other rank computes the same gradients; record each reduction's op.

    Averaging then leaves every gradient at its local value, so a synced
    model must end with the plain model's gradients whichever way it divides.
    """
    ops: list[str] = []
    real_all_reduce, real_reduce = dist.all_reduce, _distributed._all_reduce

    def all_reduce(tensor, *args, **kwargs):
        tensor.mul_(2)  # the other rank's (equal) contribution to the sum
        return real_all_reduce(tensor, *args, **kwargs)

    def reduce(grad, group, world, op, *rest):
        ops.append(op)
        return real_reduce(grad, group, world, op, *rest)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(_distributed, "_all_reduce", reduce)
    return ops


def _wide_pair(buckets: bool = True) -> tuple[nn.Module, nn.Module, Any]:
    plain = mlp(depth=2, width=128)  # 64 KiB weights: divided while the flat gradient is built
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model, bucket_cap_mb=0.07 if buckets else None)
    storage.enable_grad_sync()
    return plain, model, storage


def _flat_grads_of(storage, plain: nn.Module) -> list[torch.Tensor]:
    """The plain model's gradients laid out like the storage's flat gradients."""
    views = [torch.zeros_like(flat) for flat in storage.flat_params]
    named = storage.views_of(views)
    for name, param in plain.named_parameters():
        named[name].copy_(param.grad)
    return views


def test_grad_sync_divides_while_building_large_flat_gradients(equal_ranks):
    """Large segments: backward divides, the collective only sums, and the gradient memory is reused."""
    plain, model, storage = _wide_pair()
    x = torch.randn(4, 128)
    pointers = []
    for _ in range(3):
        model.zero_grad()
        plain.zero_grad()
        equal_ranks.clear()
        model(x).pow(2).mean().backward()
        plain(x).pow(2).mean().backward()
        assert equal_ranks == ["sum"] * len(storage.group_names)
        for flat, expected in zip(storage.flat_params, _flat_grads_of(storage, plain)):
            torch.testing.assert_close(flat.grad, expected)
        pointers.append([flat.grad.data_ptr() for flat in storage.flat_params])
    assert pointers[1] == pointers[2]  # accumulated without a copy, into kept memory


def test_grad_sync_divides_small_segments_after_backward(equal_ranks):
    """Many small segments: one concatenation, then the collective divides; same gradients."""
    plain = mlp(depth=3, width=6)
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)
    storage.enable_grad_sync()
    x = torch.randn(4, 6)
    model(x).pow(2).mean().backward()
    plain(x).pow(2).mean().backward()
    assert equal_ranks == ["mean"]
    torch.testing.assert_close(storage["0"].grad, _flat_grads_of(storage, plain)[0])


def test_grad_sync_corrects_a_divided_gradient_with_direct_uses_of_the_flat_parameter(equal_ranks):
    """A flat parameter also used directly adds an undivided part; the average is still right."""
    plain, model, storage = _wide_pair(buckets=False)
    x = torch.randn(4, 128)
    (model(x).pow(2).mean() + storage["0"].pow(2).sum()).backward()
    (plain(x).pow(2).mean() + sum(p.pow(2).sum() for p in plain.parameters())).backward()
    assert equal_ranks == ["sum"]
    torch.testing.assert_close(storage["0"].grad, _flat_grads_of(storage, plain)[0])


def test_grad_sync_averages_gradients_of_views_built_twice_in_one_backward(equal_ranks):
    """Views rebuilt between two forwards (new flat memory) give two divided parts of one gradient."""
    plain, model, storage = _wide_pair(buckets=False)
    x1, x2 = torch.randn(2, 4, 128)
    first = model(x1).pow(2).mean()
    storage["0"].data = storage["0"].data.clone()  # same values, new memory: the views are rebuilt
    (first + model(x2).pow(2).mean()).backward()
    (plain(x1).pow(2).mean() + plain(x2).pow(2).mean()).backward()
    assert equal_ranks == ["sum"]
    torch.testing.assert_close(storage["0"].grad, _flat_grads_of(storage, plain)[0])


def test_grad_sync_after_no_sync_accumulation_divides_the_sum(equal_ranks):
    """A gradient accumulated under no_sync is divided as a whole by the next synced backward."""
    plain, model, storage = _wide_pair(buckets=False)
    xs = torch.randn(3, 4, 128)
    with storage.no_sync():
        for x in xs[:-1]:
            model(x).pow(2).mean().backward()
    model(xs[-1]).pow(2).mean().backward()
    for x in xs:
        plain(x).pow(2).mean().backward()
    assert equal_ranks == ["mean"]
    torch.testing.assert_close(storage["0"].grad, _flat_grads_of(storage, plain)[0])


def test_autograd_grad_under_grad_sync_returns_the_local_gradient(equal_ranks):
    """torch.autograd.grad accumulates nothing: it gets the local, undivided gradient and syncs nothing."""
    plain, model, storage = _wide_pair(buckets=False)
    x = torch.randn(4, 128)
    (grad,) = torch.autograd.grad(model(x).pow(2).mean(), [storage["0"]])
    plain(x).pow(2).mean().backward()
    torch.testing.assert_close(grad, _flat_grads_of(storage, plain)[0])
    assert storage["0"].grad is None and equal_ranks == []


def test_using_other_flat_tensors_under_grad_sync_leaves_their_gradient_local(equal_ranks):
    """Views served from other tensors (using()) are not the synced flat parameter: nothing is divided."""
    plain, model, storage = _wide_pair(buckets=False)
    other = storage["0"].detach().clone().requires_grad_(True)
    x = torch.randn(4, 128)
    with storage.using([other]):
        model(x).pow(2).mean().backward()
    plain(x).pow(2).mean().backward()
    assert torch.equal(other.grad, _flat_grads_of(storage, plain)[0])
    assert storage["0"].grad is None and equal_ranks == []


def test_tensor_hook_on_a_flat_parameter_sees_the_local_gradient(equal_ranks):
    """A user's hook on a flat parameter sees the undivided gradient, as without grad sync."""
    plain, model, storage = _wide_pair(buckets=False)
    seen = []
    storage["0"].register_hook(lambda grad: seen.append(grad.clone()))
    x = torch.randn(4, 128)
    model(x).pow(2).mean().backward()
    plain(x).pow(2).mean().backward()
    expected = _flat_grads_of(storage, plain)[0]
    assert equal_ranks == ["mean"]
    torch.testing.assert_close(seen[0], expected)
    torch.testing.assert_close(storage["0"].grad, expected)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_under_grad_sync_keeps_a_differentiable_average(equal_ranks):
    """backward(create_graph=True) builds the flat gradient in the graph and still averages it."""
    plain, model, storage = _wide_pair(buckets=False)
    x = torch.randn(4, 128)
    model(x).pow(2).mean().backward(create_graph=True)
    plain(x).pow(2).mean().backward()
    assert equal_ranks == ["mean"] and storage["0"].grad.requires_grad
    torch.testing.assert_close(storage["0"].grad.detach(), _flat_grads_of(storage, plain)[0])
    storage["0"].grad = None  # break the parameter <-> gradient cycle that create_graph makes


def test_disable_grad_sync_stops_dividing_in_backward(equal_ranks):
    """After disable_grad_sync the flat gradient is the plain local one, with no collective."""
    plain, model, storage = _wide_pair(buckets=False)
    storage.disable_grad_sync()
    x = torch.randn(4, 128)
    model(x).pow(2).mean().backward()
    plain(x).pow(2).mean().backward()
    assert equal_ranks == []
    assert torch.equal(storage["0"].grad, _flat_grads_of(storage, plain)[0])


# ------------------------------------------------------------------- buckets


def test_bucket_cap_splits_automatic_groups_last_used_first():
    """Buckets fill walking parameters backwards: group '0' holds the last layer; names stay '0', '1', ..."""
    model = mlp(depth=4, width=16)  # each Linear: 272 floats = 1088 bytes
    storage = register_flat_storage(model, bucket_cap_mb=1100 / 2**20)
    assert storage.group_names == ["0", "1", "2", "3"]
    assert [info.name for info in storage.param_infos if info.group == "0"] == ["6.weight", "6.bias"]
    assert all(f.numel() * 4 <= 1100 for f in storage.flat_params)
    assert sum(f.numel() for f in storage.flat_params) == sum(p.numel() for p in mlp(4, 16).parameters())


def test_parameter_larger_than_the_bucket_cap_gets_its_own_bucket():
    """A parameter over the cap is never split: it fills a bucket alone."""
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 2))
    storage = register_flat_storage(model, bucket_cap_mb=1000 / 2**20)
    groups = {}
    for info in storage.param_infos:
        groups.setdefault(info.group, []).append(info.name)
    assert groups == {"0": ["0.bias", "1.weight", "1.bias"], "1": ["0.weight"]}


def test_first_bucket_closes_once_it_holds_one_mib_like_ddp():
    """The first bucket backward finishes closes at 1 MiB, so its sync starts early; others fill the cap."""
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])  # 1 MiB + 2 KiB each
    storage = register_flat_storage(model, bucket_cap_mb=3)
    groups: dict[str, list[str]] = {}
    for info in storage.param_infos:
        groups.setdefault(info.group, []).append(info.name)
    assert groups["0"] == ["3.weight", "3.bias"]
    assert groups["1"] == ["0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    assert groups["2"] == ["0.weight"]
    assert all(f.numel() * 4 <= 3 * 2**20 for f in storage.flat_params)


def test_buckets_split_each_dtype_group_in_turn():
    """Each automatic (device, dtype, requires_grad) group is split on its own, first-seen groups first."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).double(), nn.Linear(8, 8))
    storage = register_flat_storage(model, bucket_cap_mb=300 / 2**20)
    dtypes = [f.dtype for f in storage.flat_params]
    assert dtypes == [torch.float32] * 2 + [torch.float64] * 2
    assert storage.group_names == ["0", "1", "2", "3"]


def test_bucketed_model_trains_like_plain():
    """A model split into buckets trains exactly like the plain model."""
    plain = mlp(depth=3, width=8)
    model = copy.deepcopy(plain)
    register_flat_storage(model, bucket_cap_mb=0.0005)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref = torch.optim.Adam(plain.parameters(), lr=0.01)
    batches = [torch.randn(4, 8) for _ in range(3)]
    train_steps(model, opt, batches)
    train_steps(plain, ref, batches)
    assert_same_values(model, plain, close=True)


def test_bucket_cap_with_explicit_groups_is_refused():
    """bucket_cap_mb splits automatic groups only; explicit groups are refused and the module is unchanged."""
    model = nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=r"automatic groups \(groups=None\) only; got explicit groups of type"
    ):
        register_flat_storage(model, [model.weight], bucket_cap_mb=25)
    assert [name for name, _ in model.named_parameters()] == ["weight", "bias"]


@pytest.mark.parametrize("cap", ["25", True, [25]])
def test_bucket_cap_must_be_a_number(cap):
    """bucket_cap_mb is a number of MiB (or None)."""
    with pytest.raises(TypeError, match=r"bucket_cap_mb must be a number of MiB or None; got"):
        register_flat_storage(nn.Linear(2, 2), bucket_cap_mb=cap)


@pytest.mark.parametrize("cap", [0, -1.0, math.nan, math.inf])
def test_bucket_cap_must_be_positive_and_finite(cap):
    """bucket_cap_mb must be > 0 and finite."""
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be a positive finite number of MiB; got"):
        register_flat_storage(nn.Linear(2, 2), bucket_cap_mb=cap)
