"""Test configuration: a fixed seed for every test; the fixtures `one_intra_op_thread` and `world1`.

The tests are grouped by what they guard:

* ``unit/<sub-package>/``: one folder per private sub-package of ``flatten_parametrize``
  (``core``, ``state``, ``install``, ``features``, ``inspect``), a file per module or concern;
* ``guarantees/``: the promises that hold across the library (bad input, faults, atomicity,
  same results as the plain model, threads, leaks, checkpoints, structure);
* ``interop/``: outside libraries and torch subsystems against a plain twin;
* ``distributed/``: multi-process runs (gloo on 127.0.0.1, torchrun for the engines);
* here: the demo, the notebooks, the benchmarks, the documentation build, its code blocks
  and the public docstrings, the supported versions, and the shared helpers (``_helpers.py``,
  ``_hf.py``, ``_lightning.py``, ``_model_parallel.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from hypothesis import settings

# Property tests check results, not speed (benchmarks/ does): no per-example deadline, which a
# loaded 2-core CI machine would miss on the first, import-heavy examples.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


@pytest.fixture(scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """Run a module's tests with one intra-op thread (tiny tensors, or Python threads as the concurrency)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def world1() -> Iterator[None]:
    """Run the test in a default process group of one gloo rank (rank 0 of 1, an in-memory store).

    Enough for argument checks and single-process runs of the distributed
    code (collectives over one rank); the group is destroyed afterwards even
    if the test fails.
    """
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
