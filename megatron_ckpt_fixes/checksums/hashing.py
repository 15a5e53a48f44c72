"""Checksums of the bytes a writer writes, hashed beside the I/O instead of before it.

torch's ``_write_item`` serializes a tensor with ``torch.save`` in about 40 small writes (zip
headers from torch's temporary buffers) and one large write straight from the tensor's
storage. A tap (:class:`ItemTap`) stands between torch and the file and forwards every write
unchanged. Where a writer has opened a :class:`Batch` (megatron-core's per-file writer, see
:mod:`.writer`), the tap keeps the item's pieces (the small ones copied, the large ones by
reference, but only when they lie inside memory the item itself owns: the tensor's storage,
the bytes of a ``BytesIO`` item, kept alive with the item) and a helper thread hashes them
while the writer writes the next items and fsyncs the file. The hash (xxh3 releases the GIL)
then overlaps the writer's I/O; the batch puts the checksums into the write results before
they leave the writer. A piece that lies elsewhere is copied: torch's buffers may be reused
as soon as ``write`` returns.

Without an open batch (``_write_item`` called from anywhere else) the tap hashes each piece
inline as it passes, with the same result.

The checksum is of the bytes in the file because the memory it is taken from is the buffer the
writer wrote, and that buffer does not change until the writer returns: on an asynchronous
save it is the snapshot's staging copy (:mod:`megatron_ckpt_fixes.snapshot`; on the forked
path, private memory the fork froze), a GPU tensor's host copy, or, on a synchronous save, the
trainer's tensor while the trainer waits for the writer. Hashed from a tensor the trainer
still changes (an asynchronous save without the snapshot), a checksum would certify a save
torn before the write and fail one changed between the write and the hash; the snapshot's
tests check both (tests/functional/test_async_snapshot.py).
"""

from __future__ import annotations

import io
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from .algorithms import DEFAULT, Hasher

logger = logging.getLogger(__name__)

#: Writes at least this large are kept by reference (when inside the item's own memory);
#: smaller ones are copied (zip headers: tens of bytes each).
LARGE_PIECE = 64 << 10
#: Helper threads per process: megatron-core writes a rank's files with two writers by
#: default (threads or forked processes), each keeping one helper busy at most.
HELPERS = 2

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_local = threading.local()


def _executor() -> ThreadPoolExecutor:
    """This process's helper threads, started on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HELPERS, thread_name_prefix="mcf-checksum")
        return _pool


def _forget_parents_pool() -> None:
    """A forked writer process has none of its parent's threads: it starts its own pool
    (and a fresh lock, which a parent's thread may have held at the fork)."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_parents_pool)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def owned_memory(data: Any) -> tuple[int, int] | None:
    """``(start, end)`` addresses of the memory that the item ``data`` owns and torch writes
    from: a CPU tensor's whole storage (``torch.save`` writes the storage), a BytesIO's
    buffer. None when unknown."""
    if isinstance(data, torch.Tensor) and data.device.type == "cpu":
        storage = data.untyped_storage()
        start = storage.data_ptr()
        return start, start + storage.nbytes()
    if isinstance(data, io.BytesIO):
        with data.getbuffer() as view:
            if view.nbytes:
                start = _address(view)
                return start, start + view.nbytes
    return None


def hash_pieces(pieces: list[Any], owner: Any = None) -> int:
    """The checksum of the concatenated ``pieces``. ``owner`` (unused) keeps the item whose
    memory some pieces point into alive until the hash is done."""
    hasher: Hasher = DEFAULT.new()
    for piece in pieces:
        hasher.update(piece)
    del owner
    return hasher.value()


class ItemTap:
    """Forwards writes to the real stream; hashes (inline) or keeps (deferred) their bytes."""

    __slots__ = ("raw", "count", "hasher", "pieces", "owned")

    def __init__(self, raw: Any, owned: tuple[int, int] | None, deferred: bool) -> None:
        self.raw = raw
        self.count = 0
        self.owned = owned
        self.hasher: Hasher | None = None if deferred else DEFAULT.new()
        self.pieces: list[Any] = []

    def _keep(self, data: Any) -> None:
        if isinstance(data, bytes):
            self.pieces.append(data)
            return
        view = memoryview(data)
        if view.nbytes >= LARGE_PIECE and self.owned is not None and view.c_contiguous:
            start = _address(view)
            if self.owned[0] <= start and start + view.nbytes <= self.owned[1]:
                self.pieces.append(view)
                return
        self.pieces.append(view.tobytes())

    def write(self, data: Any) -> int:
        if self.hasher is not None:
            self.hasher.update(data)
        else:
            self._keep(data)
        written = self.raw.write(data)
        self.count += written
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class Batch:
    """The checksums one writer call (one file) still has to compute; ``resolve`` puts each
    into its write result's instance dict under ``attr``."""

    def __init__(self, attr: str) -> None:
        self.attr = attr
        self.pending: list[tuple[Any, Future]] = []

    def submit(self, result: Any, pieces: list[Any], owner: Any) -> None:
        self.pending.append((result, _executor().submit(hash_pieces, pieces, owner)))

    def resolve(self) -> None:
        """Wait for every pending checksum (also on the error path: no helper may still read
        an item's memory after the writer returns) and record it; a failed one is None."""
        for result, future in self.pending:
            try:
                checksum = (DEFAULT.name, future.result())
            except Exception:  # noqa: BLE001 - the record counts it as missing, and says so
                logger.exception("hashing a saved item failed; it will have no checksum")
                checksum = None
            object.__setattr__(result, self.attr, checksum)  # frozen dataclass
        self.pending.clear()


def current_batch() -> Batch | None:
    """The batch this thread's writer has open, if any."""
    return getattr(_local, "batch", None)


@contextmanager
def open_batch(attr: str) -> Iterator[Batch]:
    """Defer the checksums of this thread's writes until the block ends or ``resolve``."""
    batch, outer = Batch(attr), current_batch()
    _local.batch = batch
    try:
        yield batch
    finally:
        _local.batch = outer
        batch.resolve()
