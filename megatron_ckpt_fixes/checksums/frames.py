"""torch.save's framing of a checksummed tensor item, recorded per layout and replayed.

torch DCP's ``_write_item`` serializes every tensor item with ``torch.save``: a pickle of the
tensor's layout, a zip archive of five records around the storage's bytes, about 40 writes.
For a plain CPU tensor, with torch's CRC-32 off (the records the checksums feature vouches
for, :mod:`.writer`), what those writes hold depends only on the tensor's layout (dtype,
shape, strides, storage offset and size) and torch's settings, never on its values: two
saves of equal layouts differ only in the storage's bytes. Building that framing costs about
0.3 ms of Python per item: the realistic benchmark's save (two ranks, 240 items and 0.563 GiB
each, tmpfs, megatron-core 0.16.1, medians of 10 saves) took 0.48-0.55 s with torch's own
framing, 0.37-0.42 s with it replayed.

So inside a checksummed record (:func:`replay_allowed`), the patched ``torch.save`` keeps
what torch wrote for a layout: the first save of a layout is torch's own, recorded; the
second is torch's own again, and the layout is replayed from then on only if its framing
was the same both times (detected, so a torch whose framing changes per call, a counter or
a timestamp, is never replayed). A replay writes the recorded pieces and the storage's
bytes, in torch's order, through the same stream: byte for byte what ``torch.save`` writes
(the tests compare), and the checksum is taken from those writes as before.

Anything else is torch's own ``torch.save``: another thread, CRC-32 on, extra arguments, a
subclass or a tensor with Python state, hooks or gradients, a quantized, sparse, conjugate
or negative-bit tensor, an empty storage, ``torch.serialization.skip_data``.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy
import torch

#: Layouts kept at most (a model has far fewer distinct ones); beyond it, torch's own save.
MAX_LAYOUTS = 1 << 14

#: One of torch's writes: its bytes, :data:`STORAGE` (the storage's bytes) or :data:`FLUSH`.
Piece = Any
STORAGE = None
FLUSH = b""

_allowed = threading.local()


@contextmanager
def replay_allowed() -> Iterator[None]:
    """Within the block, this thread's ``torch.save`` of an eligible tensor may be
    replayed (torch's CRC-32 must be off for this thread's records)."""
    outer = getattr(_allowed, "on", False)
    _allowed.on = True
    try:
        yield
    finally:
        _allowed.on = outer


def layout_of(obj: Any) -> tuple | None:
    """What torch's framing of ``obj`` depends on, or None where it may depend on more."""
    if (type(obj) is not torch.Tensor or obj.device.type != "cpu"
            or obj.layout != torch.strided or obj.requires_grad or obj.is_quantized
            or obj.is_conj() or obj.is_neg() or torch._utils._get_obj_state(obj)
            or torch._utils.get_tensor_metadata(obj)
            or torch.serialization._serialization_tls.skip_data):
        return None
    nbytes = obj.untyped_storage().nbytes()
    if not nbytes:
        return None
    return (obj.dtype, tuple(obj.shape), obj.stride(), obj.storage_offset(), nbytes,
            torch.serialization._get_storage_alignment())


def _address(view: memoryview) -> int:
    return numpy.frombuffer(view, numpy.uint8).ctypes.data if view.nbytes else 0


class _Recorder:
    """Forwards torch's writes to the real stream and records them, the storage's bytes
    (told by their address and size) as :data:`STORAGE`, and torch's small writes between
    two of those or a flush as one piece (a replay of an item is then about 5 writes, not
    40: the same bytes, in the same order)."""

    def __init__(self, raw: Any, storage: torch.UntypedStorage) -> None:
        self.raw = raw
        self._at, self._nbytes = storage.data_ptr(), storage.nbytes()
        self.pieces: list[Piece] = []
        self.storage_writes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes == self._nbytes and _address(view) == self._at:
            self.pieces.append(STORAGE)
            self.storage_writes += 1
        elif self.pieces and self.pieces[-1]:  # after other bytes: one write when replayed
            self.pieces[-1] += bytes(view)
        else:
            self.pieces.append(bytes(view))
        return self.raw.write(data)

    def flush(self) -> None:
        self.pieces.append(FLUSH)
        self.raw.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def _replay(pieces: tuple[Piece, ...], storage: torch.UntypedStorage, stream: Any) -> None:
    nbytes = storage.nbytes()
    data = memoryview((ctypes.c_char * nbytes).from_address(storage.data_ptr())).cast("B")
    for piece in pieces:
        if piece is STORAGE:
            stream.write(data)
        elif piece:
            stream.write(piece)
        else:
            stream.flush()


#: layout -> (pieces, seen twice alike) ; None: a layout whose framing varied
_frames: dict[tuple, tuple[tuple[Piece, ...], bool] | None] = {}
_MISSING = object()


def replaying_save(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``torch.save`` (see the module)."""

    @functools.wraps(original)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        layout = (layout_of(obj) if not args and not kwargs and getattr(_allowed, "on", False)
                  else None)
        known = _frames.get(layout, _MISSING) if layout is not None else None
        if known is None:
            return original(obj, f, *args, **kwargs)
        storage = obj.untyped_storage()
        if known is not _MISSING and known[1]:
            return _replay(known[0], storage, f)
        recorder = _Recorder(f, storage)
        original(obj, recorder)
        pieces = tuple(recorder.pieces) if recorder.storage_writes == 1 else None
        if known is _MISSING:
            if len(_frames) < MAX_LAYOUTS:
                _frames[layout] = None if pieces is None else (pieces, False)
        else:
            _frames[layout] = (pieces, True) if pieces == known[0] else None
        return None

    return save
