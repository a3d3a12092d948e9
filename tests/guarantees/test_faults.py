"""Fault injection: a step that fails inside an operation leaves the module exactly as before.

Each operation (registration, ``flatten()``, ``unflatten()``, ``load_state_dict()`` in both
forms and both modes, ``remove_flat_storage()``) is first run once cleanly on a freshly
built module, recording its steps. It is then rerun on an identical fresh module once per
step, with that one step made to raise :class:`InjectedFault`:

- ``call`` faults: each torch primitive of :data:`CALL_POINTS` is patched to raise on
  its k-th call, and each function of ``flatten_parametrize`` that the clean run called
  is made to raise (through a trace function) on entering its k-th call, for every k
  that the clean run reached: whatever the library's helpers are called;
- ``line`` faults: each line of ``flatten_parametrize`` that the clean run executed is
  made to raise (through a trace function) at its first and at its last execution, so
  that a failure is tried before every statement of the library, at the start and at the
  end of every loop.

After each failure the error must reach the caller (possibly wrapped by torch, e.g. "While
copying the parameter named ..."), and the operation must be all or nothing: either the
module is bit-for-bit as before (``assert_unchanged`` of ``tests/_helpers.py``: same
parameter objects, values, gradients, classes, hooks, state dict, storage and mode), it
computes the same output, and retrying the operation gives exactly the clean run's
result; or (a fault after the operation's last change, at its ``return`` say, cannot be
undone) the module is exactly as after the clean run, in both modes. An operation that
absorbs a fault must give the clean run's result.
"""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import linecache
import os
import pickle
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import flatten_parametrize
from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage
from flatten_parametrize._core.flat_parameter import FlatParameter
from flatten_parametrize._guards import decay_check
from flatten_parametrize._install import module_classes

from _helpers import assert_plain, assert_unchanged, snapshot

PACKAGE_DIR = os.path.dirname(os.path.abspath(flatten_parametrize.__file__)) + os.sep


#: Where the scenarios offload (this file runs them thousands of times): a RAM file system where there is one.
RAM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class InjectedFault(Exception):
    """The error that a patched step raises (deliberately not a RuntimeError: nothing expects it)."""


# --------------------------------------------------------------------------- the module


class Net(nn.Module):
    """A root parameter, a tied embedding/head, BatchNorm buffers, a frozen layer and a layer left out."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.scale = nn.Parameter(torch.randn(4))
        self.emb = nn.Embedding(6, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.extra = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            self.body[1].running_mean.uniform_(-1, 1)
            self.body[1].running_var.uniform_(0.5, 2)
            self.body[1].num_batches_tracked.fill_(3 + seed)
        self.eval()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) * self.scale
        return self.head(self.extra(self.frozen(self.body(x))))


#: Group "main" holds the root's own parameter, the tied weight and the body; "frozen"
#: the frozen layer (requires_grad=False); ``extra`` is left out of every group.
GROUPS = {"main": ["scale", "emb.weight", "body.*"], "frozen": ["frozen.*"]}
ALIGN = 4  # padding between slots
TOKENS = torch.arange(5)


@functools.cache
def _template(seed: int) -> Net:
    return Net(seed)


def _net(seed: int = 0) -> Net:
    """A fresh Net (a deep copy of a cached one: the same values every time, built fast)."""
    return copy.deepcopy(_template(seed))


def _train_step(model: nn.Module) -> None:
    """One forward/backward: gradients on every trainable parameter."""
    model(TOKENS).pow(2).sum().backward()


def _registered(seed: int = 0) -> tuple[Net, Any]:
    model = _net(seed)
    storage = register_flat_storage(model, GROUPS, align=ALIGN)
    _train_step(model)
    return model, storage


def _edit_unflattened(model: Net) -> None:
    """Changes of every kind that flatten() must write back: in place, reassigned, .data, .grad."""
    with torch.no_grad():
        model.scale.mul_(-2)
    model.body[0].weight = nn.Parameter(torch.linspace(-1, 1, 16).reshape(4, 4))
    model.body[1].bias.data = torch.full((4,), 0.25)
    model.emb.weight.grad = torch.ones(6, 4)
    model.body[0].bias.grad = None


def _setup_register() -> tuple[nn.Module, Callable[[], Any]]:
    model = _net()
    _train_step(model)  # plain gradients exist at registration
    return model, lambda: register_flat_storage(model, GROUPS, align=ALIGN)


def _setup_flatten_edited() -> tuple[nn.Module, Callable[[], Any]]:
    model, storage = _registered()
    storage.unflatten()
    _edit_unflattened(model)
    return model, storage.flatten


def _setup_flatten_fresh_grads() -> tuple[nn.Module, Callable[[], Any]]:
    model = _net()
    storage = register_flat_storage(model, GROUPS, align=ALIGN)
    storage.unflatten()
    _train_step(model)  # gradients born in unflattened mode: flatten() allocates the flat grads
    _edit_unflattened(model)
    return model, storage.flatten


def _setup_unflatten() -> tuple[nn.Module, Callable[[], Any]]:
    model, storage = _registered()
    return model, storage.unflatten


def _detached(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with cloned values (keeping the ``_metadata`` that torch reads versions from)."""
    for key, value in state.items():
        state[key] = value.clone()
    return state


