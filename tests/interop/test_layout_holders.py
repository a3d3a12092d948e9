"""Features that hold the layout: a refused layout change changes nothing, a released one holds nothing.

Every operation that lays the groups out again (torchao's ``quantize_``, QAT prepare and float8
swaps, torch's hook-based ``weight_norm``, ``spectral_norm`` and pruning, a module swap flattened
again, transformers' ``resize_token_embeddings``) asks the features
of the storage before anything changes (``_core/features.py``: ``refuse_held_layout``). Per holder
(disk offload, a ``ShardedOptimizer``, live ensemble stacks): the refused operation leaves the
model as it was; released as the message says, the same operation gives the plain twin's result.
Mixed precision and gradient sync hold nothing: they follow the new layout (the hand-written bf16
reference; sync still enabled, reducing the new groups). Each way out that the message names is
followed to the end, with gradients left from before the change.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.func import functional_call
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import prune
from torchao.float8 import convert_to_float8_training
from torchao.quantization import Int8WeightOnlyConfig, quantize_
from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

from flatten_parametrize import (
    FlatStorage,
    ShardedOptimizer,
    get_flat_storage,
    register_flat_storage,
    remove_flat_storage,
)

from _helpers import (
    assert_same_values,
    assert_unchanged,
    launch_gloo,
    launch_results,
    save_result,
    snapshot,
    train_steps,
    twin,
    values,
)
from _hf import gpt2, lm_loss

pytestmark = pytest.mark.filterwarnings(
    "ignore:Deprecation. TorchAODType is deprecated",
    "ignore:.*is deprecated and will be removed",
    "ignore:.*cannot live in a flat buffer and left the flat storage",
)

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
X = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))

#: The operations that lay the groups out again, on the MLP: the name in the refusal, the call.
SWAPS: dict[str, tuple[str, Callable[[nn.Module], Any]]] = {
    "quantize_": ("torchao's quantize_", lambda m: quantize_(m, Int8WeightOnlyConfig())),
    "qat_prepare": (
        "torchao's quantize_",
        lambda m: quantize_(
            m, QATConfig(weight_config=IntxFakeQuantizeConfig(torch.int8, "per_channel"), step="prepare")
        ),
    ),
    "float8": ("torchao's convert_to_float8_training", convert_to_float8_training),
}
HOLDERS = ["offload", "sharded_optimizer", "stacks"]
#: torch's hook-based reparametrizations (``_outside/torch_renames.py``): the name in the refusal, the call.
RENAMES: dict[str, tuple[str, Callable[[nn.Module], Any]]] = {
    "weight_norm": ("torch.nn.utils.weight_norm", lambda m: torch.nn.utils.weight_norm(m[0])),
    "spectral_norm": ("torch.nn.utils.spectral_norm", lambda m: torch.nn.utils.spectral_norm(m[0])),
    "prune": ("torch.nn.utils.prune", lambda m: prune.l1_unstructured(m[0], "weight", 0.5)),
}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def _ids(vocab: int = 64) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 8), generator=torch.Generator().manual_seed(0))


def hold(kind: str, storage: FlatStorage, tmp_path: Path) -> tuple[str, Callable[[], None]]:
    """Make feature ``kind`` hold the layout; return its name in the refusal and the release it names."""
    if kind == "offload":
        storage.offload_to_disk(tmp_path)
        return "DiskOffload", storage.load_to_memory
    held: list[Any] = (
        [ShardedOptimizer(storage, torch.optim.AdamW, lr=1e-2)]
        if kind == "sharded_optimizer"
        else storage.stack(2)
    )

    def release() -> None:  # `del optimizer` / `del stacks`
        held.clear()
        gc.collect()

    return ("OptimizerShards" if kind == "sharded_optimizer" else "Functional"), release


def refusal(what: str, holder: str) -> str:
    held = rf"while {holder} hold\(s\) its layout: .*nothing was changed"
    return rf"cannot run {what} on a flattened module {held}"


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("swap", list(SWAPS))
def test_a_held_layout_refuses_a_torchao_swap_before_it_changes_the_model(swap: str, holder: str, tmp_path):
    """Refused with the holder named, the model and its classes as before; released, the plain result."""
    plain = mlp()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    what, call = SWAPS[swap]
    name, release = hold(holder, storage, tmp_path)
    before, classes = flat(X), [type(m) for m in flat]
    snap = snapshot(flat)
    with pytest.raises(RuntimeError, match=refusal(what, name)):
        call(flat)
    assert_unchanged(flat, snap)
    assert storage.is_flattened and [type(m) for m in flat] == classes
    assert torch.equal(flat(X), before)
    release()
    call(flat)
    call(plain)
    assert [type(m).__name__ for m in flat] == [type(m).__name__ for m in plain]
    assert torch.equal(flat(X), plain(X))


@pytest.mark.usefixtures("world1")
@pytest.mark.filterwarnings("ignore:.*deprecated in favor of")
@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("tool", list(RENAMES))
def test_a_held_layout_refuses_a_torch_reparametrization_before_it_changes_the_model(
    tool: str, holder: str, tmp_path
):
    """Refused with the holder named, no hook of the tool left; released, the plain twin's result."""
    plain = mlp()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    what, call = RENAMES[tool]
    name, release = hold(holder, storage, tmp_path)
    before = flat(X)
    snap = snapshot(flat)
    with pytest.raises(RuntimeError, match=refusal(what, name)):
        call(flat)
    assert_unchanged(flat, snap)
    assert storage.is_flattened and not flat[0]._forward_pre_hooks
    assert torch.equal(flat(X), before)
    release()
    for m in (flat, plain):
        torch.manual_seed(1)  # spectral_norm draws its vectors
        call(m)
    assert torch.equal(flat(X), plain(X))


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("holder", HOLDERS)
def test_a_held_layout_refuses_resize_token_embeddings_and_the_released_one_resizes(holder: str, tmp_path):
    """transformers' resize: refused, the model and config unchanged; after the release, the plain result."""
    plain = gpt2()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    name, release = hold(holder, storage, tmp_path)
    snap = snapshot(flat)
    with pytest.raises(RuntimeError, match=refusal("resize_token_embeddings", name)):
        flat.resize_token_embeddings(120)
    assert_unchanged(flat, snap)
    assert flat.transformer.wte.num_embeddings == flat.config.vocab_size == 64
    release()
    torch.manual_seed(1)
    plain.resize_token_embeddings(120)
    torch.manual_seed(1)
    flat.resize_token_embeddings(120)
    assert torch.equal(flat(_ids(120)).logits, plain(_ids(120)).logits)
    assert flat.num_parameters() == plain.num_parameters()


