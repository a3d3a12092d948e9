"""Whole-tensor ownership on real ranks agrees with the plan that ``bench_zero_scale.py`` simulates.

Layouts trained with ``ShardedOptimizer(whole_tensors=True)`` (torch's ``Muon`` on the hidden
matrices, ``AdamW`` on the rest, ZeRO-2) on 2, 3 and 4 gloo ranks (one launch each, every layout in it):

* ``one_matrix``: every tensor its own bucket (``bucket_cap_mb`` below any tensor), the case where each
  bucket used to be cut on its own and every matrix went to the same rank;
* ``mixed``: matrices of four shapes and element-wise tensors sharing buckets of 3 KiB;
* each again laid out for NCCL's one-buffer collectives, run here on gloo (``.one_buffer``: the
  collectives are told at construction that they take one padded buffer, so the plan deals the
  ownership in units of buckets that move as one ``reduce_scatter`` / ``all_gather``), with ZeRO-2 and,
  for ``mixed``, ZeRO-1 (``.zero1``: the units move only after the step);
* ``layers.one_buffer``: six GPT-2-shaped blocks in buckets of 2 KiB, whose units the plan deals unit
  by unit (``sharded_packing.py``) on each of these world sizes.

Per rank, the optimizer state bytes are what ``sharded_plan.plan_ownership`` predicts (the function
that ``benchmarks/bench_zero_scale.py`` runs without a process group), no rank holds all the matrices,
and the weights equal one process's (the plain model, the same optimizers, each step's gradient the
average over the ranks: bit for bit on 2 ranks; on 3 and 4, whose sums gloo orders its own way, within
a few ulps, and Muon's matrices within what a bfloat16 rounding of that moved gradient allows, see
``_assert_as_one_process``). A DCP checkpoint written at 2 ranks resumes at 3, and the one written
there at 4, each resumed run equal to one process whose step ``i`` averaged over that step's ranks.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from flatten_parametrize import ShardedOptimizer, get_flat_storage, register_flat_storage
from flatten_parametrize._distributed import sharded_collectives, sharded_plan
from flatten_parametrize._distributed.sharded_plan import plan_ownership
from flatten_parametrize._distributed.sharded_strategies import buckets_of

from _helpers import core_of, launch_gloo, launch_results, one_buffer_collectives, save_result

pytestmark = pytest.mark.slow

ROWS = 4  # per rank and step
#: Bucket size in MiB per layout: one byte (every tensor alone), 3 KiB (mixed), 2 KiB (layers).
CAPS = {"one_matrix": 1 / 2**20, "mixed": 3 * 1024 / 2**20, "layers": 2 * 1024 / 2**20}
#: Each run: its layout, whether the collectives take one padded buffer (NCCL's path), ZeRO-2.
KINDS = {
    "one_matrix": ("one_matrix", False, True),
    "mixed": ("mixed", False, True),
    "one_matrix.one_buffer": ("one_matrix", True, True),
    "mixed.one_buffer": ("mixed", True, True),
    "mixed.one_buffer.zero1": ("mixed", True, False),
    "layers.one_buffer": ("layers", True, True),
}


class _Net(nn.Module):
    """An embedding, matrices of four shapes (some sharing a width), norms and biases, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList(
            [nn.Linear(8, 24), nn.Linear(24, 8), nn.Linear(8, 8, bias=False), nn.Linear(8, 16)]
        )
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 8, bias=False)
        self.head = nn.Linear(8, 32, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(self.out(self.norm(h)))


class _Block(nn.Module):
    """GPT-2's block in small: fused query, key and value, a projection, an MLP, two norms."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.qkv, self.proj = nn.LayerNorm(8), nn.Linear(8, 24), nn.Linear(8, 8)
        self.norm2, self.fc, self.out = nn.LayerNorm(8), nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.tanh(q * k) + v)
        return x + self.out(torch.tanh(self.fc(self.norm2(x))))


class _Layers(nn.Module):
    """An embedding, six blocks, a norm, a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList([_Block() for _ in range(6)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 32, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


#: The model of each layout.
MODELS: dict[str, type[nn.Module]] = {"one_matrix": _Net, "mixed": _Net, "layers": _Layers}


def _is_matrix(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and name.startswith(("layers.", "out."))


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    named = list(model.named_parameters())
    return [
        {
            "params": [p for n, p in named if _is_matrix(n, p)],
            "optimizer_class": torch.optim.Muon,
            "lr": 0.02,
        },
        {"params": [p for n, p in named if not _is_matrix(n, p)], "lr": 1e-2},
    ]


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 32, (ROWS, 3), generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).pow(2).mean()


def _built(kind: str) -> tuple[nn.Module, Any]:
    layout, one_buffer, zero2 = KINDS[kind]
    model = MODELS[layout]()
    storage = register_flat_storage(model, bucket_cap_mb=CAPS[layout])
    storage.unflatten()
    with one_buffer_collectives() if one_buffer else contextlib.nullcontext():
        opt = ShardedOptimizer(
            storage, torch.optim.AdamW, _groups(model), whole_tensors=True, shard_gradients=zero2
        )
    return model, opt


def _train(model: nn.Module, opt: Any, rank: int, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        _loss(model, _batch(step, rank)).backward()
        opt.step()


def _state_bytes(opt: Any) -> int:
    """The bytes of this rank's per-element optimizer state (scalars such as a step count left out)."""
    return sum(
        value.numel() * value.element_size()
        for inner in opt.local_optimizer.optimizers
        for state in inner.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() >= 1
    )


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _reference(worlds: list[int], kind: str) -> dict[str, torch.Tensor]:
    """One process: the plain model, the same optimizers, step ``i`` averaging ``worlds[i]`` ranks' grads.

    On one thread, as the ranks (a matrix product on two threads may round otherwise).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _referenced(worlds, MODELS[KINDS[kind][0]]())
    finally:
        torch.set_num_threads(threads)


def _referenced(worlds: list[int], model: nn.Module) -> dict[str, torch.Tensor]:
    groups = _groups(model)
    muon = torch.optim.Muon(groups[0]["params"], lr=0.02)
    adamw = torch.optim.AdamW(groups[1]["params"], lr=1e-2)
    params = list(model.parameters())
    for step, world in enumerate(worlds):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            model.zero_grad()
            _loss(model, _batch(step, rank)).backward()
            for t, p in zip(total, params):
                t.add_(p.grad)
        for t, p in zip(total, params):
            p.grad = t / world
        muon.step()
        adamw.step()
    return _weights(model)


def _dcp(model: nn.Module, opt: Any, path: Any, load: bool) -> None:
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if load:
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        dcp.save(state, checkpoint_id=str(path))


def _worker(
    rank: int, world: int, outdir: Any, resume_from: Any = None, resume_step: int = 2, suffix: str = ""
) -> None:
    torch.set_num_threads(1)
    reduce_scatters = _count_calls(sharded_collectives, "reduce_scatter")
    all_gathers = _count_calls(sharded_collectives, "all_gather")
    for kind in KINDS:
        model, opt = _built(kind)
        reduce_scatters.clear()
        all_gathers.clear()
        held = _held_after_each_gradient(opt, get_flat_storage(model))
        _train(model, opt, rank, range(2))
        shards = opt._ownership.shards
        units = opt._ownership.units
        save_result(
            outdir,
            rank,
            kind,
            {
                "weights": _weights(model),
                "state_bytes": _state_bytes(opt),
                "owned": sum(s.owned for s in shards),
                "buckets": len(shards),
                "matrices": sum(
                    len(group["params"])
                    for inner in opt.local_optimizer.optimizers
                    if isinstance(inner, torch.optim.Muon)
                    for group in inner.param_groups
                ),
                "units": [len(unit) for unit in units],
                "one_buffer": [
                    opt._comm.one_buffer_for(unit) if len(unit) > 1 else not opt._comm.by_owner_for(unit[0])
                    for unit in units
                ],
                "calls": (len(reduce_scatters), len(all_gathers)),
                "held": held,
            },
        )
        _dcp(model, opt, outdir / f"dcp_{kind}", load=False)
        if resume_from is not None:
            model, opt = _built(kind)
            _dcp(model, opt, resume_from / f"dcp_{kind}{suffix}", load=True)
            _train(model, opt, rank, range(resume_step, resume_step + 1))
            save_result(outdir, rank, f"{kind}.resumed", {"weights": _weights(model)})
            _dcp(model, opt, outdir / f"dcp_{kind}.resumed", load=False)


def _held_after_each_gradient(opt: Any, storage: Any) -> list[int]:
    """Record, each time backward finishes a flat gradient, how many full flat gradients this rank holds."""
    groups = core_of(storage).groups
    ready = opt._reducer.grad_ready
    held: list[int] = []

    def counted(flat: Any) -> None:
        ready(flat)
        held.append(sum(group.grads.read(group.flat) is not None for group in groups()))

    opt._reducer.grad_ready = counted
    return held


def _count_calls(module: Any, name: str) -> list[int]:
    """Count the calls of ``module.name`` from now on in this process (the list grows by one a call)."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    setattr(module, name, counted)
    return calls


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch_gloo(_worker, tmp_path_factory.mktemp("own2"), world=2)


@pytest.fixture(scope="module")
def three_ranks(two_ranks: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Also resumes the 2-rank checkpoint (after steps 0 and 1) and trains step 2."""
    worker = functools.partial(_worker, resume_from=two_ranks["outdir"], resume_step=2)
    return launch_gloo(worker, tmp_path_factory.mktemp("own3"), world=3)


@pytest.fixture(scope="module")
def four_ranks(three_ranks: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Also resumes the 3-rank run's resumed checkpoint (after steps 0, 1 at 2 ranks, 2 at 3) at step 3."""
    worker = functools.partial(_worker, resume_from=three_ranks["outdir"], resume_step=3, suffix=".resumed")
    return launch_gloo(worker, tmp_path_factory.mktemp("own4"), world=4)


@pytest.fixture(params=[2, 3, 4], ids=["2 ranks", "3 ranks", "4 ranks"])
def launch(request: pytest.FixtureRequest) -> dict[str, Any]:
    return request.getfixturevalue({2: "two_ranks", 3: "three_ranks", 4: "four_ranks"}[request.param])


def _buckets(kind: str) -> list[Any]:
    """The buckets of this layout as ``ShardedOptimizer`` (and ``bench_zero_scale.py``) sees them."""
    model = MODELS[KINDS[kind][0]]()
    storage = register_flat_storage(model, bucket_cap_mb=CAPS[KINDS[kind][0]])
    index = {name: g for g, name in enumerate(storage.group_names)}
    flats: list[Any] = [(f.numel(), f.element_size(), []) for f in storage.flat_params]
    classes: list[list[Any]] = [[] for _ in storage.flat_params]
    for i, info in enumerate(storage.param_infos):
        flats[index[info.group]][2].append((i, info.offset, info.numel, tuple(info.shape)))
        matrix = info.name.startswith(("layers.", "out.")) and len(info.shape) == 2
        classes[index[info.group]].append(torch.optim.Muon if matrix else torch.optim.AdamW)
    return buckets_of(flats, classes)


def _planned(kind: str, world: int) -> Any:
    """The plan that ``bench_zero_scale.py`` computes for this layout, with no process group."""
    max_padding = sharded_collectives.MAX_PADDING if KINDS[kind][1] else None
    return plan_ownership(_buckets(kind), world, max_padding)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_layers_layout_is_dealt_unit_by_unit(world):
    """What these runs check for ``layers.one_buffer`` is the deal unit by unit (``sharded_packing``).

    The deals over the whole model also move every bucket in one buffer there, in larger units.
    """
    buckets = _buckets("layers.one_buffer")
    packed = sharded_plan._plan(buckets, world, sharded_collectives.MAX_PADDING, "units")
    assert _planned("layers.one_buffer", world) == packed


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_ranks_state_bytes_are_the_simulated_ones(launch, kind):
    """Per rank: the optimizer state bytes and the ZeRO-2 gradient elements the plan predicts."""
    world = launch["world"]
    plan = _planned(kind, world)
    results = launch_results(launch, kind)
    assert [r["state_bytes"] for r in results] == [int(s) for s in plan.state]
    assert [4 * r["owned"] for r in results] == plan.grads
    if kind.startswith("one_matrix"):
        assert results[0]["buckets"] == len(list(_Net().parameters()))  # one tensor per bucket
    assert all(r["matrices"] >= 1 for r in results)  # every rank steps a matrix (5 or 24 over up to 4 ranks)


@pytest.mark.parametrize("kind", [k for k in KINDS if KINDS[k][1]])
def test_laid_out_for_one_buffer_every_bucket_moves_in_one_buffer(launch, kind):
    """NCCL's path: buckets move in the plan's units, each one reduce_scatter and one all_gather.

    A bucket of one matrix alone would pad its buffer ``W - 1`` times: those buckets move in units of
    several (``one_matrix``); where each bucket evens out alone (``mixed`` on 2 ranks) it moves alone.
    """
    world = launch["world"]
    plan = _planned(kind, world)
    layout, _, zero2 = KINDS[kind]
    sizes = [stop - first for first, stop in plan.units]
    if layout == "one_matrix":
        assert max(sizes) > 1
    for result in launch_results(launch, kind):
        assert result["units"] == sizes
        assert all(result["one_buffer"])  # each pads at most MAX_PADDING: none moves by owner
        # two steps: each unit one all_gather a step and, with ZeRO-2, one reduce_scatter a backward
        reduce_scatters, all_gathers = result["calls"]
        assert all_gathers == 2 * len(sizes)
        assert reduce_scatters == (2 * len(sizes) if zero2 else 0)
        if zero2:  # a unit waiting for its last bucket holds its padded buffer, no full gradient
            assert result["held"] and max(result["held"]) == 0, result["held"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_rank_ends_as_one_process(launch, kind):
    """The weights after two steps equal the plain model's with the same optimizers."""
    reference = _reference([launch["world"]] * 2, kind)
    for result in launch_results(launch, kind):
        _assert_as_one_process(result["weights"], reference, exact=launch["world"] == 2, steps=2)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("world", [3, 4])
def test_a_dcp_checkpoint_resumes_at_another_world_size(request, kind, world):
    """2 ranks save, 3 resume and save, 4 resume: each equal to one process with those steps' ranks."""
    launch = request.getfixturevalue({3: "three_ranks", 4: "four_ranks"}[world])
    steps = [2, 2, 3] if world == 3 else [2, 2, 3, 4]
    reference = _reference(steps, kind)
    for result in launch_results(launch, f"{kind}.resumed"):
        _assert_as_one_process(result["weights"], reference, exact=False, steps=len(steps))


def _assert_as_one_process(
    weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], exact: bool, steps: int
) -> None:
    """Bit for bit (2 ranks: a sum of two is exact), else as far as gloo's order of a sum of 3 or 4 allows.

    That order moves a gradient by an ulp or so: AdamW's tensors stay within ``rtol=1e-5``; Muon's
    matrices are orthogonalised in bfloat16 (torch's ``Muon``), where such a gradient may round to the
    next bfloat16 value (one matrix of 24 in ``layers`` on 4 ranks does), and the update then moves by
    up to about a bfloat16 ulp of its largest entries, below 1: per step at most ``lr`` (0.02) times
    Muon's shape factor (at most 2 here) times 2 ** -7 (an ulp below 1, doubled).
    """
    for name, value in reference.items():
        if exact:
            assert torch.equal(weights[name], value), name
            continue
        muon = name.startswith(("layers.", "out.")) and value.dim() == 2
        rtol, atol = (0.0, steps * 0.02 * 2 * 2**-7) if muon else (1e-5, 1e-6)
        named = functools.partial(_named, name)
        torch.testing.assert_close(weights[name], value, rtol=rtol, atol=atol, msg=named)


def _named(name: str, message: str) -> str:
    return f"{name}: {message}"