@functools.cache
def _source(form: str) -> dict[str, Any]:
    """A valid state dict of another Net (seed 1), in the unflattened or the flat form."""
    if form == "plain":
        return _detached(_net(seed=1).state_dict())
    source = _net(seed=1)
    return _detached(register_flat_storage(source, GROUPS, align=ALIGN).flat_state_dict())


def _setup_load(form: str, flat_mode: bool) -> Callable[[], tuple[nn.Module, Callable[[], Any]]]:
    def setup() -> tuple[nn.Module, Callable[[], Any]]:
        model, storage = _registered()
        if not flat_mode:
            storage.unflatten()
        state = copy.copy(_source(form))  # load_state_dict never changes the caller's dict
        return model, lambda: model.load_state_dict(state)

    return setup


def _setup_remove_flat() -> tuple[nn.Module, Callable[[], Any]]:
    model, _ = _registered()
    return model, lambda: remove_flat_storage(model)


def _setup_remove_unflattened() -> tuple[nn.Module, Callable[[], Any]]:
    model, storage = _registered()
    storage.unflatten()
    _edit_unflattened(model)
    return model, lambda: remove_flat_storage(model)


def _setup_replace_flat_param() -> tuple[nn.Module, Callable[[], Any]]:
    model, storage = _registered()
    new = nn.Parameter(storage["main"].detach() * 2)
    return model, lambda: setattr(model, "flat_param_main", new)


def _setup_land_parameter() -> tuple[nn.Module, Callable[[], Any]]:
    model, _ = _registered()
    new = nn.Parameter(torch.linspace(-1, 1, 16).reshape(4, 4))
    return model, lambda: setattr(model.body[0], "weight", new)


def _setup_pickle() -> tuple[nn.Module, Callable[[], Any]]:
    model, _ = _registered()
    return model, lambda: pickle.loads(pickle.dumps(model))


def _replace_body_layer(model: Net) -> None:
    torch.manual_seed(5)
    model.body[0] = nn.Linear(4, 4)


def _setup_flatten_after_replacement() -> tuple[nn.Module, Callable[[], Any]]:
    model, storage = _registered()
    storage.unflatten()
    _edit_unflattened(model)
    _replace_body_layer(model)
    return model, storage.flatten


def _setup_remove_after_replacement() -> tuple[nn.Module, Callable[[], Any]]:
    model, _ = _registered()
    _replace_body_layer(model)
    return model, lambda: remove_flat_storage(model)


class _Packed(torch.Tensor):
    """A tensor subclass (as a quantized weight is): it cannot live in a flat buffer."""


class _Rehosted(nn.Linear):
    """A swapped-in layer that takes over the old one's parameter objects (as torchao's QAT prepare)."""


def _swap_and_release(model: Net) -> None:
    """Unflattened mode: a swap that re-hosts frozen's parameters, a weight that leaves the storage."""
    with torch.device("meta"):
        new = _Rehosted(4, 4)
    new.weight, new.bias = model.frozen.weight, model.frozen.bias
    model.frozen = new
    packed = model.body[1].weight.detach().clone().as_subclass(_Packed)
    model.body[1].weight = nn.Parameter(packed, requires_grad=False)


