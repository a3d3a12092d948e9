"""torchao's quantization, QAT and float8 training on a flattened model, against the plain twin (same seed).

torchao 0.18 on CPU, a 4.7k-parameter MLP. Module swaps that keep the
parameter objects (QAT prepare, float8 training) change the owner of a slot,
not the slot: the flat parameters stay, with the plain model's parameter count
and no dead space. Weights replaced by quantized tensor subclasses leave the
storage with one warning naming them, and the rest is laid out again. Every
flow runs in flat mode (torchao's entry points run on the plain model there)
and inside ``storage.unflattened()``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torchao.float8 import convert_to_float8_training
from torchao.float8.float8_linear import Float8Linear
from torchao.quantization import (
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    quantize_,
)
from torchao.quantization.qat import (
    FakeQuantizedLinear,
    Int8DynActInt4WeightQATQuantizer,
    IntxFakeQuantizeConfig,
    QATConfig,
)

from flatten_parametrize import FlatStorage, get_flat_storage, register_flat_storage, remove_flat_storage

pytestmark = pytest.mark.filterwarnings(
    "ignore:Deprecation. TorchAODType is deprecated",
    "ignore:.*Int8DynActInt4WeightQATQuantizer.*deprecated",
    "ignore:.*is deprecated and will be removed",
)

RELEASED = "cannot live in a flat buffer and left the flat storage: 0.weight"
PLAIN_NUMEL = 64 * 32 + 32 + 32 * 64 + 64 + 64 * 8 + 8  # 4,712
BIASES = 32 + 64 + 8

PTQ: dict[str, Callable[[], Any]] = {
    "int8_weight_only": lambda: Int8WeightOnlyConfig(),
    "int8_dynamic_activation_int8_weight": lambda: Int8DynamicActivationInt8WeightConfig(),
    "intx_int4_weight_only": lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4),
}


def mlp(*, frozen: bool = False) -> nn.Sequential:
    """The issue's model size: 4,712 parameters (every in_features a multiple of 32, torchao's group size)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    return model.requires_grad_(not frozen)


def pair(*, frozen: bool = False) -> tuple[nn.Module, nn.Module, FlatStorage]:
    """The plain MLP and a flattened copy of it, with the copy's storage."""
    plain = mlp(frozen=frozen)
    flat = copy.deepcopy(plain)
    return plain, flat, register_flat_storage(flat)


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return (
        (torch.randn(16, 64, generator=generator), torch.randn(16, 8, generator=generator)) for _ in range(5)
    )


def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


X = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("config", list(PTQ))
def test_quantize_in_flat_mode_gives_the_plain_quantized_model(config: str, frozen: bool):
    """quantize_ on a flattened model: the plain outputs; the weights leave the storage with one warning."""
    plain, flat, storage = pair(frozen=frozen)
    quantize_(plain, PTQ[config]())
    with pytest.warns(UserWarning, match=RELEASED) as record:
        quantize_(flat, PTQ[config]())
    assert len([w for w in record if "left the flat storage" in str(w.message)]) == 1
    assert "2.weight" in str(record[0].message) and "4.weight" in str(record[0].message)
    assert "4,712 -> 104 elements" in str(record[0].message)
    assert storage.is_flattened and get_flat_storage(flat) is storage
    assert torch.equal(flat(X), plain(X))
    assert [info.name for info in storage.param_infos] == ["0.bias", "2.bias", "4.bias"]
    assert storage.flat_params[0].numel() == BIASES  # no dead space
    assert numel(flat) - BIASES + BIASES == numel(plain)
    assert list(flat.state_dict()) == list(plain.state_dict())
    assert all(type(a) is type(b) for a, b in zip(flat.state_dict().values(), plain.state_dict().values()))


@pytest.mark.parametrize("config", list(PTQ))
def test_quantize_inside_unflattened_gives_the_plain_quantized_model_after_the_block(config: str):
    """The path the flat-mode refusal advises works to the end: no AttributeError from inside torchao."""
    plain, flat, storage = pair()
    quantize_(plain, PTQ[config]())
    with pytest.warns(UserWarning, match=RELEASED):
        with storage.unflattened():
            quantize_(flat, PTQ[config]())
            assert torch.equal(flat(X), plain(X))
    assert storage.is_flattened and torch.equal(flat(X), plain(X))
    assert storage.flat_params[0].numel() == BIASES
    storage.unflatten()
    storage.flatten()  # nothing left to release: no warning, same layout
    remove_flat_storage(flat)
    assert torch.equal(flat(X), plain(X)) and list(flat.state_dict()) == list(plain.state_dict())


