"""File-backed (memory-mapped) flat buffers: weights on disk, pages read on access.

The SSD offload of fairscale's ``FlattenParamsWrapper``, done with the OS's
memory mapping. :meth:`OffloadMixin.offload_to_disk` writes each flat buffer
to a file with ordinary writes, maps the file back with
``torch.from_file(path, shared=True)`` and swaps the mapping in with
``flat.data = mapped``: the flat parameters stay the same objects (optimizers
keep working) and their RAM is released. Pages are read from the file when
touched, and in-place updates (an optimizer step, ``load_state_dict``) write
through the shared mapping to the file.

Why ordinary writes: pages written *through* a mapping are resident in this
process until the kernel writes them back and reclaims them, so resident
memory would not drop. Why ``_refresh_originals()`` after the swap: the
original parameter objects and every thread's view cache still point at the
old RAM buffer and would keep it alive.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch import nn

    from ._flat_parameter import FlatParameter

__all__ = ["OffloadMixin"]

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


class OffloadMixin:
    """``FlatStorage`` methods that re-back the flat buffers by memory-mapped files."""

    #: Group index -> the file backing its flat buffer (``None``: never offloaded).
    _offload: dict[int, _Backing] | None = None

    if TYPE_CHECKING:
        _flat: list[FlatParameter]
        _group_names: list[str]
        _flattened: bool

        @property
        def module(self) -> nn.Module: ...

        def flatten(self) -> None: ...

        def unflatten(self) -> None: ...

        def _refresh_originals(self) -> None: ...

    # ---------------------------------------------------------------- queries
    def _backed(self) -> dict[int, _Backing]:
        """Return the groups whose flat buffer still is the mapping of its file."""
        return {
            g: backing
            for g, backing in (self._offload or {}).items()
            if g < len(self._flat) and _same_storage(self._flat[g], backing.mapped)
        }

    @property
    def is_offloaded(self) -> bool:
        """Return whether flat buffers are file-backed (by :meth:`offload_to_disk`).

        ``False`` again after :meth:`load_to_memory`, ``remove_flat_storage``,
        or a ``module.to()`` that converted or moved the buffers.
        """
        return bool(self._backed())

    @property
    def offload_files(self) -> dict[str, Path]:
        """Return the file backing each offloaded group's flat buffer, by group name.

        Each file holds the raw bytes of the flat parameter (padding included)
        in native byte order. Empty when nothing is offloaded.
        """
        return {self._group_names[g]: backing.path for g, backing in sorted(self._backed().items())}

    # ---------------------------------------------------------------- actions
    def offload_to_disk(self, directory: str | os.PathLike[str]) -> None:
        """Move the flat buffers to memory-mapped files in ``directory``, releasing their RAM.

        Each group's buffer is written to its own file (named after the group
        and a random tag, so several storages can share a directory) with
        ordinary writes, fsynced, then mapped back with
        ``torch.from_file(..., shared=True)`` and swapped in as the flat
        parameter's ``.data``. The flat parameters stay the same objects, so
        an optimizer built before keeps working. Pages are read from the file
        on access; in-place updates (optimizer steps, ``load_state_dict``,
        ``copy_``) write through to the file. Forward, backward and state dicts
        work as before.

        Gradients and optimizer state stay in RAM. Resident memory drops by the
        buffers' size only if nothing else holds the old buffers: an autograd
        graph kept from an earlier forward, a ``state_dict()`` or
        ``named_views()`` result, or your own views do.

        What moves the weights back to RAM (and deletes the files):
        :meth:`load_to_memory`, ``remove_flat_storage`` (ordinary parameters
        in RAM), and a ``module.to()`` / ``.double()`` / ``.cuda()`` that
        converts or moves a buffer (a no-op ``.to()`` keeps it offloaded).
        ``copy.deepcopy`` of the module gives a copy in RAM. Calling this again
        with the same directory offloads only groups that are in RAM.

        Args:
            directory (str or os.PathLike): an existing, writable directory,
                ideally on a fast local disk.

        Raises:
            TypeError: if ``directory`` is not a path.
            RuntimeError: if a flat buffer is not on the CPU, or the buffers
                are already offloaded to another directory.
            FileNotFoundError: if ``directory`` does not exist.
            NotADirectoryError: if ``directory`` is not a directory.
            OSError: if the disk has too little free space (``errno.ENOSPC``)
                or a file cannot be written (``PermissionError`` for a
                read-only directory). In every case the weights stay in
                memory, unchanged, and no file is left behind.

        Example:
            >>> import os, tempfile, torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Linear(4, 2)
            >>> storage = register_flat_storage(model)
            >>> with tempfile.TemporaryDirectory() as directory:
            ...     storage.offload_to_disk(directory)
            ...     print(storage.is_offloaded, len(os.listdir(directory)))
            ...     print(model(torch.ones(1, 4)).shape)
            ...     storage.load_to_memory()
            ...     print(storage.is_offloaded, os.listdir(directory))
            True 1
            torch.Size([1, 2])
            False []
        """
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(
                f"offload_to_disk needs a directory path (str or os.PathLike); "
                f"got {type(directory).__name__}; pass e.g. '/mnt/ssd/weights'"
            )
        _ = self.module  # raises for a detached storage
        self._forget_stale_files()
        target = Path(os.path.abspath(os.fspath(directory)))
        backed = self._backed()
        for g, backing in backed.items():
            if backing.path.parent != target:
                raise RuntimeError(
                    "offload_to_disk keeps the flat buffers in one directory; they are already "
                    f"offloaded to {backing.path.parent} (group '{self._group_names[g]}') and got "
                    f"{target}; call load_to_memory() first to move them to another directory"
                )
        todo = [g for g, flat in enumerate(self._flat) if g not in backed and flat.numel() > 0]
        for g in todo:
            flat = self._flat[g]
            if flat.device.type != "cpu":
                raise RuntimeError(
                    f"offload_to_disk maps files into CPU memory, so every flat buffer must be on "
                    f"the CPU; group '{self._group_names[g]}' is on {flat.device}; move the module "
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
        needed = sum(self._flat[g].numel() * self._flat[g].element_size() for g in todo)
        free = shutil.disk_usage(target).free
        if needed > free:
            raise OSError(
                errno.ENOSPC,
                f"offload_to_disk needs {needed} bytes of free disk space in {target}; only {free} "
                "are free; free some space or pass a directory on a larger disk. The weights stay "
                "in memory",
            )
        was_flat = self._flattened
        self.flatten()
        try:
            backings = self._write_and_map(todo, target)
            # Commit: attribute updates only.
            for g, backing in backings.items():
                self._flat[g].data = backing.mapped
            self._offload = {**backed, **backings}
            self._refresh_originals()  # originals and every thread's views drop the RAM buffers
        finally:
            if not was_flat:
                self.unflatten()

    def _write_and_map(self, groups: list[int], target: Path) -> dict[int, _Backing]:
        """Write and map the files of ``groups``; on failure delete them and raise."""
        tag = uuid.uuid4().hex[:12]
        written: list[Path] = []
        backings: dict[int, _Backing] = {}
        try:
            for g in groups:
                flat = self._flat[g]
                path = target / f"flat_param_{self._group_names[g]}.{tag}.bin"
                _write_file(flat, path)
                written.append(path)
                mapped = torch.from_file(str(path), shared=True, size=flat.numel(), dtype=flat.dtype)
                backings[g] = _Backing(path, mapped, weakref.finalize(self, _unlink, path))
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

    def load_to_memory(self, keep_files: bool = False) -> None:
        """Bring offloaded flat buffers back into RAM.

        The values (including every update made while offloaded) are copied
        into fresh RAM buffers, swapped in as the flat parameters' ``.data``
        (the same objects, so optimizers keep working), and the files are
        deleted. Does nothing if nothing is offloaded.

        Args:
            keep_files (bool): keep the files (fsynced, holding the current
                values) instead of deleting them; see :attr:`offload_files`
                for their paths, read before this call. Default: ``False``.

        Raises:
            TypeError: if ``keep_files`` is not a bool.
            RuntimeError: if the RAM for the buffers cannot be allocated; the
                buffers then stay offloaded, unchanged.

        Example:
            >>> import tempfile, torch
            >>> from torch import nn
            >>> from flatten_parametrize import register_flat_storage
            >>> model = nn.Linear(4, 2)
            >>> storage = register_flat_storage(model)
            >>> with tempfile.TemporaryDirectory() as directory:
            ...     storage.offload_to_disk(directory)
            ...     with torch.no_grad():
            ...         _ = model.bias.fill_(7.0)  # writes through to the file
            ...     [path] = storage.offload_files.values()
            ...     storage.load_to_memory(keep_files=True)
            ...     print(storage.is_offloaded, model.bias.tolist())
            ...     print(torch.from_file(str(path), size=10)[-2:])
            False [7.0, 7.0]
            tensor([7., 7.])
        """
        if not isinstance(keep_files, bool):
            raise TypeError(
                f"load_to_memory(keep_files=...) takes a bool; got {type(keep_files).__name__}; "
                "pass True or False"
            )
        self._forget_stale_files()
        backed = self._backed()
        if not backed:
            return
        _ = self.module  # raises for a detached storage
        was_flat = self._flattened
        self.flatten()
        try:
            # Allocate (and flush) first: a failure here leaves everything as it was.
            copies = {g: backing.mapped.clone() for g, backing in backed.items()}
            if keep_files:
                for backing in backed.values():
                    _fsync_file(backing.path)
            # Commit.
            for g, copy in copies.items():
                self._flat[g].data = copy
            self._offload = {g: b for g, b in (self._offload or {}).items() if g not in backed}
            self._refresh_originals()
        finally:
            if not was_flat:
                self.unflatten()
        for backing in backed.values():
            if keep_files:
                backing.delete.detach()
            else:
                backing.delete()

    # -------------------------------------------------- hooks for FlatStorage
    def _forget_stale_files(self) -> None:
        """Delete the files of groups whose buffer ``module.to()`` & co. replaced."""
        if not self._offload:
            return
        backed = self._backed()
        for g, backing in list(self._offload.items()):
            if g not in backed:
                del self._offload[g]
                backing.delete()

    def _release_files(self) -> None:
        """Delete every offload file (``remove_flat_storage``: the values are in RAM by now).

        The detached flat parameters keep their mappings until they are
        dropped (a deleted file stays readable while mapped).
        """
        records, self._offload = self._offload or {}, None
        for backing in records.values():
            backing.delete()
