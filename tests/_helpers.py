"""Everything the tests share (import as `from _helpers import ...`; the `world1` fixture is in conftest.py).

- model builders: :class:`TiedLM`, :class:`TiedHead`, :class:`WithOwnParam`, :class:`Mixed`, :func:`mlp`,
  :func:`bn_mlp`, :func:`registered_bn_mlp`, :func:`twin`;
- the plain-twin comparator :func:`assert_same_values` (modules, :func:`values`, :func:`grads`
  or any name -> tensor mapping) and the whole-behaviour check :func:`assert_agrees_with_twin`;
- the optimizer-state comparator :func:`assert_same_optim_state`;
- the training loop :func:`train_steps` (losses :func:`mean_square`, :func:`sum_square`);
- the mixed-precision reference :func:`cast_per_forward` (float32 weights cast for each forward);
- snapshots of everything a failed call must leave untouched: :func:`snapshot`,
  :func:`assert_unchanged`, :func:`assert_plain`;
- the gloo launcher: :func:`spawn_gloo` runs a worker in 2 processes on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage
from flatten_parametrize._core.names import core_behind

from _gloo_pool import run_ranks

# --------------------------------------------------------------------------- models


class TiedLM(nn.Module):
    """A tiny language model whose output head shares the embedding matrix."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.norm(self.embed(tokens)))))


class WithOwnParam(nn.Module):
    """A module with a parameter of its own before its children, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([1.5, -0.5, 2.0]))
        self.fc = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("offset", torch.tensor([0.1, 0.2, 0.3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x * self.scale + self.offset))


class Mixed(nn.Module):
    """float32 and float64 layers, a frozen layer and a BatchNorm: several automatic groups, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.wide = nn.Linear(6, 6).double()
        self.out = nn.Linear(6, 3).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.wide(self.bn(self.inp(x)).double()).float())


class TiedHead(nn.Module):
    """An embedding and an output head sharing one weight (names ``emb.weight`` and ``head.weight``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(5, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.emb(tokens)))


def bn_mlp(seed: int = 0) -> nn.Sequential:
    """Linear(3, 4) -> BatchNorm1d(4) (with non-default running stats) -> Linear(4, 2), in train mode."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model.train()
    with torch.no_grad():
        model(torch.randn(8, 3))
    return model


def registered_bn_mlp(seed: int = 0, **kwargs: Any) -> tuple[nn.Sequential, Any]:
    """A :func:`bn_mlp` with groups 'a' (layer 0), 'b' (batch norm), layer 2 left out of every group."""
    model = bn_mlp(seed)
    storage = register_flat_storage(model, {"a": ["0.*"], "b": ["1.*"]}, **kwargs)
    return model, storage


def core_of(storage: Any) -> Any:
    """Return the private coordinator core behind a public ``FlatStorage`` (tests of the internals)."""
    return core_behind(storage, "core_of")


def plan_buckets(layout: list[list[tuple[int, ...]]], kinds: list[Any] | None = None) -> list[Any]:
    """Return ``sharded_plan.Bucket``s of the shapes in ``layout``, one list a bucket, float32.

    A 2-D shape is a matrix stepped whole by torch's ``Muon``; a 1-D one a vector cut by ``AdamW``.
    ``kinds``: each bucket's kind (what buckets share to move in one buffer).
    """
    from flatten_parametrize._distributed.sharded_plan import Bucket, BucketTensor

    out = []
    for b, shapes in enumerate(layout):
        tensors, at = [], 0
        for shape in shapes:
            numel = shape[0] * (shape[1] if len(shape) == 2 else 1)
            cls = torch.optim.Muon if len(shape) == 2 else torch.optim.AdamW
            tensors.append(BucketTensor(at, numel, shape, cls))
            at += numel
        out.append(Bucket(at, 4, tensors, None if kinds is None else kinds[b]))
    return out


