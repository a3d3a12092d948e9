"""The real timm (1.0.31) on a flattened model: per-tensor optimizers, its decay rule, its element-wise ones.

timm runs in a subprocess with a folder of its own on ``sys.path`` (``tests/_side_packages.py`` says
why and how); ``tests/_timm_cases.py`` trains a small transformer and its plain twin for 3 steps with
each optimizer, in per-tensor mode and in flat mode, and these tests read what it recorded.
"""

from __future__ import annotations

from typing import Any

import pytest
from _side_packages import run_cases, timm_folder

pytestmark = pytest.mark.slow  # a subprocess


@pytest.fixture(scope="module")
def timm_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every timm case once (in a subprocess) and return what it recorded."""
    out = tmp_path_factory.mktemp("timm") / "results.pt"
    results: dict[str, Any] = run_cases("_timm_cases.py", [timm_folder()], out)
    return results


PER_TENSOR = [
    "Lamb",
    "Lars",
    "Adafactor",
    "AdafactorBigVision",
    "create_optimizer_v2 muon",
    "create_optimizer_v2 adamw weight_decay",
    "param_groups_weight_decay + AdamW",
]


def test_it_is_the_real_timm(timm_results: dict[str, Any]) -> None:
    """The cases ran timm 1.0.31 itself, not a copy of its code."""
    assert timm_results["timm"] == "1.0.31"
    assert timm_results["per_tensor_names"] == PER_TENSOR


@pytest.mark.parametrize("name", PER_TENSOR)
def test_per_tensor_mode_trains_like_the_plain_model(timm_results: dict[str, Any], name: str) -> None:
    """In per-tensor mode timm's per-tensor optimizers and decay rules give the plain weights, bit for bit."""
    case = timm_results[name]
    assert case["per-tensor diff"] == 0.0, case
    assert case["per-tensor warnings"] == [], case


@pytest.mark.parametrize("name", PER_TENSOR)
def test_flat_mode_differs_from_the_plain_model_and_says_so_with_the_fix(
    timm_results: dict[str, Any], name: str
) -> None:
    """In flat mode each of them computes something else than on the plain model: a warning names the fix."""
    case = timm_results[name]
    assert case["flat diff"] > 1e-4, case  # the failure the warning is about
    messages = case["flat warnings"]
    assert messages, case
    if "weight_decay" in name:
        assert any(m.startswith("weight decay: a rule by p.dim()") and "weight_decay_groups" in m
                   for m in messages)  # fmt: skip
    else:
        assert any(m.startswith("flat mode: ") and "storage.unflatten()" in m for m in messages)


@pytest.mark.parametrize(
    "name",
    ["AdaBelief", "AdamWLegacy", "Adan", "Adopt", "LaProp", "Lion", "MADGRAD", "NAdamLegacy", "NAdamW",
     "RAdamLegacy", "RMSpropTF", "SGDW"],
)  # fmt: skip
def test_timms_element_wise_optimizers_match_in_flat_mode_without_a_warning(
    timm_results: dict[str, Any], name: str
) -> None:
    """The allowlisted timm optimizers give the plain weights in flat mode (float rounding), silently."""
    case = timm_results[name]
    assert case["flat warnings"] == [], case
    assert case["flat diff"] <= 1e-6, case
    assert case["per-tensor diff"] == 0.0, case


def test_the_weight_decay_recipe_with_timm_decays_the_plain_models_tensors_silently(
    timm_results: dict[str, Any],
) -> None:
    """weight_decay_groups(no_decay=timm's rule) + create_optimizer_v2 over groups by name: plain weights."""
    recipe = timm_results["recipe"]
    assert recipe["warnings"] == []
    assert recipe["decayed"] == recipe["decayed plain"] > 0
    assert recipe["diff"] == 0.0


def test_the_wrapped_rule_is_timms_with_its_face_and_result_on_a_plain_model(
    timm_results: dict[str, Any],
) -> None:
    """_outside/registry.py wraps param_groups_weight_decay: its name, docstring and signature kept."""
    assert timm_results["wrapped"] is True
    wrapper = timm_results["wrapper"]
    ours, timms = wrapper["face"]
    assert ours == timms and ours[0] == "param_groups_weight_decay"
    ours, timms = wrapper["groups"]
    assert ours == timms and len(ours) == 2  # the same parameter objects in the same groups


@pytest.mark.parametrize("order", ["after ours", "before ours"])
def test_a_users_own_wrapper_of_the_rule_still_runs_beside_ours(
    timm_results: dict[str, Any], order: str
) -> None:
    case = timm_results["wrapper"][order]
    assert case["calls"] == ["user's"]
    assert len(case["warnings"]) == 1 and case["warnings"][0].startswith("weight decay: a rule by p.dim()")


def test_with_the_switch_set_timms_rule_is_not_wrapped(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLATTEN_PARAMETRIZE_NO_PATCHES", "1")
    results = run_cases("_timm_cases.py", [timm_folder()], tmp_path / "off.pt")
    assert results == {"wrapped": False, "timm": "1.0.31"}
