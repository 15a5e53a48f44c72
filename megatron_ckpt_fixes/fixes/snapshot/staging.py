"""Staging buffers for asynchronous checkpoint snapshots, kept across saves.

A snapshot copies a CPU tensor into a buffer that nothing but the writer reads until the save
is finalized. The buffers are kept across saves, as pinned host buffers are for a GPU's
device-to-host copy: a steady-state save allocates nothing, it copies into the buffers of an
earlier save.

On the forked path a buffer is one untyped storage per tensor, of exactly the tensor's size:
``torch.save`` writes a tensor's whole storage, and the forked writer writes what the request
holds. A persistent worker's buffers are views of one shared segment instead
(:mod:`.arena`), which the request's preload step turns into storages of their own in the
worker: one segment pickles as one file descriptor, a storage per tensor as one each.

A set of buffers belongs to one save from :meth:`StagingPool.acquire` until
:meth:`StagingPool.release` (the save's first finalize step: its writer has returned on every
rank by then). A save scheduled while an earlier one is still being written gets another set:
the pool double-buffers instead of waiting, so scheduling never blocks on a writer, and the
extra memory is one set per save in flight. A set whose save never finalizes (its writer died)
is simply never returned and is freed with the request.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_ckpt_fixes.fixes.snapshot.arena import ArenaSet


@dataclass
class SnapshotStats:
    """What the snapshots of this process cost (the benchmark prints them)."""

    saves: int = 0  # snapshots taken
    tensors: int = 0  # tensors copied, all saves
    bytes_copied: int = 0  # all saves
    copy_s: float = 0.0  # time spent copying (the trainer's copy thread), all saves
    bytes_allocated: int = 0  # staging memory ever allocated (steady state: stops growing)
    last_bytes: int = 0  # bytes copied by the last snapshot
    last_copy_s: float = 0.0  # copy time of the last snapshot
    last_copy_cpu_s: float = 0.0  # CPU time of the last snapshot's copy (its thread)


@dataclass
class StagingSet:
    """The private buffers of one save for a forked writer, in the order that save's tensors
    were staged."""

    shared = False  # class attribute: a forked writer reads the parent's memory as forked
    buffers: list[torch.UntypedStorage] = field(default_factory=list)
    used: int = 0  # buffers handed out by the save that holds this set

    def buffer(self, nbytes: int) -> tuple[torch.UntypedStorage, int]:
        """The next buffer of exactly ``nbytes`` (reused when the earlier save's tensor at
        this position had the same size), and how many bytes had to be allocated for it."""
        at, self.used = self.used, self.used + 1
        if at < len(self.buffers) and self.buffers[at].nbytes() == nbytes:
            return self.buffers[at], 0
        storage = torch.UntypedStorage(nbytes)
        if at < len(self.buffers):
            self.buffers[at] = storage
        else:
            self.buffers.append(storage)
        return storage, nbytes

    def targets(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        """Empty tensors shaped like ``tensors`` in this set's buffers, and the bytes
        allocated."""
        out, allocated = [], 0
        for tensor in tensors:
            storage, new = self.buffer(tensor.numel() * tensor.element_size())
            out.append(torch.empty(0, dtype=tensor.dtype).set_(storage, 0, tensor.shape))
            allocated += new
        return out, allocated

    def nbytes(self) -> int:
        return sum(b.nbytes() for b in self.buffers)

    def trim(self) -> None:
        """Its save is over: drop the buffers that save did not need, start over."""
        del self.buffers[self.used:]
        self.used = 0


@dataclass(frozen=True)
class Copies:
    """A snapshot's copies, prepared on the trainer's thread before the copy runs.

    Where the bytes are the values (contiguous, neither conjugate nor negative views) the copy
    is a plain memory copy (``ctypes.memmove``, which releases the GIL while it copies):
    torch's ``copy_`` spreads a large copy over its intra-op threads, which wait on each other
    when the rank's cores are busy (the other ranks on the node, their writers). ``copy_``
    for the rest (strided, conjugate or negative views)."""

    targets: list[torch.Tensor]
    sources: list[torch.Tensor]
    #: ``(destination address, source address, bytes)`` of each plain copy
    plain: tuple[tuple[int, int, int], ...]
    #: positions of the copies ``copy_`` makes
    others: tuple[int, ...]

    @classmethod
    def of(cls, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> Copies:
        """``sources``' values into ``targets`` (same dtypes and shapes, contiguous)."""
        plain, others = [], []
        for i, source in enumerate(sources):
            if (source.layout == torch.strided and source.is_contiguous()
                    and not source.is_conj() and not source.is_neg()):
                nbytes = source.numel() * source.element_size()
                if nbytes:
                    plain.append((targets[i].data_ptr(), source.data_ptr(), nbytes))
            else:
                others.append(i)
        return cls(targets, sources, tuple(plain), tuple(others))

    def run(self) -> None:
        for destination, source, nbytes in self.plain:
            ctypes.memmove(destination, source, nbytes)
        for i in self.others:
            self.targets[i].copy_(self.sources[i].detach())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sources)


class StagingPool:
    """The sets of staging buffers of this process, free or held by a save in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[StagingSet] = []
        self.stats = SnapshotStats()

    def acquire(self, shared: bool) -> StagingSet | ArenaSet:
        """A set no writer reads: a free one, or a new one (for a persistent worker
        (``shared``) a shared segment, for a forked writer private buffers)."""
        with self._lock:
            for i, candidate in enumerate(self._free):
                if candidate.shared == shared:
                    return self._free.pop(i)
        return ArenaSet() if shared else StagingSet()

    def release(self, staging: StagingSet | ArenaSet) -> None:
        """The save holding ``staging`` was finalized: its writer no longer reads it."""
        with self._lock:
            staging.trim()
            self._free.append(staging)

    def targets(self, staging: StagingSet | ArenaSet,
                tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Empty tensors shaped like ``tensors`` in ``staging``'s buffers (allocation
        counted)."""
        out, allocated = staging.targets(tensors)
        with self._lock:
            self.stats.bytes_allocated += allocated
        return out

    def fill(self, copies: Copies) -> None:
        """Make ``copies``, timed (on the calling thread) and counted."""
        start, cpu = time.perf_counter(), time.thread_time()
        copies.run()
        copied = copies.nbytes()
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
        with self._lock:
            s = self.stats
            s.saves, s.tensors = s.saves + 1, s.tensors + len(copies.sources)
            s.bytes_copied, s.copy_s = s.bytes_copied + copied, s.copy_s + elapsed
            s.last_bytes, s.last_copy_s, s.last_copy_cpu_s = copied, elapsed, cpu

    def held_bytes(self) -> int:
        """Bytes of the free sets (the sets of saves in flight are held by their requests)."""
        with self._lock:
            return sum(s.nbytes() for s in self._free)


#: This process's staging buffers.
POOL = StagingPool()
