"""No leaks: thousands of passes and mode toggles keep memory, hooks, classes and cached views flat.

Each test measures signals that do not depend on how many objects the interpreter
happens to track: the process's resident memory, the number of tensors alive, the hooks
on modules and flat parameters, the library's generated classes and the entries of the
per-thread view caches, before and after a long run, with generous bounds (a leak of one
tensor per pass would exceed them many times over).
"""

from __future__ import annotations

import copy
import gc
import resource
import threading
import weakref

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage

from _helpers import core_of

WIDTH = 128  # 4 layers of 128x128: a flat buffer of 264 KiB, so a leaked buffer per pass shows
FORWARDS = 2000
TOGGLES = 500


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.LayerNorm(WIDTH))


def _rss() -> int:
    """Resident memory of this process in bytes (peak resident memory where /proc is missing)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # pragma: no cover


def _tensors_alive() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def _hooks(model: nn.Module) -> int:
    """Every hook on the modules, on the flat parameters and on the global module hook lists."""
    count = 0
    for module in model.modules():
        for name, value in vars(module).items():
            if name.endswith("hooks") and isinstance(value, dict):
                count += len(value)
    for param in model.parameters():
        count += len(param._backward_hooks or {})
        count += len(getattr(param, "_post_accumulate_grad_hooks", None) or {})
    glob = torch.nn.modules.module
    for name in dir(glob):
        if name.startswith("_global_") and name.endswith("hooks"):
            count += len(getattr(glob, name))
    return count


def _cached_entries(storage: object) -> list[int]:
    """Entries of this thread's view cache, per group."""
    return [len(group.views._tls.__dict__) for group in core_of(storage).groups()]  # type: ignore[attr-defined]


def _generated_classes() -> int:
    gc.collect()
    return sum(len(klass.__subclasses__()) for klass in (nn.Linear, nn.LayerNorm, nn.Sequential))


def test_thousands_of_passes_keep_memory_tensors_hooks_and_caches_flat():
    """2000 training / no_grad / inference passes: no growth in memory, tensors, hooks or cache entries."""
    model = _model()
    storage = register_flat_storage(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(8, WIDTH)

    def passes(count: int) -> None:
        for i in range(count):
            if i % 3 == 0:
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
            elif i % 3 == 1:
                with torch.no_grad():
                    model(x)
            else:
                with torch.inference_mode():
                    model(x)

    passes(60)  # warm-up: optimizer state, allocator pools, every cache mode
    tensors, hooks, rss = _tensors_alive(), _hooks(model), _rss()
    passes(FORWARDS)
    assert _hooks(model) == hooks
    assert _tensors_alive() <= tensors + 10
    assert max(_cached_entries(storage)) <= 3, "more than one cache entry per grad mode"
    assert _rss() - rss < 48 * 2**20, f"resident memory grew by {(_rss() - rss) / 2**20:.1f} MiB"


def test_hundreds_of_mode_toggles_keep_memory_tensors_hooks_and_classes_flat():
    """500 unflatten/flatten cycles (with gradients, edits and passes) leave nothing behind."""
    model = _model()
    storage = register_flat_storage(model)
    x = torch.randn(8, WIDTH)
    types_before = [type(m) for m in model.modules()]

    def toggles(count: int) -> None:
        for i in range(count):
            model(x).sum().backward()
            if i % 2:
                storage.unflatten()
                with torch.no_grad():
                    model[0].weight.mul_(1.0)
                model(x).sum().backward()
                storage.flatten()
            else:
                with storage.unflattened():
                    model[2].bias.grad = None
            storage["0"].grad = None

    toggles(20)
    tensors, hooks, rss, classes = _tensors_alive(), _hooks(model), _rss(), _generated_classes()
    toggles(TOGGLES)
    assert [type(m) for m in model.modules()] == types_before, "toggling minted new classes"
    assert _generated_classes() == classes
    assert _hooks(model) == hooks
    assert _tensors_alive() <= tensors + 10
    assert _rss() - rss < 48 * 2**20, f"resident memory grew by {(_rss() - rss) / 2**20:.1f} MiB"


def test_using_state_dicts_and_copies_leave_nothing_behind():
    """Repeated using(), state dict loads in both forms and deep copies keep tensors and classes flat."""
    model = _model()
    storage = register_flat_storage(model)
    x = torch.randn(8, WIDTH)
    ema = storage["0"].detach().clone()

    def cycles(count: int) -> None:
        for _ in range(count):
            with storage.using([ema]):
                model(x)
            model.load_state_dict(model.state_dict())
            model.load_state_dict(storage.flat_state_dict())
            clone = copy.deepcopy(model)
            clone(x).sum().backward()
            del clone

    cycles(10)
    tensors, hooks, classes, rss = _tensors_alive(), _hooks(model), _generated_classes(), _rss()
    cycles(200)
    assert _hooks(model) == hooks
    assert _generated_classes() <= classes, "deep copies left their classes behind"
    assert _tensors_alive() <= tensors + 10
    assert _rss() - rss < 48 * 2**20, f"resident memory grew by {(_rss() - rss) / 2**20:.1f} MiB"


def test_views_cached_by_finished_threads_are_freed():
    """Each thread caches its own views; when the thread ends, its cache (and the tensors) go."""
    model = _model()
    register_flat_storage(model)
    x = torch.randn(4, WIDTH)

    def work() -> None:
        model(x).sum().backward()
        with torch.no_grad():
            model(x)

    work()
    tensors = _tensors_alive()
    for _ in range(40):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    assert _tensors_alive() <= tensors + 10


@pytest.mark.parametrize("last", ["training_pass", "no_grad_pass", "mode_toggle", "deepcopy"])
def test_a_flattened_model_is_garbage_collected(last):
    """No reference cycle outlives a flattened model: model, storage and flat buffer are freed."""
    model = _model()
    storage = register_flat_storage(model)
    x = torch.randn(2, WIDTH)
    if last == "training_pass":
        model(x).sum().backward()
    elif last == "no_grad_pass":
        with torch.no_grad():
            model(x)
    elif last == "mode_toggle":
        model(x).sum().backward()
        with storage.unflattened():
            pass
    else:
        model = copy.deepcopy(model)  # the copy trains; both must be freed
        storage = get_flat_storage(model)
        model(x).sum().backward()
    refs = [weakref.ref(model), weakref.ref(storage), weakref.ref(storage["0"])]
    del model, storage
    gc.collect()
    alive = [name for name, ref in zip(["model", "storage", "flat parameter"], refs) if ref() is not None]
    assert not alive, f"still alive: {alive}"


def test_a_removed_storage_lets_go_of_the_model():
    """After remove_flat_storage the model holds no library object and the coordinator is freed."""
    model = _model()
    storage = register_flat_storage(model)
    model(torch.randn(2, WIDTH)).sum().backward()
    flat = weakref.ref(storage["0"])
    ref = weakref.ref(storage)
    remove_flat_storage(model)
    del storage
    gc.collect()
    assert ref() is None and flat() is None and get_flat_storage(model) is None
    model[0].weight.grad = None
    model(torch.randn(2, WIDTH)).sum().backward()  # still a working plain model
    assert model[0].weight.grad is not None