def _setup_flatten_after_swap_and_release() -> tuple[nn.Module, Callable[[], Any]]:
    model, storage = _registered()
    storage.unflatten()
    _edit_unflattened(model)
    _swap_and_release(model)
    return model, storage.flatten


def _setup_flatten_after_swap_with_released_holders() -> tuple[nn.Module, Callable[[], Any]]:
    """Disk offload loaded back and ensemble stacks dropped hold nothing: flatten() lays the groups out."""
    model, storage = _registered()
    directory = tempfile.mkdtemp(dir=RAM_DIR)
    storage.offload_to_disk(directory)
    storage.load_to_memory()  # deletes the files
    os.rmdir(directory)
    storage.stack(2)  # dropped at once
    storage.unflatten()
    _swap_and_release(model)
    return model, storage.flatten


SCENARIOS: dict[str, Callable[[], tuple[nn.Module, Callable[[], Any]]]] = {
    "register": _setup_register,
    "flatten_after_edits": _setup_flatten_edited,
    "flatten_new_grads": _setup_flatten_fresh_grads,
    "unflatten": _setup_unflatten,
    "load_plain_flat_mode": _setup_load("plain", flat_mode=True),
    "load_flat_form_flat_mode": _setup_load("flat", flat_mode=True),
    "load_plain_unflattened": _setup_load("plain", flat_mode=False),
    "load_flat_form_unflattened": _setup_load("flat", flat_mode=False),
    "remove_flat_mode": _setup_remove_flat,
    "remove_unflattened_edits": _setup_remove_unflattened,
    "replace_flat_param": _setup_replace_flat_param,
    "land_parameter": _setup_land_parameter,
    "pickle_round_trip": _setup_pickle,
    "flatten_after_replacement": _setup_flatten_after_replacement,
    "remove_after_replacement": _setup_remove_after_replacement,
    "flatten_after_swap_and_release": _setup_flatten_after_swap_and_release,
    "flatten_after_swap_with_released_holders": _setup_flatten_after_swap_with_released_holders,
}

#: Line faults run on these scenarios: together they execute every library line that the
#: others execute (test_line_scenarios_execute_every_line_of_every_scenario checks it).
LINE_SCENARIOS = [
    "register",
    "flatten_new_grads",
    "unflatten",
    "load_plain_flat_mode",
    "load_flat_form_unflattened",
    "remove_flat_mode",
    "remove_unflattened_edits",
    "replace_flat_param",
    "land_parameter",
    "pickle_round_trip",
    "flatten_after_replacement",
    "remove_after_replacement",
    "flatten_after_swap_and_release",
    "flatten_after_swap_with_released_holders",
]

#: Library modules that only plan (read the module, change nothing): no line faults there.
PLANNING_MODULES = ("grouping.py", "layout.py")


# --------------------------------------------------------------------------- outcomes


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach().clone().contiguous().reshape(-1)
    return t if t.dtype == torch.bool else t.view(torch.uint8)


