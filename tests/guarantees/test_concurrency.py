"""Threads: inference under no_grad / inference_mode beside training gives correct outputs and gradients.

The guarantee these tests pin (README, "Guarantees"): forward and backward passes of a
flattened model may run concurrently from several threads, each in its own grad mode;
every thread gets its own cached views (grad mode is thread-local), so an inference
thread never hands autograd-free views to a training thread or the reverse, and
concurrent backward passes accumulate into the flat gradients like into plain
parameters. What changes the weights or the storage (optimizer steps, ``flatten()`` /
``unflatten()``, ``using()``, ``load_state_dict``, ``.to()``, ``remove_flat_storage``)
must not overlap a forward pass in another thread, as for any PyTorch module; a pass
that starts after such a change sees it.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

from flatten_parametrize import register_flat_storage

from _helpers import TiedLM

THREADS = 3  # inference threads beside the training thread
STEPS = 60


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 6), nn.Tanh())


def _run_threads(*targets: Callable[[], None]) -> None:
    """Start every target at once (barrier) and re-raise the first error of any thread."""
    barrier = threading.Barrier(len(targets))
    errors: list[BaseException] = []

    def wrap(target: Callable[[], None]) -> Callable[[], None]:
        def body() -> None:
            try:
                barrier.wait()
                target()
            except BaseException as exc:  # reported below
                errors.append(exc)
                barrier.abort()

        return body

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_inference_threads_beside_a_training_thread_get_correct_outputs_and_gradients(mode):
    """Inference threads and a training thread share one flattened model; each gets its correct result."""
    plain = _model()
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)
    x = torch.randn(5, 6)
    with torch.no_grad():
        expected_out = plain(x)
    plain(x).pow(2).sum().backward()
    expected_grads = {name: p.grad.clone() for name, p in plain.named_parameters()}
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode

    def infer() -> None:
        for _ in range(STEPS):
            with context():
                out = model(x)
                view = model[0].weight
            assert not out.requires_grad and view.grad_fn is None  # no autograd graph
            torch.testing.assert_close(out, expected_out, rtol=1e-6, atol=1e-6)

    def train() -> None:
        for _ in range(STEPS):
            storage["0"].grad = None
            out = model(x)
            assert out.requires_grad and model[0].weight.grad_fn is not None
            out.pow(2).sum().backward()
            for name, grad in storage.named_grads():
                torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)

    _run_threads(train, *[infer] * THREADS)


def test_inference_threads_follow_the_optimizer_steps_of_a_training_thread():
    """After each optimizer step, a later inference pass in another thread sees the new weights."""
    plain = TiedLM()
    model = copy.deepcopy(plain)
    register_flat_storage(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tokens = torch.randint(0, 11, (3, 4))
    lock = threading.Lock()  # steps must not overlap a forward pass in another thread
    checked = []

    def infer() -> None:
        reference = copy.deepcopy(plain)
        for _ in range(STEPS):
            with lock, torch.no_grad():
                out = model(tokens)
                reference.load_state_dict(model.state_dict())
                expected = reference(tokens)
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
            checked.append(1)

    def train() -> None:
        for _ in range(STEPS // 2):
            opt.zero_grad()
            model(tokens).logsumexp(-1).sum().backward()
            with lock:
                opt.step()

    _run_threads(train, *[infer] * THREADS)
    assert len(checked) == THREADS * STEPS


def test_concurrent_backward_passes_accumulate_into_the_flat_gradient():
    """Several threads running forward+backward at once sum their gradients into the flat grad."""
    plain = TiedLM()
    model = copy.deepcopy(plain)
    storage = register_flat_storage(model)
    batches = [torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    rounds = 15

    def train(tokens: torch.Tensor) -> Callable[[], None]:
        def body() -> None:
            for _ in range(rounds):
                model(tokens).logsumexp(-1).sum().backward()

        return body

    _run_threads(*[train(tokens) for tokens in batches])
    for tokens in batches:
        (plain(tokens).logsumexp(-1).sum() * rounds).backward()
    grads = dict(storage.named_grads(remove_duplicate=False))
    for name, param in plain.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_views_are_cached_per_thread_and_per_grad_mode():
    """Two threads alternating between grad and no-grad access always get views of their own mode."""
    model = _model()
    register_flat_storage(model)
    x = torch.randn(3, 6)
    rounds = 200

    def reader(grad_first: bool) -> Callable[[], None]:
        def body() -> None:
            for i in range(rounds):
                grad = (i % 2 == 0) == grad_first
                with torch.set_grad_enabled(grad):
                    weight = model[3].weight
                    assert (weight.grad_fn is not None) is grad, "a view of the other grad mode"
                    out = model(x)
                    assert out.requires_grad is grad

        return body

    _run_threads(reader(True), reader(False), reader(True))
