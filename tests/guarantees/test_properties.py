"""Property-based tests: a flattened model behaves like its plain twin under any sequence of operations.

Hypothesis draws random module trees (nested ``Sequential`` / ``ModuleList`` /
``ModuleDict`` of ``Linear``, ``Conv1d``, ``Embedding`` and ``LayerNorm``, float32 and
float64 leaves, random ties between same-shaped parameters, frozen parameters, an
optional parameter on the root), random valid groupings (automatic, one group, a list of
groups, named groups, parameters left out, alignment) and registers them on the root or
on a subtree. The state machine then runs random operations (training steps with SGD
and momentum, bare backward passes, ``unflatten()`` / ``flatten()``, in-place edits,
reassigned parameters and ``.data`` swaps in unflattened mode, ``using()``, state dict
loads in both forms and with other dtypes, ``copy.deepcopy``, dtype moves,
``remove_flat_storage`` and registering again) on the flattened model and the same on a
plain twin built with ``copy.deepcopy`` before registration; after every step, state
dict keys and values, gradients, outputs and ties agree.
"""

from __future__ import annotations

import copy
import pickle
from collections import OrderedDict
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

from flatten_parametrize import get_flat_storage, register_flat_storage, remove_flat_storage

from _helpers import assert_same_values, assert_unchanged, core_of, snapshot, train_steps, values

D = 8  # feature size of every leaf
B = 4  # batch size
TOKENS = torch.arange(B)
RTOL, ATOL = 1e-5, 1e-5  # float32 sums run in another order in a flat buffer


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# --------------------------------------------------------------------------- random models

DTYPES = {"float32": torch.float32, "float64": torch.float64}

leaf_specs = st.tuples(
    st.just("leaf"),
    st.sampled_from(["linear", "conv", "embedding", "layernorm"]),
    st.sampled_from(sorted(DTYPES)),
    st.sampled_from(["none", "none", "all", "weight"]),  # what is frozen
    st.sampled_from([1, 2, 4]),  # conv channels; bias on or off for linear / layernorm
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.tuples(st.sampled_from(["seq", "list", "dict"]), st.lists(children, min_size=1, max_size=3))


#: A root container holding up to 3 subtrees of up to 3 leaves each.
tree_specs = _containers(st.recursive(leaf_specs, _containers, max_leaves=3))


def _leaf(kind: str, dtype: str, frozen: str, option: int) -> nn.Module:
    factory = {"dtype": DTYPES[dtype]}
    if kind == "linear":
        module: nn.Module = nn.Linear(D, D, bias=option != 1, **factory)
    elif kind == "conv":
        module = nn.Conv1d(option, option, 3, padding=1, **factory)
    elif kind == "embedding":
        module = nn.Embedding(D, D, **factory)
    else:
        module = nn.LayerNorm(D, bias=option != 1, **factory)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn(param.shape, dtype=param.dtype) * 0.1)
    if frozen == "all":
        module.requires_grad_(False)
    elif frozen == "weight":
        module.weight.requires_grad_(False)
    return module


def build(spec: Any) -> nn.Module:
    if spec[0] == "leaf":
        return _leaf(*spec[1:])
    children = [build(child) for child in spec[1]]
    if spec[0] == "seq":
        return nn.Sequential(*children)
    if spec[0] == "list":
        return nn.ModuleList(children)
    return nn.ModuleDict({f"m{i}": child for i, child in enumerate(children)})


