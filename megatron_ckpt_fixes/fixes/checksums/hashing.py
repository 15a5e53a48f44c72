"""Checksums of the bytes a writer writes, taken as they pass, a cache-sized piece at a time.

torch's ``_write_item`` serializes a tensor with ``torch.save`` in about 40 small writes (zip
headers from torch's temporary buffers) and one large write straight from the tensor's
storage. A tap (:class:`ItemTap`) stands between torch and the file and forwards every write
unchanged, hashing it on the way; a large write goes to the file in pieces of :data:`CHUNK`
bytes, each hashed right after it is written, from the cache the file's copy just filled:
the tensor's bytes come from memory once, as for a plain write.

Hashing on the writer's thread costs less than hashing beside it: helper threads would read
every tensor from memory a second time and pass the GIL back and forth. Each piece is hashed
after its write, from the cache the copy just filled, and is small enough that the piece and
the page-cache copy the kernel made of it stay in a core's L2 cache (docs/benchmarks.md).

The checksum is of the bytes in the file because it is taken from the buffer the writer
hands to the file, at that moment: on an asynchronous save the snapshot's staging copy
(:mod:`megatron_ckpt_fixes.fixes.snapshot`; on the forked path, private memory the fork froze), a
GPU tensor's host copy, or, on a synchronous save, the trainer's tensor while the trainer
waits for the writer.
"""

from __future__ import annotations

from typing import Any

from megatron_ckpt_fixes.fixes.checksums.algorithms import DEFAULT, Hasher

#: Bytes written then hashed at a time: the piece and its page-cache copy well inside a
#: core's L2 cache.
CHUNK = 256 << 10


def checksum_of(data: Any) -> int:
    """The checksum of one buffer."""
    hasher: Hasher = DEFAULT.new()
    hasher.update(data)
    return hasher.value()


class ItemTap:
    """Forwards writes to the real stream, hashing each (a large one :data:`CHUNK` bytes at
    a time, each piece hashed right after it is written)."""

    __slots__ = ("raw", "count", "hasher")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.count = 0
        self.hasher: Hasher = DEFAULT.new()

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes <= CHUNK or not view.c_contiguous:
            written = self.raw.write(view)
            self.hasher.update(view)
        else:
            view, written = view.cast("B"), 0
            for start in range(0, view.nbytes, CHUNK):
                piece = view[start:start + CHUNK]
                written += self.raw.write(piece)
                self.hasher.update(piece)
        self.count += written
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)
