"""File-backed (memory-mapped) flat buffers: weights on disk, pages read on access.

The SSD offload of fairscale's ``FlattenParamsWrapper``, done with the OS's
memory mapping. ``FlatStorage.offload_to_disk`` (:meth:`DiskOffload.offload`) writes each flat buffer
to a file with ordinary writes, maps the file back with
``torch.from_file(path, shared=True)`` and swaps the mapping in with
``flat.data = mapped``: the flat parameters stay the same objects (optimizers
keep working) and their RAM is released. Pages are read from the file when
touched, and in-place updates (an optimizer step, ``load_state_dict``) write
through the shared mapping to the file.

Why ordinary writes: pages written *through* a mapping are resident in this
process until the kernel writes them back and reclaims them, so resident
memory would not drop. Why the originals are refreshed after the swap: the
original parameter objects and every thread's view cache still point at the
old RAM buffer and would keep it alive (the coordinator's "flat buffer
replaced" notification, ``flat_buffers_replaced()``, does that).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
import warnings
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._core.features import Coordinator, Feature, in_flat_mode, storage_of
from .._core.names import flat_param_name
from .._core.records import Group

__all__ = ["DiskOffload"]

#: Bytes per ``os.write`` call: the write reads the tensor's memory in place,
#: so peak memory does not grow with the buffer size.
_CHUNK = 64 << 20


@dataclass
class _Backing:
    """The file behind one group's flat buffer, and the mapping of it."""

    path: Path
    mapped: Tensor  # held so that its address cannot be reused while we compare with it
    delete: weakref.finalize[..., Any]  # deletes the file; also runs when the storage dies or Python exits


def _same_storage(a: Tensor, b: Tensor) -> bool:
    try:
        return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:  # tensors without storage
        return False


def _write_chunks(fd: int, data: memoryview) -> None:
    """Write all of ``data`` to ``fd`` with ordinary writes, ``_CHUNK`` bytes at a time."""
    pos, end = 0, len(data)
    while pos < end:
        pos += os.write(fd, data[pos : pos + _CHUNK])


