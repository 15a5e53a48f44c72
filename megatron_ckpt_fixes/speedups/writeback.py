"""Speed-up, on by default: the disk writes a checkpoint file while the writer serializes the
rest of it.

megatron-core's torch_dist writer puts every item of a file into the page cache and then
fsyncs the file (``use_fsync``). On Linux nothing reaches the disk before that fsync unless
the dirty pages pass the kernel's background threshold (10 % of memory by default, more
than one save of a rank on most machines): the writer keeps the CPU busy while the disk is
idle, then the disk writes everything while the CPU is idle. Raw ``write`` + ``fsync`` of
the same bytes has the same shape, so it is not the physical limit either.

This feature asks the kernel to start writing each large item as soon as the writer has
put it into the page cache (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: start write-out,
do not wait for it), so the disk works while the writer serializes the next items and the
final fsync (upstream's, unchanged) has little left to wait for. Durability is exactly
upstream's: the hint never replaces the fsync, and a file whose stream has no descriptor
(multi-storage client), a platform without the call, or a call that fails are written as
before. ``python benchmarks/bench_realistic_save.py`` prints the raw write+fsync baseline
both ways. Unnecessary once megatron-core starts each file's write-back while it writes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import inspect
import io
import logging
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Declared, Layer
from megatron_ckpt_fixes.core.entry_points import WRITE_ITEM

logger = logging.getLogger(__name__)

_FILESYSTEM_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_WRITER = f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync"

#: Items of at least this many bytes are handed to the disk as soon as they are written;
#: smaller ones are left to the final fsync (a call per small item would cost more than
#: the early start saves).
MIN_BYTES = 1 << 20
SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start write-out of the range's dirty pages


@functools.lru_cache(maxsize=None)
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    name = ctypes.util.find_library("c")
    try:
        call = getattr(ctypes.CDLL(name, use_errno=True), "sync_file_range")
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def start_writeback(stream: Any, start: int, end: int) -> bool:
    """Ask the kernel to start writing ``stream``'s bytes ``[start, end)`` to disk without
    waiting; False (nothing done) when the stream has no descriptor or the call fails."""
    call = _sync_file_range()
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return False
    if call is None:
        return False
    stream.flush()  # the item's last bytes may still sit in the stream's buffer
    if call(fd, start, end - start, SYNC_FILE_RANGE_WRITE) != 0:
        logger.debug("sync_file_range failed (errno %d): left to the fsync", ctypes.get_errno())
        return False
    return True


def _span(result: Any) -> tuple[int, int] | None:
    """The file range ``[start, end)`` an item was written to, as its write result names it
    (torch's ``_StorageInfo``: the offset and length ``.metadata`` records), or None. Read
    from the result, not from the stream: two ``tell()`` calls per item are two syscalls,
    each a release of the GIL that the writer's other thread holds on to."""
    info = getattr(result, "storage_data", None)
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if isinstance(offset, int) and isinstance(length, int):
        return offset, offset + length
    return None


def writing_back_write_item(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the writer's ``_write_item``: once a large item is in the file, its bytes start
    going to disk."""
    stream_at = list(inspect.signature(original).parameters).index("stream")

    @functools.wraps(original)
    def _write_item(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        span = _span(result)
        if span is not None and span[1] - span[0] >= MIN_BYTES:
            stream = args[stream_at] if stream_at < len(args) else kwargs["stream"]
            start_writeback(stream, *span)
        return result

    return _write_item


def _write_item_problems() -> list[str]:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if "stream" in inspect.signature(filesystem_async._write_item).parameters:
        return []
    return ["torch's _write_item has no parameter 'stream'"]


def _platform_problems() -> list[str]:
    return [] if _sync_file_range() is not None else ["this platform has no sync_file_range"]


PATCHES: tuple[Declared, ...] = (
    Layer(
        name="writeback.write_item",
        entry=WRITE_ITEM,
        build=writing_back_write_item,
        reads=(f"{_WRITER}.write_preloaded_data",),
        probes=(_write_item_problems, _platform_problems),
        optional=True,  # a speed hint: where it cannot be given, the save is upstream's
        why="each large item of a checkpoint file starts going to disk as soon as it is "
            "written, while the writer serializes the next ones (upstream's fsync unchanged)",
    ),
)