def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Apply every leaf of the tree in order; each leaf computes in its own dtype."""
    if isinstance(module, (nn.Sequential, nn.ModuleList)):
        for child in module:
            x = run(child, x)
        return x
    if isinstance(module, nn.ModuleDict):
        for child in module.values():
            x = run(child, x)
        return x
    x = x.to(module.weight.dtype)
    if isinstance(module, nn.Linear):
        return torch.tanh(module(x))
    if isinstance(module, nn.Conv1d):
        channels = module.in_channels
        return torch.tanh(module(x.reshape(B, channels, D // channels)).reshape(B, D))
    if isinstance(module, nn.Embedding):
        return x + module(TOKENS)
    return module(x)


class Net(nn.Module):
    """A random tree under ``body``, optionally a parameter of the root itself."""

    def __init__(self, body: nn.Module, scale: bool) -> None:
        super().__init__()
        self.has_scale = scale
        self.body = body
        if scale:
            self.scale = nn.Parameter(1 + 0.1 * torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_scale:
            x = x * self.scale
        return run(self.body, x).to(torch.float64)


def _tie(net: Net, pairs: list[tuple[int, int]]) -> None:
    """Make parameter j an alias of parameter i (same shape, dtype and owner dtype) for each pair."""
    for i, j in pairs:
        found = [
            (module, name, param)
            for module in net.body.modules()
            for name, param in module.named_parameters(recurse=False)
        ]
        if len(found) < 2:
            return
        (_, _, source), (owner, name, target) = found[i % len(found)], found[j % len(found)]
        if source is not target and source.shape == target.shape and source.dtype == target.dtype:
            setattr(owner, name, source)


@st.composite
def nets(draw: st.DrawFn) -> Net:
    spec = draw(tree_specs)
    torch.manual_seed(draw(st.integers(0, 2**16)))
    net = Net(build(spec), scale=draw(st.booleans()))
    _tie(net, draw(st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), max_size=3)))
    return net


def tied_names(model: nn.Module) -> list[list[str]]:
    """Names of each parameter of ``model`` (tied ones have several), in order."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return list(names.values())


@st.composite
def groupings(draw: st.DrawFn, target: nn.Module) -> tuple[Any, int]:
    """A valid ``groups`` argument for ``target`` in one of the accepted forms, and an align."""
    align = draw(st.sampled_from([1, 1, 4]))
    params = dict(target.named_parameters(remove_duplicate=False))
    slots = tied_names(target)
    if not slots or draw(st.booleans()):
        return None, align
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for names in slots:
        label = draw(st.sampled_from([None, 0, 0, 1]))  # None: left out of every group
        if label is None:
            continue
        param = params[names[0]]
        item = draw(st.sampled_from(["param", "name", "alias"]))
        value = param if item == "param" else names[0] if item == "name" else draw(st.sampled_from(names))
        groups.setdefault((label, param.dtype, param.requires_grad), []).append(value)
    items = list(groups.values())
    if not items:
        return None, align
    form = draw(st.sampled_from(["mapping", "nested", "single"]))
    if form == "single" and len(items) == 1:
        return items[0], align
    if form == "nested":
        return items, align
    names = draw(st.permutations(["a", "b", "decay", "x1", "g_2", "head", "w", "z"]))
    return dict(zip(names, items)), align


def inputs(seed: int) -> torch.Tensor:
    """A batch that requires grad (so that a model with every parameter frozen still runs backward)."""
    return torch.randn(B, D, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _get(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner), attr)  # type: ignore[no-any-return]


