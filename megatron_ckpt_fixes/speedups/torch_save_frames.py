"""Speed-up, on by default: torch.save's framing of a checksummed tensor item, recorded per
layout and replayed.

torch DCP's ``_write_item`` serializes every tensor item with ``torch.save``: a pickle of the
tensor's layout and a zip archive of five records around the storage's bytes, about 40
writes, built in Python for every item. For a plain CPU tensor, with torch's CRC-32 off
(inside the records the ``checksums`` feature vouches for), what those writes hold depends
only on the tensor's layout (dtype, shape, strides, storage offset and size) and torch's
settings, never on its values.

So inside a checksummed record the patched ``torch.save`` keeps what torch wrote for a
layout: the first save of a layout is torch's own, recorded; the second is torch's own
again, and the layout is replayed from then on only if its framing was the same both times
(so a torch whose framing changes per call is never replayed). A replay writes the recorded
pieces and the storage's bytes, in torch's order, through the same stream: byte for byte what
``torch.save`` writes, and the checksum is taken from those writes as before.

Anything else is torch's own ``torch.save``: another thread, CRC-32 on, extra arguments, a
subclass or a tensor with Python state, gradients, a quantized, sparse, conjugate or
negative-bit tensor, an empty storage; and any failure of this module's own logic before a
byte is written. What a layout is made of is read through public interfaces only (the
tensor's own methods, ``__getstate__`` as torch's pickling asks it, and
``torch.utils.serialization.config``). One difference is accepted: under
``torch.serialization.skip_data`` (whose state torch keeps private) a replayed item carries
its bytes where torch would leave the space empty; megatron-core's writer never runs under
it. ``MEGATRON_CKPT_FIXES=fixes`` leaves it out; docs/benchmarks.md has what it saves.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy
import torch

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.fixes.checksums.writer import crc32_kept, in_checksummed_record

#: Layouts kept at most (a model has far fewer distinct ones); beyond it, torch's own save.
MAX_LAYOUTS = 1 << 14

#: One of torch's writes: its bytes, :data:`STORAGE` (the storage's bytes) or :data:`FLUSH`.
Piece = Any
STORAGE = None
FLUSH = b""

logger = logging.getLogger(__name__)

#: What the layout check reads besides the tensor (declared to ``install()``).
READS = ("torch.utils.serialization.config:save.storage_alignment",)


def layout_of(obj: Any) -> tuple | None:
    """What torch's framing of ``obj`` depends on, or None where it may depend on more: the
    pickle of a plain tensor holds its layout, plus its Python state (``__getstate__``, as
    torch's ``_reduce_ex_internal`` asks it) and its conjugate and negative bits, which the
    check excludes; the zip records' alignment is torch's public setting."""
    from torch.utils.serialization import config

    if (type(obj) is not torch.Tensor or obj.device.type != "cpu"
            or obj.layout != torch.strided or obj.requires_grad or obj.is_quantized
            or obj.is_conj() or obj.is_neg() or obj.__getstate__()):
        return None
    nbytes = obj.untyped_storage().nbytes()
    if not nbytes:
        return None
    return (obj.dtype, tuple(obj.shape), obj.stride(), obj.storage_offset(), nbytes,
            config.save.storage_alignment)


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


def _known_layout(obj: Any) -> tuple[tuple | None, Any]:
    """``obj``'s layout and what is recorded for it (``_MISSING``: nothing yet; None: torch's
    own save), or ``(None, None)`` wherever torch's own save must run, this function's own
    failure included (logged once)."""
    try:
        layout = layout_of(obj)
    except Exception as exc:  # noqa: BLE001 - a speed-up falls back to torch's own save
        if not _failed:
            _failed.append(exc)
            logger.warning("torch_save_frames falls back to torch.save: %s: %s",
                           type(exc).__name__, exc)
        return None, None
    return layout, (_frames.get(layout, _MISSING) if layout is not None else None)


_failed: list[Exception] = []


def replaying_save(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``torch.save`` (see the module)."""

    @functools.wraps(original)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if args or kwargs or not in_checksummed_record():
            return original(obj, f, *args, **kwargs)
        layout, known = _known_layout(obj)
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


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="torch_save_frames.save",
        target="torch",
        attr="save",
        build=replaying_save,
        reads=READS,
        not_needed=crc32_kept,
        optional=True,  # a speed-up: where it cannot be applied, torch.save is torch's
        why="inside the records the checksums feature writes, torch.save's framing of a "
            "tensor is replayed from an earlier save of the same layout (the same bytes)",
    ),
)
