"""Injected classes get exactly the methods ``_install/injected.py`` lists; assembling again changes nothing.

``injected.METHODS`` names every method of the classes the library injects, with the module that
owns it; ``injected.assemble()`` (run by ``_install/__init__.py``) hands the table to
``module_classes.make_class``, the flatten steps to the coordinator, and registers the dead-space
hook. The import-order independence is checked in ``tests/guarantees/test_structure.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage
from flatten_parametrize._install import injected


class WithModelOperation(nn.Module):
    """A model with a framework's model operation (as transformers' ``resize_token_embeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)

    def resize_token_embeddings(self, size: int) -> None:
        self.proj = nn.Linear(2, size)


def test_every_injected_class_has_exactly_the_listed_methods():
    """Each changed module's class holds every listed method, and a where-defined one only where it is."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    register_flat_storage(model)
    for module in (model, model[0], model[1]):
        namespace = vars(type(module))
        for name, method in injected.METHODS.always.items():
            assert namespace[name] is method, (type(module).__name__, name)
        assert "resize_token_embeddings" not in namespace
        assert not hasattr(module, "resize_token_embeddings")


def test_a_model_operation_is_wrapped_only_where_the_class_has_it():
    """The listed ``resize_token_embeddings`` wraps the model's own, which runs on the plain model."""
    model = WithModelOperation()
    storage = register_flat_storage(model)
    listed = injected.METHODS.where_defined["resize_token_embeddings"]
    assert vars(type(model))["resize_token_embeddings"] is listed
    assert "resize_token_embeddings" not in vars(type(model.proj))
    model.resize_token_embeddings(3)
    assert get_flat_storage(model) is storage and storage.is_flattened
    assert model.proj(torch.ones(1, 2)).shape == (1, 3)


def test_assembling_again_changes_nothing():
    """A second ``assemble()`` keeps the same methods and says a replaced submodule's dead space once."""
    injected.assemble()
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    register_flat_storage(model)
    assert vars(type(model[0]))["__reduce_ex__"] is injected.METHODS.always["__reduce_ex__"]
    with pytest.warns(UserWarning, match="leaves 2 slot") as record:
        model[1] = nn.Linear(2, 2)
    assert len(record) == 1
