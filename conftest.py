"""Doctest set-up shared by the package's examples (the tests' own configuration is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

#: Doctests of the methods of ``ShardedOptimizer`` continue the class example: they run in a
#: process group of one gloo rank, with ``dist``, ``torch``, ``model``, ``storage``, ``opt``, ``x0``
#: and ``x1`` defined.
SHARDED_METHODS = "flatten_parametrize._distributed.sharded.ShardedOptimizer."


@pytest.fixture(autouse=True)
def _sharded_optimizer_namespace(request: pytest.FixtureRequest) -> Iterator[None]:
    if not request.node.name.startswith(SHARDED_METHODS):
        yield
        return
    import torch
    import torch.distributed as dist
    from torch import nn

    from flatten_parametrize import ShardedOptimizer, register_flat_storage

    namespace = request.getfixturevalue("doctest_namespace")
    # The examples save and load optim*.pt files in the working directory.
    request.getfixturevalue("monkeypatch").chdir(request.getfixturevalue("tmp_path"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        storage = register_flat_storage(model, {"body": [model[0]], "head": [model[2]]})
        opt = ShardedOptimizer(storage, torch.optim.AdamW, [{"params": [storage["body"]]}], lr=1e-3)
        x0, x1 = torch.randn(8, 4), torch.randn(8, 4)
        model(x0).sum().backward()
        torch.save(opt.state_dict(), "optim.pt")
        torch.save(opt.sharded_state_dict(), "optim.0.pt")
        names = {
            "dist": dist,
            "torch": torch,
            "model": model,
            "storage": storage,
            "opt": opt,
            "x0": x0,
            "x1": x1,
        }
        namespace.update(names)
        yield
    finally:
        for name in ("dist", "torch", "model", "storage", "opt", "x0", "x1"):
            namespace.pop(name, None)
        dist.destroy_process_group()
