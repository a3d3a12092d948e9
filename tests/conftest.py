"""Test configuration: a fixed seed for every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


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