def mlp(depth: int = 3, width: int = 5, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def twin(model: nn.Module) -> nn.Module:
    """Return an independent copy made before any flattening."""
    return copy.deepcopy(model)


# ------------------------------------------------------------ plain-twin assertions


def values(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``model``'s state dict, in its order (a snapshot to compare later)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Each parameter's gradient under its original name (``None`` where it has none).

    A flattened model reports them through ``storage.named_grads()`` (views of
    the flat gradients), a plain one through ``named_parameters()``: the two
    dicts of a flattened model and its plain twin compare with
    :func:`assert_same_values`.
    """
    storage = get_flat_storage(model)
    if storage is not None:
        pairs = storage.named_grads()
    else:
        pairs = ((name, p.grad) for name, p in model.named_parameters())
    return {name: None if grad is None else grad.detach().clone() for name, grad in pairs}


def assert_same_values(
    a: nn.Module | Mapping[str, Any],
    b: nn.Module | Mapping[str, Any],
    *,
    close: bool = False,
    msg: str = "",
    **tol: float,
) -> None:
    """Assert that ``a`` holds what ``b`` holds: the plain-twin comparator of the tests.

    ``a`` and ``b`` are modules (their state dicts are compared) or mappings
    of name -> tensor (:func:`values`, :func:`grads`, a saved result). They
    must have the same keys in the same order. Values are compared bit for bit
    (same dtype and ``torch.equal``, so shapes agree too) unless a tolerance is asked
    for: ``rtol=..., atol=...`` (``torch.testing.assert_close``, which also
    checks dtype and device) or ``close=True`` (assert_close's defaults for
    the dtype). ``None`` only equals ``None``; other values compare with
    ``==``. ``msg`` prefixes the failing key.
    """
    sa = a.state_dict() if isinstance(a, nn.Module) else a
    sb = b.state_dict() if isinstance(b, nn.Module) else b
    assert list(sa) == list(sb), f"{msg} keys differ: {list(sa)} != {list(sb)}"
    for key in sa:
        where = f"{msg} {key}".strip()
        x, y = sa[key], sb[key]
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            assert (x is None and y is None) if x is None or y is None else x == y, where
        elif close or tol:
            torch.testing.assert_close(x, y, msg=where, **tol)
        else:
            assert x.dtype == y.dtype and torch.equal(x, y), where


def assert_agrees_with_twin(
    plain: nn.Module, flat: nn.Module, x: torch.Tensor, *, step: bool = False
) -> None:
    """Assert that the flattened ``flat`` behaves exactly as its plain twin ``plain`` on input ``x``.

    Checked bit for bit: the forward output in grad, no-grad and inference
    mode; the state dict; the plain twin loading ``flat``'s state dict and a
    copy of ``flat`` loading its flat state dict; in ``unflattened()``, the
    parameter names, values and forward; after ``remove_flat_storage`` on a
    copy, the parameter names and values. With ``step=True`` both models then
    take one SGD step (lr 0.1) on ``x`` and must agree within rtol=1e-6,
    atol=1e-7, and again after removal (this changes both models).
    """
    storage = get_flat_storage(flat)
    assert storage is not None, "flat has no flat storage"
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        with mode():
            out, expected = flat(x), plain(x)
            torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"forward under {mode.__name__}")
    assert_same_values(values(flat), values(plain))
    reloaded = twin(plain)
    reloaded.load_state_dict({k: v.clone() for k, v in flat.state_dict().items()})
    assert_same_values(values(reloaded), values(plain))
    flat_copy = twin(flat)
    flat_copy.load_state_dict({k: v.clone() for k, v in storage.flat_state_dict().items()})
    assert_same_values(values(flat_copy), values(plain))
    with storage.unflattened():
        assert [n for n, _ in flat.named_parameters()] == [n for n, _ in plain.named_parameters()]
        assert_same_values(values(flat), values(plain))
        torch.testing.assert_close(flat(x), plain(x), rtol=0, atol=0, msg="forward in unflattened()")
    if step:
        for model in (plain, flat):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(x).pow(2).sum().backward()
            opt.step()
        assert_same_values(values(flat), values(plain), rtol=1e-6, atol=1e-7)
    removed = twin(flat)
    remove_flat_storage(removed)
    assert [n for n, _ in removed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert_same_values(values(removed), values(plain))


# ------------------------------------------------------------------ optimizer state


def assert_same_optim_state(a: Mapping[str, Any], b: Mapping[str, Any], **tol: float) -> None:
    """Assert that two optimizer state dicts are the same, entry for entry.

    Each param group has the same hyper-parameters and the same ``params``
    ids; ``state`` has the same parameter ids in the same order, each with the
    same entries in the same order. Tensors are compared bit for bit
    (``torch.equal``) or, given ``rtol=..., atol=...``, with
    ``torch.testing.assert_close``; other entries with ``==``.
    """
    groups_a, groups_b = a["param_groups"], b["param_groups"]
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups_a] == [
        {k: v for k, v in g.items() if k != "params"} for g in groups_b
    ]
    assert [g["params"] for g in groups_a] == [g["params"] for g in groups_b]
    assert list(a["state"]) == list(b["state"])
    for pid, entry in b["state"].items():
        assert list(a["state"][pid]) == list(entry), pid
        for key, value in entry.items():
            got = a["state"][pid][key]
            if isinstance(value, torch.Tensor) and tol:
                torch.testing.assert_close(got, value, msg=f"{pid} {key}", **tol)
            elif isinstance(value, torch.Tensor):
                assert isinstance(got, torch.Tensor) and torch.equal(got, value), (pid, key)
            else:
                assert got == value, (pid, key)


# ------------------------------------------------------------------------- training


def mean_square(model: nn.Module, batch: Any) -> torch.Tensor:
    """The default loss of :func:`train_steps`: ``model(batch).pow(2).mean()``."""
    return model(batch).pow(2).mean()


def sum_square(model: nn.Module, batch: Any) -> torch.Tensor:
    """A loss for :func:`train_steps`: ``model(batch).pow(2).sum()``."""
    return model(batch).pow(2).sum()


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    loss: Callable[[nn.Module, Any], torch.Tensor] = mean_square,
    *,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    after_step: Callable[[], None] | None = None,
    zero_grad_last: bool = False,
) -> list[float]:
    """Take one optimizer step per batch; return each step's loss.

    Each step is ``optimizer.zero_grad()``, ``loss(model, batch)``,
    ``backward(loss)`` (a framework's, e.g. ``fabric.backward``, or
    ``Tensor.backward``), ``optimizer.step()`` and then ``after_step()`` if
    given. With ``zero_grad_last=True`` ``optimizer.zero_grad()`` comes
    after ``optimizer.step()`` instead (the gradients are freed after each
    step, as ZeRO training loops do).
    ``batches`` is consumed lazily, so a generator that draws from the global
    RNG draws exactly as an inline loop would. Train a flattened model and its
    plain twin on the same list of batches to compare them.
    """
    losses = []
    for batch in batches:
        if not zero_grad_last:
            optimizer.zero_grad()
        value = loss(model, batch)
        backward(value)
        optimizer.step()
        if zero_grad_last:
            optimizer.zero_grad()
        if after_step is not None:
            after_step()
        losses.append(value.item())
    return losses


def cast_per_forward(plain: nn.Module, dtype: torch.dtype = torch.bfloat16) -> Callable[..., Any]:
    """Return the forward of ``plain`` with its float32 weights (and inputs) cast to ``dtype`` for each call.

    The reference of mixed precision that needs no library: ``torch.func.functional_call``
    with the cast weights, so that backward accumulates the low-precision gradients into
    ``plain``'s float32 parameters, as a policy's masters get them.
    """

    def forward(*args: torch.Tensor) -> torch.Tensor:
        weights = {name: p.to(dtype) for name, p in plain.named_parameters()}
        cast = [a.to(dtype) if torch.is_floating_point(a) else a for a in args]
        return torch.func.functional_call(plain, weights, tuple(cast))

    return forward


# --------------------------------------------------------------------------- snapshot

#: Attributes the library (or torch.nn.utils.parametrize) may put in a module's __dict__.
_LIB_ATTRS = ("parametrizations", "_flat_parametrize", "_flat_storage")
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_ABSENT = object()


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    """Return a bitwise image of ``t`` (None when it has no values: meta, lazy)."""
    if isinstance(t, nn.parameter.UninitializedTensorMixin) or t.is_meta:
        return None
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.clone().contiguous().reshape(-1)
    return t if t.dtype == torch.bool else t.view(torch.uint8)


def _describe(t: torch.Tensor) -> tuple[Any, ...]:
    if isinstance(t, nn.parameter.UninitializedTensorMixin):
        return (type(t),)
    return (type(t), tuple(t.shape), t.dtype, t.device, t.requires_grad, t.layout)


def _same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Record everything a failed call must leave untouched."""
    params = list(model.named_parameters(remove_duplicate=False))
    buffers = list(model.named_buffers(remove_duplicate=False))
    modules = []
    for name, module in model.named_modules(remove_duplicate=False):
        modules.append(
            {
                "name": name,
                "module": module,
                "type": type(module),
                "class_attrs": sorted(type(module).__dict__),
                "lib_attrs": {k: module.__dict__.get(k, _ABSENT) for k in _LIB_ATTRS},
                "children": list(module._modules.items()),
                "own_params": list(module._parameters.items()),
                "own_buffers": list(module._buffers.items()),
                "hooks": {h: list(getattr(module, h, {}).items()) for h in _HOOK_DICTS},
                "parametrized": sorted(getattr(module, "parametrizations", {}).keys())
                if parametrize.is_parametrized(module)
                else None,
            }
        )
    state = model.state_dict()
    storage = get_flat_storage(model)
    return {
        "params": [
            (n, p, _describe(p), _bits(p), p.grad, None if p.grad is None else _bits(p.grad))
            for n, p in params
        ],
        "buffers": [(n, b, _describe(b), _bits(b)) for n, b in buffers],
        "modules": modules,
        "state_keys": list(state),
        "state_values": {
            k: (_describe(v), _bits(v)) for k, v in state.items() if isinstance(v, torch.Tensor)
        },
        "storage": storage,
        "storage_state": None
        if storage is None
        else (
            storage.is_flattened,
            storage.group_names,
            # Read from the core: a call on the storage would first land per-tensor mode's writes.
            [id(g.flat) for g in core_of(storage).groups()],
            core_of(storage).param_infos,
            [_bits(g.flat) for g in core_of(storage).groups()],
        ),
    }


def assert_unchanged(model: nn.Module, snap: dict[str, Any]) -> None:
    """Assert that ``model`` is exactly as recorded by :func:`snapshot`."""
    now = snapshot(model)
    # Same parameter objects under the same names, same values and gradients.
    assert [n for n, *_ in now["params"]] == [n for n, *_ in snap["params"]]
    for (name, p, desc, bits, grad, grad_bits), (_, p2, desc2, bits2, grad2, grad_bits2) in zip(
        snap["params"], now["params"]
    ):
        assert p2 is p, f"parameter {name} was replaced"
        assert desc2 == desc, f"parameter {name} changed type/shape/dtype/device/requires_grad"
        assert _same_bits(bits, bits2), f"parameter {name} changed value"
        assert grad2 is grad, f"gradient of {name} was replaced"
        assert _same_bits(grad_bits, grad_bits2), f"gradient of {name} changed value"
    assert [n for n, *_ in now["buffers"]] == [n for n, *_ in snap["buffers"]]
    for (name, b, desc, bits), (_, b2, desc2, bits2) in zip(snap["buffers"], now["buffers"]):
        assert b2 is b, f"buffer {name} was replaced"
        assert desc2 == desc, f"buffer {name} changed type/shape/dtype/device"
        assert _same_bits(bits, bits2), f"buffer {name} changed value"
    # Same module tree, classes, library attributes, hooks.
    assert [m["name"] for m in now["modules"]] == [m["name"] for m in snap["modules"]]
    for before, after in zip(snap["modules"], now["modules"]):
        where = before["name"] or "<root>"
        assert after["module"] is before["module"], f"module {where} was replaced"
        assert after["type"] is before["type"], f"class of {where} changed"
        assert after["class_attrs"] == before["class_attrs"], f"class attributes of {where} changed"
        for key, value in before["lib_attrs"].items():
            assert after["lib_attrs"][key] is value, f"{where}.__dict__[{key!r}] changed"
        assert after["children"] == before["children"], f"children of {where} changed"
        assert [(k, id(v)) for k, v in after["own_params"]] == [
            (k, id(v)) for k, v in before["own_params"]
        ], f"_parameters of {where} changed"
        assert [(k, id(v)) for k, v in after["own_buffers"]] == [
            (k, id(v)) for k, v in before["own_buffers"]
        ], f"_buffers of {where} changed"
        assert after["hooks"] == before["hooks"], f"hooks of {where} changed"
        assert after["parametrized"] == before["parametrized"], f"parametrizations of {where} changed"
        had_child = "parametrizations" in dict(before["children"])  # torch's, from before registration
        if before["lib_attrs"]["parametrizations"] is _ABSENT and not had_child:
            assert "parametrizations" not in after["module"]._modules, f"{where} got a parametrizations child"
    # Same storage, mode and flat values; same state dict.
    assert get_flat_storage(model) is snap["storage"]
    if snap["storage_state"] is not None:
        was_flat, groups, flat_ids, infos, flat_bits = snap["storage_state"]
        storage = snap["storage"]
        assert storage.is_flattened == was_flat, "flat/unflattened mode changed"
        assert storage.group_names == groups
        flats = [g.flat for g in core_of(storage).groups()]
        assert [id(f) for f in flats] == flat_ids, "a flat parameter was replaced"
        assert core_of(storage).param_infos == infos
        for g, (a, b) in enumerate(zip(flat_bits, [_bits(f) for f in flats])):
            assert _same_bits(a, b), f"flat parameter of group {groups[g]} changed value"
    assert now["state_keys"] == snap["state_keys"], "state_dict keys changed"
    for key, (desc, bits) in snap["state_values"].items():
        desc2, bits2 = now["state_values"][key]
        assert desc2[1:4] == desc[1:4], f"state_dict entry {key} changed shape/dtype/device"
        assert _same_bits(bits, bits2), f"state_dict entry {key} changed value"


def assert_plain(model: nn.Module) -> None:
    """Assert that nothing of the library is left on ``model``."""
    assert get_flat_storage(model) is None
    for name, module in model.named_modules():
        for attr in ("_flat_parametrize", "_flat_storage"):
            assert attr not in module.__dict__, f"{name or '<root>'} keeps {attr}"
        assert not parametrize.is_parametrized(module), f"{name or '<root>'} is parametrized"
        assert not any(k.__dict__.get("_flat_parametrize_class") for k in type(module).__mro__), (
            f"{name or '<root>'} keeps an injected class"
        )


# ------------------------------------------------------------------ gloo launcher


class RankFailed(AssertionError):
    """A spawned rank raised, crashed or was killed."""


def spawn_gloo(
    worker: Callable[[int, int, Path], None],
    outdir: Path,
    *,
    world: int = 2,
    deadline_s: float = 150.0,
    grace_s: float = 20.0,
    collective_timeout_s: float = 60.0,
    fresh: bool = False,
) -> None:
    """Run ``worker(rank, world, outdir)`` on ``world`` gloo ranks on 127.0.0.1.

    The ranks are the session's warm processes of that world size (``_gloo_pool.py``), or new ones
    with ``fresh=True``. ``worker`` must be a module-level function (it is pickled). As soon as one
    rank fails, the others get ``grace_s`` seconds to finish (a worker that expects the failure
    records what it saw); after that, or after ``deadline_s`` in all, every rank still running is
    killed and :class:`RankFailed` reports each failure (a rank's traceback is in
    ``outdir/rank<r>.err``). A rank stuck in a collective fails after ``collective_timeout_s``.
    """
    launch = run_ranks(
        worker, outdir, world=world, deadline_s=deadline_s, grace_s=grace_s,
        collective_timeout_s=collective_timeout_s, fresh=fresh,
    )  # fmt: skip
    errors = []
    for rank, end in enumerate(launch.ends):
        if (outdir / f"rank{rank}.err").exists():
            errors.append(f"rank {rank} raised:\n{(outdir / f'rank{rank}.err').read_text()}")
        elif end != "ok":
            errors.append(f"rank {rank} {end}")
    if errors:
        raise RankFailed("\n".join(errors))


def save_result(outdir: Path, rank: int, name: str, result: Any) -> None:
    """Save ``result`` of scenario ``name`` on ``rank``, renamed into place (never half a file)."""
    torch.save(result, outdir / f"{name}.{rank}.tmp")
    (outdir / f"{name}.{rank}.tmp").rename(outdir / f"{name}.{rank}.pt")


def launch_gloo(worker: Callable[[int, int, Path], None], outdir: Path, *, world: int = 2) -> dict[str, Any]:
    """Run :func:`spawn_gloo`; return ``outdir``, the failure report (if any), the seconds and ``world``."""
    start = time.monotonic()
    try:
        spawn_gloo(worker, outdir, world=world)
        failure = "no rank failed"
    except RankFailed as error:
        failure = str(error)
    return {"outdir": outdir, "failure": failure, "seconds": time.monotonic() - start, "world": world}


def launch_results(launch: dict[str, Any], name: str) -> list[Any]:
    """Return each rank's result of scenario ``name``; fail with the launch's errors if one is missing."""
    paths = [launch["outdir"] / f"{name}.{rank}.pt" for rank in range(launch["world"])]
    if not all(path.exists() for path in paths):
        pytest.fail(f"scenario {name!r} left no result on every rank; the launch said:\n{launch['failure']}")
    return [torch.load(path, weights_only=False) for path in paths]


@contextlib.contextmanager
def one_buffer_collectives() -> Iterator[None]:
    """NCCL's path on gloo: a ``ShardedOptimizer`` built inside takes one padded buffer where it pads little.

    Its collectives are told at construction that the backend is one of one-buffer collectives, so the
    whole-tensor plan is laid out for them (units of buckets); gloo runs ``reduce_scatter`` and
    ``all_gather`` too.
    """
    from flatten_parametrize._distributed.sharded_collectives import Collectives

    init = Collectives.__init__

    def forced(self: Collectives, *args: Any) -> None:
        init(self, *args)
        self.by_owner = False

    Collectives.__init__ = forced  # type: ignore[method-assign]
    try:
        yield
    finally:
        Collectives.__init__ = init  # type: ignore[method-assign]