def _close(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    """Compare with a tolerance; a missing gradient equals a zero one."""
    if a is None and b is None:
        return
    a = torch.zeros_like(b) if a is None else a  # type: ignore[arg-type]
    b = torch.zeros_like(a) if b is None else b
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    torch.testing.assert_close(a.detach(), b.detach(), rtol=RTOL, atol=ATOL, msg=what)


# --------------------------------------------------------------------------- the state machine

SEEDS = st.integers(0, 2**16)


class FlattenedModelMatchesItsPlainTwin(RuleBasedStateMachine):
    """Every operation on the flattened model, mirrored on its plain twin, gives the same values and grads."""

    # ----------------------------------------------------------------- set-up
    @initialize(net=nets(), on_body=st.booleans(), data=st.data())
    def build(self, net: Net, on_body: bool, data: st.DataObject) -> None:
        self.plain = net
        self.model = copy.deepcopy(net)
        self.on_body = on_body
        self.prefix = "body." if on_body else ""
        self.has_ties = any(len(names) > 1 for names in tied_names(net))
        groups, align = data.draw(groupings(self.target))
        self.storage: Any = register_flat_storage(self.target, groups, align=align)
        self._new_optimizers()

    @property
    def target(self) -> nn.Module:
        return self.model.body if self.on_body else self.model

    @property
    def plain_target(self) -> nn.Module:
        return self.plain.body if self.on_body else self.plain

    def _new_optimizers(self) -> None:
        """Optimizers over what ``parameters()`` yields now (flat or original parameters)."""
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-3)
        self.plain_opt = torch.optim.SGD(self.plain.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-3)

    def _registered(self) -> bool:
        return self.storage is not None

    def _flat(self) -> bool:
        return self.storage is not None and self.storage.is_flattened

    def _unflat(self) -> bool:
        return self.storage is None or not self.storage.is_flattened

    def _pick(self, index: int) -> list[str]:
        slots = tied_names(self.plain)
        return slots[index % len(slots)]

    # ----------------------------------------------------------------- training
    @rule(seed=SEEDS)
    def train_step(self, seed: int) -> None:
        x = inputs(seed)
        train_steps(self.model, self.opt, [x])
        train_steps(self.plain, self.plain_opt, [x])

    @rule(seed=SEEDS)
    def backward_only(self, seed: int) -> None:
        x = inputs(seed)
        for model in (self.model, self.plain):
            model(x).pow(2).mean().backward()

    @rule()
    def zero_grad(self) -> None:
        self.opt.zero_grad()
        self.plain_opt.zero_grad()

    @rule(seed=SEEDS, inference=st.booleans())
    def forward_without_grad(self, seed: int, inference: bool) -> None:
        x = inputs(seed)
        with torch.inference_mode() if inference else torch.no_grad():
            _close(self.model(x), self.plain(x), "output without grad")

    # ----------------------------------------------------------------- modes and edits
    @precondition(_flat)
    @rule()
    def unflatten(self) -> None:
        self.storage.unflatten()
        self._new_optimizers()

    @precondition(lambda self: self._registered() and not self.storage.is_flattened)
    @rule()
    def flatten(self) -> None:
        self.storage.flatten()
        self._new_optimizers()

    @rule(index=st.integers(0, 99), factor=st.sampled_from([0.5, -1.0, 1.5]))
    def edit_in_place(self, index: int, factor: float) -> None:
        name = self._pick(index)[0]
        with torch.no_grad():
            _get(self.model, name).mul_(factor)
            _get(self.plain, name).mul_(factor)

    @precondition(_unflat)
    @rule(index=st.integers(0, 99), how=st.sampled_from(["reassign", "data"]))
    def replace_parameter(self, index: int, how: str) -> None:
        names = self._pick(index)
        new = _get(self.plain, names[0]).detach() * 0.5 + 0.125
        for model in (self.model, self.plain):
            old = _get(model, names[0])
            if how == "data":
                old.data = new.clone()
                continue
            param = nn.Parameter(new.clone(), requires_grad=old.requires_grad)
            for name in names:
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, param)
        self._new_optimizers()

    @precondition(_flat)
    @rule(index=st.integers(0, 99))
    def write_through_data(self, index: int) -> None:
        """`weight.data = t` on a view (peft's safe merge) lands in the flat buffer like on a parameter."""
        names = self._pick(index)
        new = _get(self.plain, names[0]).detach() * -0.5 + 0.25
        for model in (self.model, self.plain):
            _get(model, names[-1]).data = new.clone()

    def _replaceable(self) -> list[str]:
        """Submodules of the registered module that hold parameters of their own (never the root)."""
        return [
            name
            for name, module in self.plain_target.named_modules()
            if name and any(True for _ in module.parameters(recurse=False))
        ]

    @rule(index=st.integers(0, 99))
    def replace_submodule(self, index: int) -> None:
        """A submodule replaced by a new one (a new head): ordinary parameters, the old slots dead."""
        names = self._replaceable()
        if not names:
            return
        name = names[index % len(names)]
        parent, _, attr = (self.prefix + name).rpartition(".")
        new = copy.deepcopy(self.plain.get_submodule(self.prefix + name))
        with torch.no_grad():
            for param in new.parameters():
                param.mul_(0.5)
        for model in (self.model, self.plain):
            setattr(model.get_submodule(parent), attr, copy.deepcopy(new))
        self._new_optimizers()

    def _picklable(self) -> bool:
        if self.storage is None:
            return True
        live = core_of(self.storage).live_names()
        return all(name in live for info in self.storage.param_infos for name in (info.name, *info.aliases))

    @precondition(_picklable)
    @rule(seed=SEEDS)
    def pickle_round_trip(self, seed: int) -> None:
        """pickle.loads(pickle.dumps(model)) gives the same flattened model (mode, layout, ties)."""
        infos = None if self.storage is None else (self.storage.param_infos, self.storage.is_flattened)
        self.model, self.plain = (
            pickle.loads(pickle.dumps(self.model)),
            pickle.loads(pickle.dumps(self.plain)),
        )
        if infos is not None:
            self.storage = get_flat_storage(self.target)
            assert (self.storage.param_infos, self.storage.is_flattened) == infos
        self._new_optimizers()
        self.train_step(seed)

    @precondition(_flat)
    @rule(seed=SEEDS)
    def using(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        tensors = [
            (f.detach() + 0.05 * torch.randn(f.shape, generator=gen).to(f.dtype)).requires_grad_(
                f.requires_grad
            )
            for f in self.storage.flat_params
        ]
        x = inputs(seed)
        with self.storage.using(tensors):
            out = self.model(x)
            out.pow(2).mean().backward()
        substitutes = {
            self.prefix + name: view.detach().clone().requires_grad_(view.requires_grad)
            for name, view in self.storage.views_of(tensors).items()
        }
        plain_out = torch.func.functional_call(self.plain, substitutes, (x,))
        plain_out.pow(2).mean().backward()
        _close(out, plain_out, "output inside using()")
        grads = self.storage.views_of([torch.zeros_like(t) if t.grad is None else t.grad for t in tensors])
        for name, grad in grads.items():
            _close(grad, substitutes[self.prefix + name].grad, f"using() gradient of {name}")

    # ----------------------------------------------------------------- state dicts
    def _new_values(self, seed: int, dtype: torch.dtype | None) -> OrderedDict[str, torch.Tensor]:
        """The twin's state dict plus noise (one noise per tensor, so tied names agree)."""
        gen = torch.Generator().manual_seed(seed)
        noise: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        state: OrderedDict[str, torch.Tensor] = OrderedDict()
        for key, value in self.plain_target.state_dict().items():
            ident = (value.data_ptr(), value.dtype)
            if ident not in noise:
                noise[ident] = 0.1 * torch.randn(value.shape, generator=gen).to(value.dtype)
            new = value + noise[ident]
            state[key] = new if dtype is None else new.to(dtype)
        return state

    @rule(
        seed=SEEDS,
        form=st.sampled_from(["plain", "flat"]),
        dtype=st.sampled_from([None, torch.float32, torch.float64]),
        drop=st.booleans(),
    )
    def load_state_dict(self, seed: int, form: str, dtype: torch.dtype | None, drop: bool) -> None:
        values = self._new_values(seed, dtype)
        if drop and form == "plain":
            del values[list(values)[seed % len(values)]]
        self.plain_target.load_state_dict(values, strict=not drop)
        if form == "plain" or not self._registered():
            self.target.load_state_dict(values, strict=not drop)
            return
        flat = OrderedDict((k, v.clone()) for k, v in self.storage.flat_state_dict().items())
        views = self.storage.views_of(
            [flat[f"flat_param_{g}"] for g in self.storage.group_names], remove_duplicate=False
        )
        with torch.no_grad():
            for name, view in views.items():
                view.copy_(values.pop(name))
        for key in values:
            flat[key] = values[key]
        if dtype is not None:
            for group in self.storage.group_names:
                flat[f"flat_param_{group}"] = flat[f"flat_param_{group}"].to(dtype)
        self.target.load_state_dict(flat)

    @rule()
    def state_dict_keys_and_zero_copy(self) -> None:
        state = self.model.state_dict()
        assert list(state) == list(self.plain.state_dict())
        if self._flat():
            ranges = [(f.data_ptr(), f.data_ptr() + f.nbytes) for f in self.storage.flat_params]
            for name, _ in self.storage.named_views(remove_duplicate=False):
                entry = state[self.prefix + name]  # the flat buffer's memory (through a storage of its own)
                assert any(lo <= entry.data_ptr() < hi for lo, hi in ranges), name

    # ----------------------------------------------------------------- copies, dtypes, removal
    @rule(seed=SEEDS)
    def deepcopy(self, seed: int) -> None:
        old = self.model
        before = {k: v.clone() for k, v in old.state_dict().items()}
        self.model, self.plain = copy.deepcopy(self.model), copy.deepcopy(self.plain)
        if self._registered():
            self.storage = get_flat_storage(self.target)
            assert self.storage is not None and self.storage.module is self.target
        self._new_optimizers()
        self.train_step(seed)  # the copy trains; the original must not move
        for key, value in old.state_dict().items():
            assert torch.equal(value, before[key]), f"deepcopy shares {key} with the original"

    @rule(dtype=st.sampled_from([torch.float32, torch.float64]), overwrite=st.booleans())
    def move_dtype(self, dtype: torch.dtype, overwrite: bool) -> None:
        # torch itself unties parameters when it overwrites them; keep the twin comparable.
        overwrite = overwrite and not self.has_ties
        previous = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
        try:
            self.model.to(dtype)
            self.plain.to(dtype)
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(previous)
        self._new_optimizers()

    @precondition(_registered)
    @rule()
    def remove(self) -> None:
        remove_flat_storage(self.target)
        self.storage = None
        for (name, module), (_, twin) in zip(self.model.named_modules(), self.plain.named_modules()):
            assert type(module) is type(twin), f"class of {name or '<root>'} not restored"
        self._new_optimizers()

    @precondition(lambda self: not self._registered())
    @rule(data=st.data())
    def register_again(self, data: st.DataObject) -> None:
        groups, align = data.draw(groupings(self.target))
        self.storage = register_flat_storage(self.target, groups, align=align)
        self._new_optimizers()

    # ----------------------------------------------------------------- the invariant
    def _model_grads(self) -> dict[str, torch.Tensor | None]:
        grads: dict[str, torch.Tensor | None] = {}
        if self._flat():
            grads.update((self.prefix + n, g) for n, g in self.storage.named_grads(remove_duplicate=False))
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if not name.rpartition(".")[2].startswith("flat_param_"):
                grads[name] = param.grad
        return grads

    @invariant()
    def agrees_with_plain(self) -> None:
        assert_same_values(self.model, self.plain, rtol=RTOL, atol=ATOL, msg="value of")
        plain_grads = {n: p.grad for n, p in self.plain.named_parameters(remove_duplicate=False)}
        model_grads = self._model_grads()
        assert sorted(model_grads) == sorted(plain_grads)
        for name, grad in plain_grads.items():
            _close(model_grads[name], grad, f"gradient of {name}")
        for names in tied_names(self.plain):
            tensors = [_get(self.model, name) for name in names]
            assert len({t.data_ptr() for t in tensors}) == 1, f"tie {names} broken"
            assert tensors[0].requires_grad == _get(self.plain, names[0]).requires_grad, names
        x = inputs(0)
        with torch.no_grad():
            _close(self.model(x), self.plain(x), "output")
        if self._registered():
            assert self.storage.module is self.target


#: Reproducible (derandomize, no example database) and sized for CI. Shrinking is off:
#: each step of these examples costs milliseconds and shrinking a failure can take minutes;
#: add Phase.shrink here to minimize a failing example while debugging.
PHASES = (Phase.explicit, Phase.reuse, Phase.generate)
MACHINE_SETTINGS = settings(
    max_examples=50,
    stateful_step_count=15,
    deadline=None,
    derandomize=True,
    database=None,
    phases=PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROPERTY_SETTINGS = settings(MACHINE_SETTINGS, max_examples=40)

TestFlattenedModelMatchesItsPlainTwin = FlattenedModelMatchesItsPlainTwin.TestCase
TestFlattenedModelMatchesItsPlainTwin.settings = MACHINE_SETTINGS


# --------------------------------------------------------------------------- single properties


@PROPERTY_SETTINGS
@given(net=nets(), data=st.data())
def test_register_then_remove_gives_back_the_plain_model(net, data):
    """register_flat_storage then remove_flat_storage leaves any model exactly as it was."""
    before = snapshot(net)
    groups, align = data.draw(groupings(net))
    register_flat_storage(net, groups, align=align)
    remove_flat_storage(net)
    assert_unchanged(net, before)


@PROPERTY_SETTINGS
@given(net=nets(), data=st.data(), seed=SEEDS)
def test_registration_keeps_existing_gradients(net, data, seed):
    """Gradients present at registration are the flattened model's gradients, in both modes."""
    net(inputs(seed)).pow(2).mean().backward()
    expected = {n: p.grad for n, p in net.named_parameters(remove_duplicate=False)}
    groups, align = data.draw(groupings(net))
    storage = register_flat_storage(net, groups, align=align)
    grads = dict(storage.named_grads(remove_duplicate=False))
    for name, param in net.named_parameters(remove_duplicate=False):
        grads.setdefault(name, param.grad)
    for name, grad in expected.items():
        _close(grads[name], grad, f"gradient of {name} in flat mode")
    with storage.unflattened():
        for name, param in net.named_parameters(remove_duplicate=False):
            _close(param.grad, expected[name], f"gradient of {name} in unflattened mode")


@PROPERTY_SETTINGS
@given(net=nets(), data=st.data())
def test_every_view_is_its_slot_of_the_flat_buffer(net, data):
    """Each flattened name is a zero-copy view at its ParamInfo offset; offsets aligned, padding zero."""
    plain = copy.deepcopy(net)
    groups, align = data.draw(groupings(net))
    storage = register_flat_storage(net, groups, align=align)
    flats = dict(zip(storage.group_names, storage.flat_params))
    covered = {g: torch.zeros(f.numel(), dtype=torch.bool) for g, f in flats.items()}
    for info in storage.param_infos:
        flat = flats[info.group]
        assert info.offset % align == 0 and info.dtype == flat.dtype
        for name in (info.name, *info.aliases):
            view = _get(net, name)
            assert view.shape == info.shape
            assert view.data_ptr() == flat.data_ptr() + info.offset * flat.element_size(), name
            assert torch.equal(view.detach(), _get(plain, name).detach()), name
        covered[info.group][info.offset : info.offset + info.numel] = True
    for group, flat in flats.items():
        assert not flat.detach()[~covered[group]].any(), f"padding of group {group} is not zero"


@PROPERTY_SETTINGS
@given(net=nets(), data=st.data(), seed=SEEDS)
def test_both_state_dict_forms_carry_a_model_into_a_fresh_copy(net, data, seed):
    """The plain and the flat state dict of a trained model reproduce it in a fresh registered copy."""
    fresh = copy.deepcopy(net)
    groups, align = data.draw(groupings(net))
    fresh_groups = None if groups is None else _same_groups(groups, net, fresh)
    storage = register_flat_storage(net, groups, align=align)
    storage_fresh = register_flat_storage(fresh, fresh_groups, align=align)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net(inputs(seed)).pow(2).mean().backward()
    opt.step()
    expected = values(net)
    for state in (storage.flat_state_dict(), net.state_dict()):
        with torch.no_grad():
            for flat in storage_fresh.flat_params:
                flat.zero_()
        fresh.load_state_dict(state)
        assert_same_values(fresh, expected)


def _same_groups(groups: Any, source: nn.Module, target: nn.Module) -> Any:
    """``groups`` of ``source`` with each Parameter item replaced by ``target``'s one of the same name."""
    names = {id(p): n for n, p in source.named_parameters(remove_duplicate=False)}
    params = dict(target.named_parameters(remove_duplicate=False))

    def convert(item: Any) -> Any:
        return params[names[id(item)]] if isinstance(item, nn.Parameter) else item

    if isinstance(groups, dict):
        return {k: [convert(i) for i in v] for k, v in groups.items()}
    if groups and isinstance(groups[0], list):
        return [[convert(i) for i in group] for group in groups]
    return [convert(i) for i in groups]