def test_remove_flat_storage_inside_unflattened_keeps_the_quantized_weights():
    """Removing the storage after quantizing in unflattened mode gives the plain quantized model."""
    plain, flat, storage = pair()
    quantize_(plain, Int8WeightOnlyConfig())
    storage.unflatten()
    quantize_(flat, Int8WeightOnlyConfig())
    remove_flat_storage(flat)
    assert get_flat_storage(flat) is None and torch.equal(flat(X), plain(X))
    assert [type(p) for p in flat.parameters()] == [type(p) for p in plain.parameters()]


def test_a_storage_with_only_quantized_weights_is_removed():
    """When every weight left the storage (no biases), nothing is left to flatten: the storage is removed."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 32, bias=False), nn.ReLU(), nn.Linear(32, 8, bias=False))
    flat = copy.deepcopy(plain)
    register_flat_storage(flat)
    quantize_(plain, Int8WeightOnlyConfig())
    with pytest.warns(UserWarning, match="nothing was left in it, so the flat storage was removed"):
        quantize_(flat, Int8WeightOnlyConfig())
    assert get_flat_storage(flat) is None and torch.equal(flat(X), plain(X))
    assert type(flat[0]) is nn.Linear and "parametrizations" not in flat[0]._modules


def test_a_quantized_weight_assigned_in_flat_mode_is_refused_with_the_path_that_works():
    """layer.weight = Parameter(quantized) in flat mode names the rule and unflattened(); that path works."""
    plain, flat, storage = pair(frozen=True)
    reference = copy.deepcopy(plain)
    quantize_(reference, Int8WeightOnlyConfig())
    quantized = reference[0].weight
    before = flat(X)
    with pytest.raises(
        RuntimeError,
        match=r"cannot set 0.weight to an Int8Tensor \(a tensor subclass\).*"
        r"cannot live in a flat buffer.*storage.unflattened\(\)",
    ):
        flat[0].weight = nn.Parameter(quantized, requires_grad=False)
    assert torch.equal(flat(X), before) and storage.flat_params[0].numel() == PLAIN_NUMEL
    with pytest.warns(
        UserWarning,
        match=r"1 tensor\(s\) cannot live in a flat buffer and left the flat "
        r"storage: 0.weight \(an Int8Tensor",
    ):
        with storage.unflattened():
            flat[0].weight = nn.Parameter(quantized, requires_grad=False)
    plain[0].weight = nn.Parameter(quantized, requires_grad=False)
    assert torch.equal(flat(X), plain(X))
    assert storage.flat_params[0].numel() == PLAIN_NUMEL - 64 * 32


@pytest.mark.parametrize("where", ["flat", "unflattened"])
def test_qat_prepare_train_convert_gives_the_plain_result(where: str):
    """QATConfig prepare changes owners: same flat parameter, plain count, momentum kept; convert works."""
    plain, flat, storage = pair()
    flat_param = storage.flat_params[0]
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    opt_flat = torch.optim.SGD(flat.parameters(), lr=0.05, momentum=0.9)
    train(plain, opt_plain)
    train(flat, opt_flat)  # momentum buffers exist before the swap
    prepare = QATConfig(weight_config=IntxFakeQuantizeConfig(torch.int8, "per_channel"), step="prepare")
    quantize_(plain, prepare)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a change of owner: nothing left, nothing dead
        if where == "flat":
            quantize_(flat, prepare)
        else:
            with storage.unflattened():
                quantize_(flat, prepare)
    assert isinstance(flat[0], FakeQuantizedLinear) and storage.is_flattened
    assert storage.flat_params[0] is flat_param and flat_param.numel() == PLAIN_NUMEL == numel(plain)
    assert numel(flat) == numel(plain)
    assert len(opt_flat.state[flat_param]["momentum_buffer"]) == PLAIN_NUMEL
    assert torch.equal(flat(X), plain(X))
    train(plain, opt_plain)
    train(flat, opt_flat)
    assert torch.equal(flat(X), plain(X))
    assert all(torch.equal(a, b) for a, b in zip(flat.state_dict().values(), plain.state_dict().values()))
    convert = QATConfig(IntxWeightOnlyConfig(weight_dtype=torch.int8), step="convert")
    quantize_(plain, convert)
    with pytest.warns(UserWarning, match=RELEASED):
        quantize_(flat, convert)
    assert torch.equal(flat(X), plain(X)) and storage.flat_params[0].numel() == BIASES


def test_legacy_qat_quantizer_prepare_train_convert_gives_the_plain_result():
    """Int8DynActInt4WeightQATQuantizer in flat mode: same flat parameter, plain training and convert."""
    plain, flat, storage = pair()
    flat_param = storage.flat_params[0]
    quantizer = Int8DynActInt4WeightQATQuantizer(groupsize=32)
    quantizer.prepare(plain)
    quantizer.prepare(flat)
    assert storage.flat_params[0] is flat_param and numel(flat) == numel(plain) == PLAIN_NUMEL
    train(plain, torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9))
    train(flat, torch.optim.SGD(flat.parameters(), lr=0.05, momentum=0.9))
    assert torch.equal(flat(X), plain(X))
    quantizer.convert(plain)
    quantizer.convert(flat)
    assert torch.equal(flat(X), plain(X))


@pytest.mark.parametrize("where", ["flat", "unflattened"])
def test_float8_training_conversion_keeps_the_flat_parameter_and_the_plain_results(where: str):
    """convert_to_float8_training: Float8Linear owners of the same slots; forward and training run on CPU."""
    plain, flat, storage = pair()
    flat_param = storage.flat_params[0]
    convert_to_float8_training(plain)
    if where == "flat":
        convert_to_float8_training(flat)
    else:
        with storage.unflattened():
            convert_to_float8_training(flat)
    assert [type(m).__name__ for m in flat] == [type(m).__name__ for m in plain]
    assert isinstance(flat[0], Float8Linear)
    assert storage.flat_params[0] is flat_param and numel(flat) == numel(plain) == PLAIN_NUMEL
    assert torch.equal(flat(X), plain(X))
    train(plain, torch.optim.SGD(plain.parameters(), lr=0.05))
    train(flat, torch.optim.SGD(flat.parameters(), lr=0.05))
    assert torch.equal(flat(X), plain(X))


def _cast_reference(plain: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The plain quantized model under a bf16 policy: its plain weights cast for each forward, with the input.

    A quantized weight left the storage, so it computes as it is, as on the plain model.
    """

    def forward(x: torch.Tensor) -> torch.Tensor:
        cast = {n: p.to(torch.bfloat16) for n, p in plain.named_parameters() if type(p) is nn.Parameter}
        return torch.func.functional_call(plain, cast, (x.to(torch.bfloat16),))

    return forward