class _Scaled(nn.Module):
    """A wrapper that re-hosts the weight and bias of the linear it replaces (a module swap)."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = inner.weight, inner.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * nn.functional.linear(x, self.weight, self.bias)


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("holder", HOLDERS)
def test_a_held_layout_refuses_flatten_after_a_module_swap_and_the_released_one_flattens(
    holder: str, tmp_path: Path
):
    """A swap of unflattened mode: flatten() refuses and stays unflattened; after the release it flattens."""
    plain = mlp()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    name, release = hold(holder, storage, tmp_path)
    storage.unflatten()
    flat[2] = _Scaled(flat[2])
    with pytest.raises(RuntimeError, match=refusal(r"flatten\(\)", name)):
        storage.flatten()
    assert not storage.is_flattened and isinstance(flat[2], _Scaled)
    release()
    storage.flatten()
    plain[2] = _Scaled(plain[2])
    assert storage.is_flattened and torch.equal(flat(X), plain(X))


@pytest.mark.parametrize("swap", list(SWAPS))
def test_a_torchao_swap_under_a_bf16_policy_keeps_the_policy_and_gives_the_hand_written_reference(swap: str):
    """Mixed precision follows the new layout: what stays in the storage computes in bf16, as by hand."""
    plain = mlp()
    flat = twin(plain)
    storage = register_flat_storage(flat, mixed_precision=BF16)
    flat(X)  # a compute copy cast before the swap
    SWAPS[swap][1](flat)
    SWAPS[swap][1](plain)
    storage = get_flat_storage(flat)
    assert storage is not None and storage.is_flattened and storage.mixed_precision == {"0": BF16}
    kept = {info.name for info in storage.param_infos}
    # The hand-written reference: float32 masters, each weight still in the storage cast to bf16.
    weights = {n: p.detach().to(torch.bfloat16) for n, p in plain.named_parameters() if n in kept}
    expected = functional_call(plain, weights, (X.to(torch.bfloat16),))
    got = flat(X)
    assert got.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_resize_token_embeddings_under_a_bf16_policy_keeps_the_policy_and_gives_the_hand_written_reference():
    """The resized model computes with bf16 copies of the new masters; the masters are the plain model's."""
    plain = gpt2()
    flat = twin(plain)
    storage = register_flat_storage(flat, mixed_precision=BF16)
    flat(_ids())
    torch.manual_seed(1)
    plain.resize_token_embeddings(120)
    torch.manual_seed(1)
    flat.resize_token_embeddings(120)
    assert storage.mixed_precision == {"0": BF16}
    assert_same_values(flat, plain)
    weights = {n: p.detach().to(torch.bfloat16) for n, p in plain.named_parameters()}
    expected = functional_call(plain, weights, (_ids(120),)).logits
    assert torch.equal(flat(_ids(120)).logits, expected)


