"""A persistent worker's staging: one shared segment per save, handed over as one descriptor.

The persistent worker receives a request through a multiprocessing queue. torch pickles every
shared CPU storage as a file descriptor of its own, which the worker fetches over a connection
of its own, an authenticated handshake each: for the hundreds of tensors of a model, that is
upstream's whole wait, and it would come on top of the snapshot's copy. So the snapshot stages
a persistent worker's tensors in one shared segment (:class:`ArenaSet`): the request pickles
one descriptor and a view of it per tensor.

``torch.save`` writes a tensor's whole storage, so the worker must not write the views as
they are: the request's preload step, which the worker runs before it writes, gives each view
a storage of its own over the same memory (:func:`exact_storages`: a slice of the segment, no
copy). The worker keeps the last segments it received, so the next request's descriptor maps
to memory already mapped (torch's shared-storage cache) instead of mapping and faulting in the
whole segment again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from megatron_ckpt_fixes.fixes.snapshot.overlap import wait_for_copy

#: Each tensor starts at a multiple of this many bytes (every dtype's alignment, a cache line).
ALIGN = 64


def offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Where each tensor starts in a segment holding all of them, and the segment's size."""
    starts, end = [], 0
    for tensor in tensors:
        starts.append(end)
        end += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return starts, end


class ArenaSet:
    """The staging of one save in flight on a persistent worker: one shared segment, kept
    across saves and grown when a save needs more."""

    shared = True

    def __init__(self) -> None:
        self.segment: torch.UntypedStorage | None = None

    def targets(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        """Empty tensors shaped like ``tensors`` in the segment, and the bytes allocated."""
        starts, size = offsets(tensors)
        allocated = 0
        if self.segment is None or self.segment.nbytes() < size:
            self.segment = torch.UntypedStorage._new_shared(size)
            allocated = size
        return [torch.empty(0, dtype=t.dtype).set_(self.segment, start // t.element_size(),
                                                   t.shape)
                for t, start in zip(tensors, starts)], allocated

    def nbytes(self) -> int:
        return 0 if self.segment is None else self.segment.nbytes()

    def trim(self) -> None:
        """Its save is over: the segment stays for the next one."""


#: In the worker: the segments of the last request, kept mapped for the next one.
_KEPT: list[torch.UntypedStorage] = []


def own_storage(tensor: torch.Tensor,
                segments: dict[int, torch.UntypedStorage]) -> torch.Tensor:
    """``tensor`` over a storage of exactly its bytes (a slice of its segment, no copy) when
    it is a contiguous CPU view into a larger one, its segment added to ``segments``;
    otherwise ``tensor`` itself."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if (tensor.device.type != "cpu" or storage.nbytes() == nbytes
            or not tensor.is_contiguous()):
        return tensor
    segments.setdefault(storage.data_ptr(), storage)
    start = tensor.storage_offset() * tensor.element_size()
    return torch.empty(0, dtype=tensor.dtype).set_(storage[start:start + nbytes], 0,
                                                   tensor.shape)


def _exact(value: Any, segments: dict[int, torch.UntypedStorage]) -> Any:
    if isinstance(value, torch.Tensor):
        return own_storage(value, segments)
    if isinstance(value, list):
        return [_exact(v, segments) for v in value]
    if isinstance(value, tuple):
        items = [_exact(v, segments) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def exact_storages(preload: Callable[[], Any], ready: Connection | None = None) -> Any:
    """A persistent worker's preload step: upstream's, then every view of a staging segment
    in what it returns given a storage of its own, the segments kept for the next request,
    and last the trainer's copy awaited (``ready``, see :mod:`.overlap`): the steps before
    it read no value, so they run while the trainer copies."""
    segments: dict[int, torch.UntypedStorage] = {}
    staged = _exact(preload(), segments)
    _KEPT[:] = segments.values()
    if ready is not None:
        wait_for_copy(ready)
    return staged


def with_exact_storages(request: Any, ready: Connection | None = None) -> Any:
    """``request`` whose preload step is :func:`exact_storages` around its own."""
    return request._replace(preload_fn=functools.partial(exact_storages, request.preload_fn,
                                                         ready))
