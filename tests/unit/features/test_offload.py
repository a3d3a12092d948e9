"""File-backed flat buffers: offload_to_disk, load_to_memory, is_offloaded."""

from __future__ import annotations

import copy
import errno
import gc
import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import flatten_parametrize._features.offload as offload_module
from flatten_parametrize import FlatStorage, get_flat_storage, register_flat_storage, remove_flat_storage

from _helpers import TiedLM, WithOwnParam, assert_same_values, core_of, mlp, train_steps, twin, values


def _file_values(path: Path, dtype: torch.dtype) -> torch.Tensor:
    """Read an offload file with ordinary reads, independently of any mapping."""
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=dtype)


def _disk(storage: FlatStorage) -> offload_module.DiskOffload:
    """Return the disk-backing feature behind ``storage``."""
    return core_of(storage).feature(offload_module.DiskOffload)


def _in_file(tensor: torch.Tensor, storage: FlatStorage) -> bool:
    """Return whether ``tensor``'s memory lies in one of the storage's file mappings."""
    ptr = tensor.data_ptr()
    mappings = [b.mapped.untyped_storage() for b in _disk(storage).backed().values()]
    return any(m.data_ptr() <= ptr < m.data_ptr() + m.nbytes() for m in mappings)


def _listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# ------------------------------------------------------------------ semantics
def test_offload_keeps_values_and_backs_each_group_by_a_file(tmp_path):
    """After offload_to_disk every group's buffer is a mapping of its own file, values unchanged."""
    model = WithOwnParam()
    storage = register_flat_storage(model, {"weights": ["*.weight", "scale"], "biases": ["*.bias"]})
    flats, before = storage.flat_params, values(model)
    storage.offload_to_disk(tmp_path)
    assert storage.is_offloaded
    assert list(storage.offload_files) == ["weights", "biases"]
    assert sorted(p.name for p in storage.offload_files.values()) == _listing(tmp_path)
    assert [p.parent for p in storage.offload_files.values()] == [tmp_path, tmp_path]
    assert all(a is b for a, b in zip(storage.flat_params, flats))
    for flat in storage.flat_params:
        assert _in_file(flat, storage)
    assert _in_file(model.fc.weight, storage)
    for name, flat in zip(storage.group_names, storage.flat_params):
        assert torch.equal(_file_values(storage.offload_files[name], flat.dtype), flat.detach())
    assert_same_values(model, before)


def test_offload_handles_bfloat16_and_half_buffers(tmp_path):
    """Dtypes without a numpy equivalent (bfloat16) are written and mapped bit for bit."""
    model = nn.Sequential(nn.Linear(3, 4).to(torch.bfloat16), nn.Linear(4, 2).half())
    storage = register_flat_storage(model)
    expected = [f.detach().clone() for f in storage.flat_params]
    storage.offload_to_disk(tmp_path)
    for flat, want, path in zip(storage.flat_params, expected, storage.offload_files.values()):
        assert flat.dtype == want.dtype
        assert torch.equal(flat.detach(), want)
        assert torch.equal(_file_values(path, want.dtype), want)


def test_offloaded_training_matches_training_in_memory(tmp_path):
    """Forward, backward and optimizer steps on an offloaded model give the in-memory result."""
    plain = TiedLM()
    model = twin(plain)
    storage = register_flat_storage(model)
    register_flat_storage(plain)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # built before offload: same objects after
    ref = torch.optim.Adam(plain.parameters(), lr=1e-2)
    storage.offload_to_disk(tmp_path)
    batches = [torch.randint(0, 11, (4, 5)) for _ in range(3)]
    train_steps(model, opt, batches)
    train_steps(plain, ref, batches)
    assert storage.is_offloaded
    flat = storage["0"]
    assert flat.grad is not None and not _in_file(flat.grad, storage)  # gradients stay in RAM
    assert not _in_file(opt.state[flat]["exp_avg"], storage)  # so does optimizer state
    assert_same_values(model, plain, rtol=0, atol=0)
    assert torch.equal(model.head.weight, model.embed.weight)