def _backward(model: nn.Module) -> None:
    lm_loss(model, _ids()).backward()


def _train_alike(plain: nn.Module, flat: nn.Module) -> None:
    batches = [_ids(120)] * 3
    ref = train_steps(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), batches, lm_loss)
    got = train_steps(flat, torch.optim.AdamW(flat.parameters(), lr=1e-2), batches, lm_loss)
    assert got == pytest.approx(ref, rel=1e-6)
    assert_same_values(flat, plain, rtol=1e-5, atol=1e-6)


def test_resize_after_load_to_memory_runs_with_a_stale_gradient_and_trains_as_the_plain_model(tmp_path):
    """The message's first route: load_to_memory(), resize (a gradient from before left), offload again."""
    plain = gpt2()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    storage.offload_to_disk(tmp_path)
    _backward(plain)
    _backward(flat)
    with pytest.raises(RuntimeError, match=refusal("resize_token_embeddings", "DiskOffload")):
        flat.resize_token_embeddings(120)
    storage.load_to_memory()
    torch.manual_seed(1)
    plain.resize_token_embeddings(120)
    torch.manual_seed(1)
    flat.resize_token_embeddings(120)
    storage.offload_to_disk(tmp_path)
    assert storage.is_offloaded
    assert torch.equal(flat(_ids(120)).logits, plain(_ids(120)).logits)
    _train_alike(plain, flat)