def _write_file(tensor: Tensor, path: Path) -> None:
    """Write the raw bytes of ``tensor`` to ``path`` (via a temporary name, fsynced).

    On any failure no file is left behind.
    """
    data = tensor.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    nbytes = data.numel() * data.element_size()
    # A zero-copy byte view of the tensor's memory: works for every dtype,
    # bfloat16 included (which has no numpy dtype); `data` stays alive meanwhile.
    raw = memoryview((ctypes.c_char * nbytes).from_address(data.data_ptr())).cast("B")
    partial = path.with_name(path.name + ".part")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        try:
            _write_chunks(fd, raw)
            os.fsync(fd)  # delayed-allocation errors (ENOSPC, EIO) surface here, not later
        finally:
            os.close(fd)
        os.replace(partial, path)
    except BaseException:
        _unlink(partial)
        raise


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDWR | getattr(os, "O_BINARY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:  # e.g. a platform that refuses to delete a mapped file
        warnings.warn(
            f"could not delete the offload file {path}: {err.strerror}; delete it by hand",
            ResourceWarning,
            stacklevel=3,
        )


class DiskOffload(Feature):
    """The disk-backing feature of a storage: which flat buffers are memory-mapped files.

    ``FlatStorage.offload_to_disk``, ``load_to_memory``, ``is_offloaded`` and
    ``offload_files`` delegate here (their docstrings state the semantics).

    Args:
        storage: the coordinator (held weakly).
    """

    def __init__(self, storage: Coordinator) -> None:
        self._storage_ref = weakref.ref(storage)
        #: Group index -> the file backing its flat buffer.
        self._files: dict[int, _Backing] = {}

    @property
    def _storage(self) -> Coordinator:
        return storage_of(self._storage_ref)

    # ------------------------------------------------------------- lifecycle
    def on_rebacked(self) -> None:
        """Delete the files of groups whose buffer ``module.to()`` & co. replaced."""
        if not self._files:
            return
        backed = self.backed()
        for g, backing in list(self._files.items()):
            if g not in backed:
                del self._files[g]
                backing.delete()

    def refresh(self) -> None:
        """Nothing to check: ``on_rebacked`` tells when a buffer leaves its file."""

    def on_removed(self) -> None:
        """Delete every file (``remove_flat_storage``: the values are in RAM by now).

        The detached flat parameters keep their mappings until they are
        dropped (a deleted file stays readable while mapped).
        """
        records, self._files = self._files, {}
        for backing in records.values():
            backing.delete()

    def copy_for(self, storage: Coordinator, memo: dict[int, Any]) -> DiskOffload:
        """A copy's buffers are in RAM: it has no files."""
        return DiskOffload(storage)

    def holds_layout(self) -> str | None:
        """While a flat buffer is the mapping of its file (not after ``load_to_memory()``)."""
        if not self._files or not self.backed():
            return None
        return "storage.load_to_memory(), and offload_to_disk() again after the change"

    # ---------------------------------------------------------------- queries
    def backed(self) -> dict[int, _Backing]:
        """Return the groups whose flat buffer still is the mapping of its file."""
        groups = self._storage.groups()
        return {
            g: backing
            for g, backing in self._files.items()
            if g < len(groups) and _same_storage(groups[g].flat, backing.mapped)
        }

    def files(self) -> dict[str, Path]:
        """Return the file of each offloaded group, by group name (see ``FlatStorage.offload_files``)."""
        groups = self._storage.groups()
        return {groups[g].name: backing.path for g, backing in sorted(self.backed().items())}

    # ---------------------------------------------------------------- actions
    def offload(self, directory: str | os.PathLike[str]) -> None:
        """Move the flat buffers to files in ``directory`` (see ``FlatStorage.offload_to_disk``)."""
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(
                f"offload_to_disk needs a directory path (str or os.PathLike); "
                f"got {type(directory).__name__}; pass e.g. '/mnt/ssd/weights'"
            )
        storage = self._storage
        _ = storage.module  # raises for a detached storage
        self.on_rebacked()  # forget the files of buffers replaced meanwhile
        groups = storage.groups()
        target = Path(os.path.abspath(os.fspath(directory)))
        backed = self.backed()
        for g, backing in backed.items():
            if backing.path.parent != target:
                raise RuntimeError(
                    "offload_to_disk keeps the flat buffers in one directory; they are already "
                    f"offloaded to {backing.path.parent} (group '{groups[g].name}') and got "
                    f"{target}; call load_to_memory() first to move them to another directory"
                )
        todo = [group for group in groups if group.index not in backed and group.flat.numel() > 0]
        for group in todo:
            if group.flat.device.type != "cpu":
                raise RuntimeError(
                    f"offload_to_disk maps files into CPU memory, so every flat buffer must be on "
                    f"the CPU; group '{group.name}' is on {group.flat.device}; move the module "
                    "with module.cpu() first"
                )
        if not target.exists():
            raise FileNotFoundError(
                errno.ENOENT,
                f"offload_to_disk needs an existing directory; {target} does not exist; create it "
                "first (os.makedirs) or pass another one. The weights stay in memory",
            )
        if not target.is_dir():
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"offload_to_disk needs a directory; {target} is a file; pass a directory. "
                "The weights stay in memory",
            )
        if not todo:
            return
        needed = sum(group.flat.numel() * group.flat.element_size() for group in todo)
        free = shutil.disk_usage(target).free
        if needed > free:
            raise OSError(
                errno.ENOSPC,
                f"offload_to_disk needs {needed} bytes of free disk space in {target}; only {free} "
                "are free; free some space or pass a directory on a larger disk. The weights stay "
                "in memory",
            )
        with in_flat_mode(storage):
            backings = self._write_and_map(todo, target)
            # Commit: attribute updates only.
            for g, backing in backings.items():
                groups[g].flat.data = backing.mapped
            self._files = {**backed, **backings}
            storage.flat_buffers_replaced()  # originals and every thread's views drop the RAM buffers

    def _write_and_map(self, groups: list[Group], target: Path) -> dict[int, _Backing]:
        """Write and map the files of ``groups``; on failure delete them and raise."""
        tag = uuid.uuid4().hex[:12]
        written: list[Path] = []
        backings: dict[int, _Backing] = {}
        try:
            for group in groups:
                flat = group.flat
                path = target / f"{flat_param_name(group.name)}.{tag}.bin"
                _write_file(flat, path)
                written.append(path)
                mapped = torch.from_file(str(path), shared=True, size=flat.numel(), dtype=flat.dtype)
                backings[group.index] = _Backing(path, mapped, weakref.finalize(self, _unlink, path))
        except BaseException as err:
            for backing in backings.values():
                backing.delete.detach()
            backings.clear()
            for path in written:
                _unlink(path)
            if isinstance(err, OSError):
                message = (
                    "offload_to_disk needs a writable directory with room for the flat buffers; "
                    f"writing to {target} failed: {err.strerror or err}; pass another directory or "
                    "free some space. The weights stay in memory, unchanged"
                )
                raise (OSError(message) if err.errno is None else OSError(err.errno, message)) from err
            raise
        return backings

    def load(self, keep_files: bool) -> None:
        """Bring offloaded buffers back into RAM (see ``FlatStorage.load_to_memory``)."""
        if not isinstance(keep_files, bool):
            raise TypeError(
                f"load_to_memory(keep_files=...) takes a bool; got {type(keep_files).__name__}; "
                "pass True or False"
            )
        self.on_rebacked()  # forget the files of buffers replaced meanwhile
        backed = self.backed()
        if not backed:
            return
        storage = self._storage
        _ = storage.module  # raises for a detached storage
        groups = storage.groups()
        # Per-tensor mode stays: its leaves are views of the mapped buffers and are pointed at the RAM
        # copies (flat_buffers_replaced). Flattening could refuse what outside code changed on the
        # model meanwhile (a parameter of another shape), which the storage lays out once loaded.
        with in_flat_mode(storage) if storage.is_flattened else nullcontext():
            # Allocate (and flush) first: a failure here leaves everything as it was.
            copies = {g: backing.mapped.clone() for g, backing in backed.items()}
            if not storage.is_flattened:
                _take_leaf_values(storage, copies)
            if keep_files:
                for backing in backed.values():
                    _fsync_file(backing.path)
            # Commit.
            for g, copy in copies.items():
                groups[g].flat.data = copy
            self._files = {g: b for g, b in self._files.items() if g not in backed}
            storage.flat_buffers_replaced()
        for backing in backed.values():
            if keep_files:
                backing.delete.detach()
            else:
                backing.delete()


def _take_leaf_values(storage: Coordinator, copies: dict[int, Tensor]) -> None:
    """Per-tensor mode: copy into ``copies`` (by group) the leaves given other memory (``.data = t``)."""
    groups = storage.groups()
    for slot in storage.slots():
        copy = copies.get(slot.group_index)
        if copy is None:
            continue
        views = groups[slot.group_index].views
        target, mapped = views.split(copy)[slot.index], views.split(groups[slot.group_index].flat)[slot.index]
        leaf = slot.param
        if leaf.data_ptr() != mapped.data_ptr() and leaf.shape == target.shape and leaf.dtype == target.dtype:
            with torch.no_grad():
                target.copy_(leaf.detach())
