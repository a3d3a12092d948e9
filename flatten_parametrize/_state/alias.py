"""State-dict values that alias the flat buffer through a storage of their own.

Savers that keep one tensor per storage (accelerate's safetensors path,
``safetensors.torch.save_model`` / ``load_model``) identify a tensor's storage
by ``(device, untyped_storage().data_ptr(), untyped_storage().nbytes())``. Plain
views of one flat buffer all report the buffer's storage, so such savers keep
one of them and drop the rest. A DLPack round trip gives a tensor on the same
memory (no copy) whose storage starts at the view and is exactly its size,
and which keeps the flat buffer alive while it lives.
"""

from __future__ import annotations

from torch import Tensor
from torch.utils.dlpack import from_dlpack, to_dlpack  # type: ignore[attr-defined]

__all__ = ["own_storage_alias"]


def own_storage_alias(view: Tensor) -> Tensor:
    """Return a tensor on ``view``'s memory whose storage covers exactly ``view`` (no copy).

    ``view`` must not require grad (a detached state-dict value). Meta
    tensors hold no memory, and DLPack carries no bit-packed dtype
    (``torch.bits8`` & co.): those are returned as they are.

    Example:
        >>> import torch
        >>> buffer = torch.arange(6.0)
        >>> alias = own_storage_alias(buffer[2:4])
        >>> alias.untyped_storage().nbytes(), alias.data_ptr() == buffer[2:4].data_ptr()
        (8, True)
        >>> _ = alias.zero_()
        >>> buffer.tolist()
        [0.0, 1.0, 0.0, 0.0, 4.0, 5.0]
    """
    if view.is_meta:
        return view
    try:
        return from_dlpack(to_dlpack(view))
    except BufferError:
        return view