class _Reductions:
    """Counts the all-reduces that gradient sync launches."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = torch.distributed.all_reduce

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(torch.distributed, "all_reduce", counting)


@pytest.mark.usefixtures("world1")
def test_grad_sync_follows_resize_token_embeddings_with_a_stale_gradient(monkeypatch):
    """Enabled sync holds nothing: after the resize it is still enabled and reduces the new group."""
    plain = gpt2()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    storage.enable_grad_sync()
    _backward(plain)
    _backward(flat)
    torch.manual_seed(1)
    plain.resize_token_embeddings(120)
    torch.manual_seed(1)
    flat.resize_token_embeddings(120)
    with pytest.raises(RuntimeError, match="grad sync is already enabled"):
        storage.enable_grad_sync()
    reductions = _Reductions(monkeypatch)
    assert torch.equal(flat(_ids(120)).logits, plain(_ids(120)).logits)
    _train_alike(plain, flat)
    assert reductions.count == 3  # one group, one reduction per backward
    storage.disable_grad_sync()  # the message's route still works as well


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("swap", list(SWAPS))
def test_grad_sync_follows_a_torchao_swap(swap: str, monkeypatch):
    """quantize_, QAT prepare, float8 under enabled sync: the plain result, and the next backward reduced."""
    plain = mlp()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    storage.enable_grad_sync()
    SWAPS[swap][1](flat)
    SWAPS[swap][1](plain)
    assert torch.equal(flat(X), plain(X))
    reductions = _Reductions(monkeypatch)
    flat(X).sum().backward()
    assert reductions.count == 1


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("sync", [False, True], ids=["plain", "grad_sync"])
def test_the_plain_model_route_with_a_stale_gradient_drops_it_with_a_warning_and_trains_as_the_plain_model(
    sync: bool,
):
    """remove_flat_storage, resize, register again: the old-shaped gradient dropped, named; the rest kept."""
    plain = gpt2()
    flat = twin(plain)
    storage = register_flat_storage(flat)
    if sync:
        storage.enable_grad_sync()
    _backward(plain)
    _backward(flat)
    remove_flat_storage(flat)
    torch.manual_seed(1)
    plain.resize_token_embeddings(120)
    torch.manual_seed(1)
    flat.resize_token_embeddings(120)
    assert plain.transformer.wte.weight.grad.shape == (64, 16)  # the plain model keeps it until zero_grad
    with pytest.warns(
        UserWarning,
        match=r"1 gradient\(s\) of another shape, left from before a shape change, were dropped: "
        r"transformer\.wte\.weight \(gradient \(64, 16\), parameter \(120, 16\)\)",
    ):
        storage = register_flat_storage(flat)
    if sync:
        storage.enable_grad_sync()
    grads = dict(storage.named_grads())
    assert grads["transformer.wte.weight"] is None or not grads["transformer.wte.weight"].any()
    for name, param in plain.named_parameters():
        if name != "transformer.wte.weight":
            assert torch.equal(grads[name], param.grad), name
    _train_alike(plain, flat)


def test_registration_drops_a_gradient_left_by_a_data_swap_of_another_shape_with_a_warning():
    """A `.data` swap (as resize_token_embeddings does) before registration: values land, the gradient not."""
    model = gpt2()
    _backward(model)
    model.transformer.wte.weight.data = torch.zeros(70, 16)
    values = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    stale = r"transformer\.wte\.weight \(gradient \(64, 16\), parameter \(70, 16\)\)"
    with pytest.warns(UserWarning, match=stale):
        register_flat_storage(model)
    assert_same_values(model, values)


def _resize_under_sync(rank: int, world: int, outdir: Path) -> None:
    """One rank: GPT-2 resized under enabled grad sync, its half trained; the plain twin under DDP alike."""
    plain = gpt2()
    flat = twin(plain)
    register_flat_storage(flat).enable_grad_sync()
    torch.manual_seed(1)
    plain.resize_token_embeddings(120)
    torch.manual_seed(1)
    flat.resize_token_embeddings(120)
    ddp = DistributedDataParallel(plain)
    seeds = [10 * rank + step for step in range(3)]
    batches = [torch.randint(3, 120, (2, 8), generator=torch.Generator().manual_seed(s)) for s in seeds]
    train_steps(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), batches, lm_loss)
    train_steps(flat, torch.optim.AdamW(flat.parameters(), lr=1e-2), batches, lm_loss)
    save_result(outdir, rank, "resize", {"flat": values(flat), "plain": values(plain)})


@pytest.mark.slow
def test_resize_token_embeddings_under_grad_sync_trains_on_two_ranks_as_the_plain_model_under_ddp(
    tmp_path: Path,
):
    """Sync follows the resized layout: the ranks stay equal and end where DDP's plain model ends."""
    launch = launch_gloo(_resize_under_sync, tmp_path)
    first, second = launch_results(launch, "resize")
    assert_same_values(first["flat"], second["flat"])
    for result in (first, second):
        assert_same_values(result["flat"], result["plain"], close=True)