def test_optimizer_step_writes_through_to_the_file(tmp_path):
    """An in-place optimizer update of an offloaded buffer reaches its file."""
    model = mlp()
    storage = register_flat_storage(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    storage.offload_to_disk(tmp_path)
    [path] = storage.offload_files.values()
    before = _file_values(path, torch.float32)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    after = _file_values(path, torch.float32)
    assert not torch.equal(after, before)
    assert torch.equal(after, storage["0"].detach())


def test_state_dicts_save_and_load_while_offloaded(tmp_path):
    """state_dict, flat_state_dict, torch.save and load_state_dict work on offloaded weights."""
    model = WithOwnParam()
    other = WithOwnParam()
    storage = register_flat_storage(model)
    storage.offload_to_disk(tmp_path)
    plain = model.state_dict()
    assert _in_file(plain["fc.weight"], storage)  # zero copy, as in RAM
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert_same_values(loaded, plain)
    flat_sd = {k: v.clone() for k, v in storage.flat_state_dict().items()}
    model.load_state_dict(other.state_dict())
    [path] = storage.offload_files.values()
    assert torch.equal(model.fc.weight, other.fc.weight)
    assert torch.equal(_file_values(path, torch.float32), storage["0"].detach())  # loaded into the file
    model.load_state_dict(flat_sd)
    assert torch.equal(storage["0"].detach(), flat_sd["flat_param_0"])
    assert storage.is_offloaded


def test_load_to_memory_brings_values_back_and_deletes_files(tmp_path):
    """load_to_memory copies the current values into RAM, keeps the objects, removes the files."""
    model = mlp()
    storage = register_flat_storage(model)
    flat = storage["0"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    storage.offload_to_disk(tmp_path)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    expected = flat.detach().clone()
    mapping = StorageWeakRef(_disk(storage).backed()[0].mapped.untyped_storage())
    storage.load_to_memory()
    gc.collect()
    assert not storage.is_offloaded and storage.offload_files == {}
    assert _listing(tmp_path) == []
    assert storage["0"] is flat and torch.equal(flat.detach(), expected)
    assert mapping.expired()  # nothing holds the mapping of the deleted file
    model(torch.randn(2, 5)).sum().backward()
    opt.step()  # the optimizer built before still trains the same parameter
    assert not torch.equal(flat.detach(), expected)


def test_load_to_memory_can_keep_the_files_with_current_values(tmp_path):
    """load_to_memory(keep_files=True) leaves each file holding the latest values."""
    model = mlp()
    storage = register_flat_storage(model)
    storage.offload_to_disk(tmp_path)
    with torch.no_grad():
        model[0].bias.fill_(3.0)
    [path] = storage.offload_files.values()
    storage.load_to_memory(keep_files=True)
    assert not storage.is_offloaded
    assert _listing(tmp_path) == [path.name]
    assert torch.equal(_file_values(path, torch.float32), storage["0"].detach())
    with torch.no_grad():
        model[0].bias.fill_(4.0)  # RAM now: the kept file no longer follows
    assert _file_values(path, torch.float32)[25:30].tolist() == [3.0] * 5


def test_load_to_memory_without_offload_does_nothing(tmp_path):
    """load_to_memory on a storage in RAM changes nothing."""
    model = mlp()
    storage = register_flat_storage(model)
    before = storage["0"].data_ptr()
    storage.load_to_memory()
    assert storage["0"].data_ptr() == before and not storage.is_offloaded


def test_remove_flat_storage_gives_ram_parameters_and_deletes_files(tmp_path):
    """remove_flat_storage on an offloaded model leaves ordinary parameters in RAM and no files."""
    model = TiedLM()
    weight = model.body.weight
    storage = register_flat_storage(model)
    storage.offload_to_disk(tmp_path)
    before = values(model)
    mapped = {b.mapped.untyped_storage().data_ptr() for b in _disk(storage).backed().values()}
    remove_flat_storage(model)
    assert _listing(tmp_path) == []
    assert not storage.is_offloaded
    assert model.body.weight is weight and type(model.body.weight) is nn.Parameter
    assert model.head.weight is model.embed.weight
    for param in model.parameters():
        assert param.untyped_storage().data_ptr() not in mapped
    assert_same_values(model, before)
    with torch.no_grad():
        model.body.weight.add_(1.0)  # still a working parameter


def test_module_to_another_dtype_brings_weights_to_memory(tmp_path):
    """module.to(dtype) while offloaded converts into RAM: files deleted, is_offloaded False."""
    model = mlp()
    storage = register_flat_storage(model)
    storage.offload_to_disk(tmp_path)
    before = storage["0"].detach().clone()
    model.float()  # a no-op conversion keeps the file
    model.to("cpu")
    assert storage.is_offloaded and len(_listing(tmp_path)) == 1
    model.double()
    assert not storage.is_offloaded
    assert _listing(tmp_path) == []
    assert storage["0"].dtype == torch.float64
    assert torch.equal(storage["0"].detach(), before.double())
    assert model(torch.randn(2, 5, dtype=torch.float64)).dtype == torch.float64


def test_conversion_with_new_parameter_objects_releases_files(tmp_path):
    """With overwrite-on-conversion (new parameter objects), a conversion also releases the files."""
    model = mlp()
    storage = register_flat_storage(model)
    storage.offload_to_disk(tmp_path)
    before = storage["0"].detach().clone()
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.half()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    assert not storage.is_offloaded and _listing(tmp_path) == []
    assert torch.equal(storage["0"].detach(), before.half())


def test_deepcopy_of_offloaded_model_lives_in_memory(tmp_path):
    """copy.deepcopy of an offloaded model gives an independent copy in RAM, no new file."""
    model = mlp()
    storage = register_flat_storage(model)
    storage.offload_to_disk(tmp_path)
    clone = copy.deepcopy(model)
    copied = get_flat_storage(clone)
    assert copied is not None and not copied.is_offloaded
    assert not _in_file(copied["0"], storage)
    assert len(_listing(tmp_path)) == 1
    with torch.no_grad():
        clone[0].weight.zero_()
    assert not torch.equal(model[0].weight, clone[0].weight)
    x = torch.randn(2, 5)
    clone.load_state_dict(model.state_dict())
    assert torch.equal(model(x), clone(x))


def test_two_storages_share_a_directory_without_collisions(tmp_path):
    """Offload files are named uniquely, so storages (even with equal group names) share a directory."""
    first, second = mlp(seed=1), mlp(seed=2)
    a, b = register_flat_storage(first), register_flat_storage(second)
    a.offload_to_disk(tmp_path)
    b.offload_to_disk(tmp_path)
    assert len(_listing(tmp_path)) == 2
    assert not torch.equal(first[0].weight, second[0].weight)
    a.load_to_memory()
    assert _listing(tmp_path) == [b.offload_files["0"].name]


def test_offload_in_unflattened_mode_keeps_mode_and_pending_changes(tmp_path):
    """Offloading while unflattened keeps that mode and writes pending changes to the file."""
    model = mlp()
    storage = register_flat_storage(model)
    with storage.unflattened():
        with torch.no_grad():
            model[0].bias.fill_(2.0)
        storage.offload_to_disk(tmp_path)
        assert not storage.is_flattened
        assert isinstance(model[0].weight, nn.Parameter) and _in_file(model[0].weight, storage)
        model(torch.randn(2, 5)).sum().backward()
    [path] = storage.offload_files.values()
    assert _file_values(path, torch.float32)[25:30].tolist() == [2.0] * 5
    assert storage["0"].grad is not None


def test_offload_again_to_the_same_directory_does_nothing(tmp_path):
    """A second offload_to_disk to the same directory keeps the existing files."""
    model = mlp()
    storage = register_flat_storage(model)
    storage.offload_to_disk(tmp_path)
    files = storage.offload_files
    storage.offload_to_disk(str(tmp_path))
    assert storage.offload_files == files and len(_listing(tmp_path)) == 1


@pytest.mark.parametrize("groups", [None, []], ids=["parameterless-module", "empty-groups"])
def test_offload_of_a_storage_without_groups_is_a_no_op(tmp_path, groups):
    """A storage with no groups offloads nothing and writes no file."""
    module = nn.Sequential(nn.ReLU()) if groups is None else nn.Sequential(nn.Linear(2, 2))
    storage = register_flat_storage(module, groups)
    storage.offload_to_disk(tmp_path)
    assert not storage.is_offloaded and _listing(tmp_path) == []
    storage.load_to_memory()
    assert not storage.is_offloaded


def test_offload_files_are_deleted_when_the_model_is_collected(tmp_path):
    """Offload files are scratch space: they go when the model and its storage are collected."""
    model = mlp()
    storage = register_flat_storage(model)
    storage.offload_to_disk(tmp_path)
    assert len(_listing(tmp_path)) == 1
    del model, storage
    gc.collect()
    assert _listing(tmp_path) == []


def test_other_threads_view_caches_do_not_keep_the_ram_buffer_alive(tmp_path):
    """After offload the old RAM buffer is freed, even if another live thread cached views of it."""
    model = mlp()
    storage = register_flat_storage(model)
    ready, done = threading.Event(), threading.Event()

    def worker() -> None:
        model(torch.randn(2, 5))  # fills this thread's view cache
        with torch.no_grad():
            model(torch.randn(2, 5))
        ready.set()
        done.wait(30)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert ready.wait(30)
        model(torch.randn(2, 5))
        old = StorageWeakRef(storage["0"].untyped_storage())
        storage.offload_to_disk(tmp_path)
        gc.collect()
        assert old.expired()
    finally:
        done.set()
        thread.join()


@pytest.mark.slow
def test_offloaded_model_releases_resident_memory(tmp_path):
    """Offloading a ~256 MB model drops resident memory by about its size; outputs are unchanged."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc/self/status (Linux) to read resident memory")
    result = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))
    size = report["model_bytes"]
    assert size >= 256 << 20
    assert report["same_output"]
    assert report["before"]["VmRSS"] - report["offloaded"]["VmRSS"] >= 0.9 * size
    # Reading the weights maps file pages (RssFile, reclaimable), never anonymous RAM.
    assert report["after_forward"]["RssAnon"] - report["offloaded"]["RssAnon"] < 0.1 * size
    assert report["files_while_offloaded"] == 1
    assert _listing(tmp_path) == []  # deleted when the process exits


_RSS_SCRIPT = r"""
import gc, json, sys, threading
import torch
from torch import nn
from flatten_parametrize import register_flat_storage

def rss():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out

torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(4)])  # 4 x 64 MiB
storage = register_flat_storage(model)
x = torch.randn(8, 4096)
with torch.no_grad():
    reference = model(x)