@pytest.mark.parametrize("policy", [None, "bf16"])
@pytest.mark.parametrize("config", list(PTQ))
def test_quantize_in_per_tensor_mode_gives_the_plain_quantized_model(config: str, policy: str | None):
    """quantize_ after ``unflatten()``: the plain quantized forward and training, with or without a policy.

    Under a bf16 policy the forward after quantize_ failed with torch's ``_cast_inputs() missing 1
    required positional argument: 'kwargs'`` (the groups laid out again inside the forward's pre-hook
    replaced the input-cast hook torch was about to call). Now the quantized weights leave the storage
    with one warning, as in flat mode, and the model computes and trains as the plain quantized one.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plain = mlp()
    flat = copy.deepcopy(plain)
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if policy else None
    storage = register_flat_storage(flat, mixed_precision=mixed)
    storage.unflatten()
    quantize_(plain, PTQ[config]())
    quantize_(flat, PTQ[config]())
    reference = _cast_reference(plain) if policy else plain
    outcomes = []
    with pytest.warns(UserWarning, match=r"2\.weight.*4\.weight") as record:
        for forward in (flat, reference):  # under the policy the forward is the first sync point
            try:
                outcomes.append(forward(X))
            except RuntimeError as error:  # torchao's intx weight and a bf16 input: the plain model's error
                outcomes.append(str(error))
        assert [info.name for info in storage.param_infos] == ["0.bias", "2.bias", "4.bias"]
    assert len([w for w in record if "left the flat storage" in str(w.message)]) == 1
    if isinstance(outcomes[1], str):
        assert outcomes[0] == outcomes[1] and config == "intx_int4_weight_only" and policy
        return
    assert torch.equal(outcomes[0], outcomes[1])
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05) for m in (flat, plain)]
    for x, y in batches():
        for forward, opt in zip((flat, reference), opts):
            opt.zero_grad()
            nn.functional.mse_loss(forward(x).float(), y).backward()
            opt.step()
    assert torch.equal(flat(X), reference(X))
    trained = {n: v for n, v in plain.state_dict().items() if n.endswith("bias")}
    assert all(torch.equal(flat.state_dict()[n], v) for n, v in trained.items())
    assert storage.flat_params[0].numel() == BIASES