def _output(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


def _params(model: nn.Module) -> list[tuple[Any, ...]]:
    return [
        (n, type(p).__name__, p.dtype, tuple(p.shape), p.requires_grad, _bits(p), _bits(p.grad))
        for n, p in model.named_parameters(remove_duplicate=False)
    ]


def outcome(model: nn.Module) -> dict[str, Any]:
    """What an operation produced, independent of object identity (seen in both modes)."""
    storage = get_flat_storage(model)
    result = {
        "mode": None if storage is None else storage.is_flattened,
        "params": _params(model),
        "state": [(k, _bits(v)) for k, v in model.state_dict().items()],
        "classes": [(n, type(m).__name__, type(m).__mro__[1:]) for n, m in model.named_modules()],
        "parametrized": [n for n, m in model.named_modules() if parametrize.is_parametrized(m)],
        "output": _bits(_output(model)),
    }
    if storage is not None:  # what the other mode shows (stale originals, gradients, ...)
        if storage.is_flattened:
            with storage.unflattened():
                result["other_mode"] = _params(model)
        else:
            storage.flatten()
            result["other_mode"] = _params(model)
            storage.unflatten()
    return result


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def assert_same_outcome(expected: dict[str, Any], got: dict[str, Any]) -> None:
    for key in expected:
        assert _same(expected[key], got[key]), f"{key} differs from the clean run's result"


# --------------------------------------------------------------------------- fault points


@dataclass(frozen=True)
class CallPoint:
    """A callable (or a property setter, ``setter=True``) that can be made to fail."""

    label: str
    owner: Any
    attr: str
    setter: bool = False


CALL_POINTS = [
    # torch primitives that write, allocate or re-class, wherever the library (or torch
    # code on its behalf) calls them; pure view ops (view, detach, narrow, reshape) are
    # covered by the line faults at the library lines that call them
    CallPoint("Tensor.copy_", torch.Tensor, "copy_"),
    CallPoint("Tensor.split", torch.Tensor, "split"),
    CallPoint("Tensor.clone", torch.Tensor, "clone"),
    CallPoint("Tensor.zero_", torch.Tensor, "zero_"),
    CallPoint("Tensor.requires_grad_", torch.Tensor, "requires_grad_"),
    CallPoint("Tensor._make_subclass", torch.Tensor, "_make_subclass"),
    CallPoint("Tensor.data (set)", torch.Tensor, "data", setter=True),
    CallPoint("Tensor.grad (set)", torch.Tensor, "grad", setter=True),
    CallPoint("torch.zeros_like", torch, "zeros_like"),
    CallPoint("torch.empty", torch, "empty"),
    CallPoint("Module.register_parameter", nn.Module, "register_parameter"),
    CallPoint("Module._load_from_state_dict", nn.Module, "_load_from_state_dict"),
    CallPoint("ParametrizationList.__init__", parametrize.ParametrizationList, "__init__"),
]


def _replacement(point: CallPoint, before_call: Callable[[], None]) -> Any:
    original = inspect.getattr_static(point.owner, point.attr)
    if point.setter:

        def fget(self: Any) -> Any:
            return original.__get__(self, type(self))

        def fset(self: Any, value: Any) -> None:
            before_call()
            original.__set__(self, value)

        return property(fget, fset)
    if isinstance(original, (staticmethod, classmethod)):
        original = original.__func__
        kind: Any = type(inspect.getattr_static(point.owner, point.attr))
    else:
        kind = None
        original = getattr(point.owner, point.attr) if inspect.ismodule(point.owner) else original

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before_call()
        return original(*args, **kwargs)

    return kind(wrapper) if kind is not None else wrapper


@contextmanager
def call_faults(points: list[CallPoint], fail: tuple[str, int] | None = None) -> Iterator[Counter[str]]:
    """Patch ``points``; count their calls; raise on call ``fail[1]`` of point ``fail[0]``."""
    calls: Counter[str] = Counter()
    with pytest.MonkeyPatch.context() as patch:
        for point in points:

            def before_call(label: str = point.label) -> None:
                calls[label] += 1
                if fail is not None and fail == (label, calls[label]):
                    raise InjectedFault(f"injected fault: call {calls[label]} of {label}")

            patch.setattr(point.owner, point.attr, _replacement(point, before_call))
        yield calls


@contextmanager
def no_collection() -> Iterator[None]:
    """Keep the cyclic garbage collector out of the operation, so every run calls the same functions.

    The library's finalizers (a storage's leaf registry, a state dict's aliases) run when
    their object dies; the cyclic collector would run them at a moment that differs from
    one run to the next, with garbage left by an earlier run. Reference counting alone
    frees what the operation drops, at the same place each time; the collector runs
    between the runs.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_GENERATOR = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _library_code(path: str) -> bool:
    """Whether faults go into code of ``path``: the library, except the modules that only plan."""
    return path.startswith(PACKAGE_DIR) and not path.endswith(PLANNING_MODULES)


@contextmanager
def function_faults(fail: tuple[tuple[str, int, str], int] | None = None) -> Iterator[Counter[Any]]:
    """Count calls of library functions; raise on entering call ``fail[1]`` of function ``fail[0]``.

    A function is keyed by its file, first line and name, so every helper of the library
    is a fault point whatever it is called. Generators (comprehensions included) are left
    to the line faults: their "calls" are resumptions, and closing one must not fail.
    """
    calls: Counter[tuple[str, int, str]] = Counter()

    def start(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and not code.co_flags & _GENERATOR and _library_code(code.co_filename):
            key = (code.co_filename, code.co_firstlineno, code.co_name)
            calls[key] += 1
            if fail is not None and fail == (key, calls[key]):
                raise InjectedFault(f"injected fault: call {calls[key]} of {_show(key[:2])} {key[2]}")

    previous = sys.gettrace()
    sys.settrace(start)
    try:
        yield calls
    finally:
        sys.settrace(previous)


def _is_with(where: tuple[str, int]) -> bool:
    return linecache.getline(*where).lstrip().startswith(("with ", "async with "))


@contextmanager
def line_faults(fail: tuple[tuple[str, int], int] | None = None) -> Iterator[Counter[tuple[str, int]]]:
    """Count executions of library lines; raise before execution ``fail[1]`` of line ``fail[0]``.

    Leaving a ``with`` block reports its line again, just before ``__exit__``: that is not a
    step (nothing can fail between a block's last statement and its exit), so it is not
    counted, and no fault skips an ``__exit__``.
    """
    seen: Counter[tuple[str, int]] = Counter()
    open_blocks: dict[tuple[int, int], Any] = {}  # (frame id, line) -> frame, kept alive

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            where = (frame.f_code.co_filename, frame.f_lineno)
            if _is_with(where):
                key = (id(frame), frame.f_lineno)
                if open_blocks.pop(key, None) is not None:
                    return local
                open_blocks[key] = frame
            seen[where] += 1
            if fail is not None and fail == (where, seen[where]):
                raise InjectedFault(f"injected fault: execution {seen[where]} of {_show(where)}")
        return local

    def start(frame: Any, event: str, arg: Any) -> Any:
        path = frame.f_code.co_filename
        wanted = path == fail[0][0] if fail is not None else _library_code(path)
        return local if wanted else None

    previous = sys.gettrace()
    sys.settrace(start)
    try:
        yield seen
    finally:
        sys.settrace(previous)
        open_blocks.clear()


def _show(where: tuple[str, int]) -> str:
    path, line = where
    return f"{os.path.relpath(path, os.path.dirname(PACKAGE_DIR.rstrip(os.sep)))}:{line}"


def _mentions_fault(exc: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, InjectedFault) or "injected fault:" in str(current):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


# --------------------------------------------------------------------------- the check


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _try_fault(
    name: str, fault: Callable[[], Any], reached: Callable[[Any], bool], reference: dict[str, Any]
) -> str | None:
    """Run scenario ``name`` with one fault; return a description of what went wrong, if anything."""
    model, op = _fresh(name)
    was_plain = get_flat_storage(model) is None
    before = snapshot(model)
    output = _bits(_output(model))
    raised: BaseException | None = None
    with no_collection(), fault() as counter:
        try:
            op()
        except BaseException as exc:
            raised = exc
    if not reached(counter):
        return "the fault was not reached (the operation is not deterministic)"
    stage = "after the failure"
    try:
        if raised is None:  # the fault was absorbed: the operation must have done its job
            stage = "the fault was absorbed, but"
            assert_same_outcome(reference, outcome(model))
            return None
        assert _mentions_fault(raised), f"the fault was replaced by {type(raised).__name__}: {raised}"
        try:
            assert_unchanged(model, before)
            if was_plain:
                assert_plain(model)
            assert torch.equal(_bits(_output(model)), output), "the output changed"  # type: ignore[arg-type]
        except Exception as unchanged_error:
            # All or nothing: a fault after the operation's last change (at its `return`,
            # say) cannot be undone, and then the operation must be complete.
            try:
                assert_same_outcome(reference, outcome(model))
            except Exception:
                raise unchanged_error from None
            return None
        stage = "retrying without the fault"
        op()
        assert_same_outcome(reference, outcome(model))
    except Exception as exc:
        text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        return f"{stage}: {type(exc).__name__}: {text}"
    return None


def _fresh(name: str) -> tuple[nn.Module, Callable[[], Any]]:
    """Build scenario ``name`` from the same process state each time.

    The library keeps two things per process: the classes it shares between modules of one
    class (``_install/module_classes.make_class``, made by the first registration of each) and
    the optimizer check it installs once (``_guards/decay_check.watch_optimizers``). Each run
    starts with no shared class and the check installed, so that every run makes the same calls
    whatever ran before it, and the making of each class is tried with a fault too.
    """
    module_classes._SHARED.clear()
    decay_check.watch_optimizers(FlatParameter)
    return SCENARIOS[name]()


def _clean_run(name: str, counting: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    # No garbage of earlier tests: a storage they left in a reference cycle stays in the library's
    # weak registries until the collector runs, and its calls would count here but not in every
    # run after (the collector runs between them); with fewer calls counted, each is reached.
    gc.collect()
    model, op = _fresh(name)
    # What _try_fault does before the operation: the view cache remembers which grad mode
    # read last (a read in another one scans for `.data` writes), so the counts depend on it.
    snapshot(model)
    _output(model)
    with no_collection(), counting() as counter:
        op()
    return counter, outcome(model)


def _report(name: str, tried: int, failures: list[str]) -> str:
    shown = "\n  ".join(failures[:25])
    more = f"\n  ... {len(failures) - 25} more" if len(failures) > 25 else ""
    return f"{name}: {len(failures)} of {tried} injected faults broke the rule:\n  {shown}{more}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_failing_call_leaves_the_module_as_before(name):
    """A torch primitive failing at any of its calls leaves the module unchanged."""
    counts, reference = _clean_run(name, lambda: call_faults(CALL_POINTS))
    exercised = [p for p in CALL_POINTS if counts[p.label]]
    assert any(p.owner is torch.Tensor for p in exercised), "no torch primitive was exercised"
    failures, tried = [], 0
    for point in exercised:
        for k in range(1, counts[point.label] + 1):
            tried += 1
            problem = _try_fault(
                name,
                lambda point=point, k=k: call_faults([point], (point.label, k)),
                lambda counter, point=point, k=k: counter[point.label] >= k,
                reference,
            )
            if problem is not None:
                failures.append(f"{point.label} call {k}/{counts[point.label]}: {problem}")
    assert not failures, _report(name, tried, failures)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_failing_library_function_leaves_the_module_as_before(name):
    """Any function of the library failing at any of its calls leaves the module unchanged."""
    counts, reference = _clean_run(name, function_faults)
    assert counts, "the operation called no library function"
    failures, tried = [], 0
    for key, count in sorted(counts.items()):
        for k in range(1, count + 1):
            tried += 1
            problem = _try_fault(
                name,
                lambda key=key, k=k: function_faults((key, k)),
                lambda counter, key=key, k=k: counter[key] >= k,
                reference,
            )
            if problem is not None:
                failures.append(f"{_show(key[:2])} {key[2]} call {k}/{count}: {problem}")
    assert not failures, _report(name, tried, failures)


@pytest.mark.parametrize("name", LINE_SCENARIOS)
def test_a_failing_line_leaves_the_module_as_before(name):
    """A failure before any library line, at its first or last execution, leaves the module unchanged."""
    seen, reference = _clean_run(name, line_faults)
    assert seen, "the operation ran no library code"
    failures, tried = [], 0
    for where, count in sorted(seen.items()):
        for occurrence in sorted({1, count}):
            tried += 1
            problem = _try_fault(
                name,
                lambda where=where, occurrence=occurrence: line_faults((where, occurrence)),
                lambda counter, where=where, occurrence=occurrence: counter[where] >= occurrence,
                reference,
            )
            if problem is not None:
                source = linecache.getline(where[0], where[1]).strip()
                failures.append(f"{_show(where)} ({occurrence}/{count}) `{source}`: {problem}")
    assert not failures, _report(name, tried, failures)


def test_line_scenarios_execute_every_line_of_every_scenario():
    """The scenarios that get line faults execute every library line that any scenario executes."""
    executed = {name: set(_clean_run(name, line_faults)[0]) for name in SCENARIOS}
    covered = set().union(*(executed[name] for name in LINE_SCENARIOS))
    missing = {name: sorted(_show(w) for w in lines - covered) for name, lines in executed.items()}
    assert not any(missing.values()), f"add a line-fault scenario for {missing}"
