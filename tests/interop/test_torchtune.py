"""The real torchtune (0.6.1) on a flattened model: LoRA's adapter walk and the optimizer in backward.

torchtune runs in a subprocess with a folder of its own on ``sys.path`` (``tests/_side_packages.py``
says why and how); ``tests/_torchtune_cases.py`` trains a model of torchtune's ``LoRALinear`` layers
and its plain twin from the same seed, in per-tensor mode and in flat mode, and these tests read what
it recorded. Per-tensor mode gives the plain model's names, state and weights; flat mode has one
parameter per group, so torchtune's per-parameter walks see that (documented in docs/per-tensor.md).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _side_packages import run_cases, timm_folder, torchtune_folder

pytestmark = pytest.mark.slow  # a subprocess


@pytest.fixture(scope="module")
def tune(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every torchtune case once (in a subprocess) and return what it recorded."""
    out = tmp_path_factory.mktemp("torchtune") / "results.pt"
    results: dict[str, Any] = run_cases("_torchtune_cases.py", [torchtune_folder(), timm_folder()], out)
    return results


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_it_is_the_real_torchtune(tune: dict[str, Any]) -> None:
    """The cases ran torchtune 0.6.1 itself, not a copy of its code."""
    assert tune["torchtune"].startswith("0.6.1")


def test_get_adapter_params_finds_the_adapters_in_per_tensor_mode_and_lora_trains_like_the_plain_model(
    tune: dict[str, Any],
) -> None:
    """Registered after the adapters were added, per-tensor mode gives torchtune's walk the plain names."""
    plain, ours = tune["lora plain"], tune["lora per-tensor"]
    assert ours["adapter names"] == plain["adapter names"] == [
        "0.lora_a.weight", "0.lora_b.weight", "2.lora_a.weight", "2.lora_b.weight",
    ]  # fmt: skip
    assert ours["trainable"] == plain["trainable"]
    assert _equal(ours["weights"], plain["weights"])


def test_get_adapter_params_in_flat_mode_fails_loudly_not_silently(tune: dict[str, Any]) -> None:
    """In flat mode the submodules own no parameters: torchtune's own assertion says so (not an empty set)."""
    flat = tune["lora flat"]
    assert flat["adapter names"] is None
    assert "not converted" in flat["error"]


def test_optimizer_in_backward_in_per_tensor_mode_keys_steps_and_resumes_like_the_plain_model(
    tune: dict[str, Any],
) -> None:
    """One optimizer per leaf, stepped by its grad hook: plain keys, plain state shapes, plain weights."""
    plain, ours = tune["in backward plain"], tune["in backward per-tensor"]
    assert ours["keys"] == plain["keys"]
    assert ours["state shapes"] == plain["state shapes"]
    assert ours["resumed state equal"] and plain["resumed state equal"]
    assert _equal(ours["weights"], plain["weights"])


def test_optimizer_in_backward_in_flat_mode_steps_like_the_plain_model_under_the_flat_key(
    tune: dict[str, Any],
) -> None:
    """Flat mode: one AdamW over the flat parameter, the same weights (element-wise), one flat key."""
    plain, flat = tune["in backward plain"], tune["in backward flat"]
    assert _equal(flat["weights"], plain["weights"])
    assert flat["keys"] == ["flat_param_0"]
    assert flat["state shapes"] == {
        "flat_param_0": (sum(torch.Size(s).numel() for s in plain["state shapes"].values()),)
    }
    assert flat["resumed state equal"]
