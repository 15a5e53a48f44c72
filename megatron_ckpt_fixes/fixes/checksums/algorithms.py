"""The checksum algorithms a record may name, and how a byte range of a file is checked.

Saves record :data:`DEFAULT` (``xxh3_64``, from the ``xxhash`` package): of the well-kept
candidates it is the fastest (``python benchmarks/bench_hashes.py`` compares it with CRC-32,
CRC-32C and SHA-256), it releases the GIL on large buffers (other writer threads go on
meanwhile), and its 64 bits make an undetected random corruption of an item a 2**-64 event. Records written
before it (``crc32``, zlib's CRC-32) keep verifying: every record names its algorithm.

An algorithm is a streaming hasher (``update(bytes)``, ``value() -> int``) and a name; the
record stores values as hexadecimal strings, so 64-bit values survive any JSON reader.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Protocol

import xxhash

#: Bytes read at a time when checking a range, into one reused buffer: a multi-GB item
#: never sits in memory whole, and no new bytes object is allocated per read.
READ_CHUNK = 16 << 20


class Hasher(Protocol):
    def update(self, data: bytes | memoryview) -> None: ...

    def value(self) -> int: ...


class _Crc32:
    """zlib's CRC-32, the algorithm of records written before ``xxh3_64``."""

    __slots__ = ("crc",)

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: bytes | memoryview) -> None:
        self.crc = zlib.crc32(data, self.crc)

    def value(self) -> int:
        return self.crc


class _Xxh3:
    """xxHash's XXH3, 64 bits (releases the GIL while it hashes)."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = xxhash.xxh3_64()

    def update(self, data: bytes | memoryview) -> None:
        self.state.update(data)

    def value(self) -> int:
        return self.state.intdigest()


@dataclass(frozen=True)
class Algorithm:
    name: str
    new: Callable[[], Hasher]
    digits: int  # hexadecimal digits of a value

    def format(self, value: int) -> str:
        return f"{value:0{self.digits}x}"


ALGORITHMS: dict[str, Algorithm] = {
    "xxh3_64": Algorithm("xxh3_64", _Xxh3, 16),
    "crc32": Algorithm("crc32", _Crc32, 8),
}
#: What saves record.
DEFAULT = ALGORITHMS["xxh3_64"]


def algorithm(name: str) -> Algorithm:
    """The algorithm called ``name``; ValueError names the known ones."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {name!r} (known: "
                         f"{', '.join(ALGORITHMS)})") from None


def checksum_of_range(path: str, offset: int, length: int, algo: Algorithm,
                      buffer: bytearray | None = None) -> tuple[int, int]:
    """``(checksum, bytes read)`` of ``length`` bytes at ``offset`` (fewer if the file is
    short), read into ``buffer`` (reused across calls by a caller checking many ranges)."""
    view = memoryview(buffer if buffer is not None else bytearray(min(length, READ_CHUNK)))
    hasher, done = algo.new(), 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while done < length:
            n = f.readinto(view[:min(len(view), length - done)])
            if not n:
                break
            hasher.update(view[:n])
            done += n
    return hasher.value(), done


def read_buffer(length: int) -> bytearray:
    """A buffer for :func:`checksum_of_range` calls on ranges of up to ``length`` bytes."""
    return bytearray(max(1, min(length, READ_CHUNK)))