ready, done = threading.Event(), threading.Event()

def worker():
    with torch.no_grad():
        model(x)  # another thread's view cache, alive during the offload
    ready.set()
    done.wait(60)

thread = threading.Thread(target=worker)
thread.start()
ready.wait(60)
gc.collect()
before = rss()
storage.offload_to_disk(sys.argv[1])
gc.collect()
offloaded = rss()
with torch.no_grad():
    output = model(x)
after_forward = rss()
done.set()
thread.join()
print(json.dumps({
    "model_bytes": storage["0"].numel() * storage["0"].element_size(),
    "files_while_offloaded": len(storage.offload_files),
    "before": before, "offloaded": offloaded, "after_forward": after_forward,
    "same_output": bool(torch.equal(reference, output)),
}))
"""


# --------------------------------------------------------------------- errors
def _assert_untouched(model: nn.Module, storage: FlatStorage, before: dict[str, torch.Tensor]) -> None:
    assert not storage.is_offloaded
    assert _disk(storage)._files == {}
    assert_same_values(model, before)


def test_offload_to_missing_directory_raises_and_keeps_weights(tmp_path):
    """A directory that does not exist is refused; the weights stay in memory."""
    model = mlp()
    storage = register_flat_storage(model)
    before = values(model)
    with pytest.raises(FileNotFoundError, match=r"needs an existing directory; .* does not exist; create it"):
        storage.offload_to_disk(tmp_path / "missing")
    _assert_untouched(model, storage, before)


def test_offload_to_a_file_raises(tmp_path):
    """A path that is a file, not a directory, is refused."""
    model = mlp()
    storage = register_flat_storage(model)
    target = tmp_path / "weights.bin"
    target.write_bytes(b"")
    with pytest.raises(NotADirectoryError, match=r"needs a directory; .* is a file"):
        storage.offload_to_disk(target)
    assert _listing(tmp_path) == ["weights.bin"]


def test_offload_needs_a_path(tmp_path):
    """A directory that is not a str or os.PathLike is refused with a TypeError."""
    model = mlp()
    storage = register_flat_storage(model)
    with pytest.raises(TypeError, match=r"needs a directory path .*; got int"):
        storage.offload_to_disk(3)  # type: ignore[arg-type]


def test_offload_to_read_only_directory_raises_and_keeps_weights(tmp_path, monkeypatch):
    """A directory where files cannot be created gives a PermissionError; weights untouched."""
    model = mlp()
    storage = register_flat_storage(model)
    before = values(model)
    real_open = os.open

    def refuse(path, *args, **kwargs):  # as a read-only directory answers (even for root)
        if str(path).startswith(str(tmp_path)) and args and args[0] & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(
        PermissionError, match=r"needs a writable directory .*; writing to .* failed: Permission denied"
    ):
        storage.offload_to_disk(tmp_path)
    monkeypatch.undo()
    _assert_untouched(model, storage, before)
    assert _listing(tmp_path) == []


def test_offload_refuses_when_free_space_is_too_small(tmp_path, monkeypatch):
    """A disk without room for the buffers is refused before writing (ENOSPC)."""
    model = mlp()
    storage = register_flat_storage(model)
    before = values(model)
    usage = offload_module.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(offload_module.shutil, "disk_usage", lambda path: usage._replace(free=10))
    with pytest.raises(OSError, match=r"needs 360 bytes of free disk space in .*; only 10 are free") as info:
        storage.offload_to_disk(tmp_path)
    assert info.value.errno == errno.ENOSPC
    _assert_untouched(model, storage, before)
    assert _listing(tmp_path) == []


def test_disk_full_during_write_leaves_no_partial_files(tmp_path, monkeypatch):
    """A write failing half-way (disk full) raises, deletes every file written, keeps the weights."""
    model = WithOwnParam()
    storage = register_flat_storage(model, {"w": ["*.weight", "scale"], "b": ["*.bias"]})
    before = values(model)
    real_write = offload_module._write_chunks
    calls = []

    def fill_up(fd: int, data: memoryview) -> None:
        calls.append(fd)
        if len(calls) == 1:
            real_write(fd, data)  # the first group's file completes
            return
        os.write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(offload_module, "_write_chunks", fill_up)
    expected = r"needs a writable directory with room .*; writing to .* failed: No space left on device"
    with pytest.raises(OSError, match=expected) as info:
        storage.offload_to_disk(tmp_path)
    assert info.value.errno == errno.ENOSPC and len(calls) == 2
    _assert_untouched(model, storage, before)
    assert _listing(tmp_path) == []


def test_offload_refuses_buffers_off_the_cpu(tmp_path):
    """Only CPU buffers can be mapped from files; other devices are refused."""
    layer = nn.Linear(2, 2, device="meta")
    storage = register_flat_storage(layer)
    with pytest.raises(RuntimeError, match="every flat buffer must be on the CPU; group '0' is on meta"):
        storage.offload_to_disk(tmp_path)
    assert _listing(tmp_path) == []


def test_offload_to_another_directory_while_offloaded_raises(tmp_path):
    """Offloaded buffers are not moved between directories implicitly."""
    model = mlp()
    storage = register_flat_storage(model)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    storage.offload_to_disk(tmp_path / "a")
    with pytest.raises(
        RuntimeError,
        match=r"keeps the flat buffers in one directory; .* already offloaded to .*; call load_to_memory\(\)",
    ):
        storage.offload_to_disk(tmp_path / "b")
    assert _listing(tmp_path / "b") == []


def test_load_to_memory_needs_a_bool(tmp_path):
    """keep_files must be a bool."""
    model = mlp()
    storage = register_flat_storage(model)
    with pytest.raises(TypeError, match=r"keep_files=\.\.\.\) takes a bool; got str; pass True or False"):
        storage.load_to_memory(keep_files="yes")  # type: ignore[arg-type]
