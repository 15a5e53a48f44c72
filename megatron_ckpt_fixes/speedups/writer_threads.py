"""Speed-up, on by default: a rank's bucket files written by threads of the process that
saves, not by forked writers.

megatron-core 0.16's ``FileSystemWriterAsync.write_preloaded_data_multiproc`` (the body of
every torch_dist save: in the trainer for a synchronous save, in the forked async writer, in
the persistent worker) forks one writer process per bucket file (``thread_count``, 2 by
default) on every save and waits for them. Each fork copies the page tables of a process
that holds the whole model, every page the parent or the child touches afterwards is copied
on write, and the writer's results cross a pipe: the forked writers spend about twice the CPU
of a plain write of the same bytes (docs/benchmarks.md). The writes release the GIL (the kernel's copy into the page
cache is most of a save's time; the ``checksums`` feature keeps torch's CRC-32 out of it), so
threads write the buckets in parallel as well as processes do; megatron-core 0.19 writes
them with threads itself (``write_preloaded_data_multithread``; this patch is not applied
there, detected from the writer class).

The patched ``write_preloaded_data_multiproc`` keeps upstream's contract: the same bucket
files, each written by upstream's own ``write_preloaded_data`` (with every patch of it: the
checksums, the writer failures' report), the last one on the calling thread, and one report
on the save's results queue: every bucket's write results, or the failure. A bucket writer's
failure is reported as upstream's forked writer reports it (the first failing bucket's
exception, which ``retrieve_write_results`` turns into megatron-core's write failure; every
failure is logged); anything that escapes a writer, or a writer that reports nothing, is a
failure too. A thread cannot die alone: no
writer is left for the save to wait for (``writer_failures`` watches forked writers where
they are still used, e.g. when this feature is not installed).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Declared, Layer
from megatron_ckpt_fixes.core.agreement import describe_error
from megatron_ckpt_fixes.core.entry_points import WRITE_BUCKETS
from megatron_ckpt_fixes.fixes.writer_failures.processes import writes_with_threads

logger = logging.getLogger(__name__)

_FILESYSTEM_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_WRITER = f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync"
_DISABLE_GC = "megatron.core.dist_checkpointing.strategies.async_utils:_disable_gc"


def _write_bucket(transform_list: list, index: int, bucket: Any, use_msc: bool) -> Any:
    """One bucket file through upstream's writer: its write results, or what failed."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    results: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()
    done.put(index)  # the writer takes it back when it is done (upstream's count queue)
    extra = {"use_msc": use_msc} if use_msc else {}
    try:
        FileSystemWriterAsync.write_preloaded_data(
            transform_list, local_proc_idx=index, write_bucket=bucket, results_queue=results,
            count_queue=done, use_fsync=True, **extra)
        return results.get_nowait()[1]
    except queue.Empty:
        return RuntimeError(f"the writer of {bucket[1]} reported nothing")
    except Exception as exc:  # noqa: BLE001 - reported as the save's failure
        return exc


def _report(write_buckets: list, outcomes: list) -> Any:
    """What upstream's collection puts on the results queue: ``{index: results}``, or the
    first failing writer's exception, as upstream reports it (each failure is logged)."""
    failures = [(bucket[1], outcome) for bucket, outcome in zip(write_buckets, outcomes)
                if isinstance(outcome, BaseException)]
    for file, exc in failures:
        logger.error("writing checkpoint file %s failed: %s", file, describe_error(exc))
    if not failures:
        return dict(enumerate(outcomes))
    first = failures[0][1]
    return first if isinstance(first, Exception) else RuntimeError(describe_error(first))


def _start(threads: list[threading.Thread]) -> int:
    """Start ``threads`` in order; how many started (the process may refuse a new thread:
    the rest are then written on the calling thread, one after the other)."""
    for started, thread in enumerate(threads):
        try:
            thread.start()
        except RuntimeError as exc:
            logger.warning("writing %d checkpoint file(s) on the saving thread: %s",
                           len(threads) - started, exc)
            return started
    return len(threads)


def threaded_bucket_writers(original: Callable[..., None]) -> Callable[..., None]:
    """Replace ``FileSystemWriterAsync.write_preloaded_data_multiproc`` (see the module)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import _disable_gc

    @functools.wraps(original)
    def write_preloaded_data_multiproc(transform_list: list, use_msc: bool, rank: int,
                                       write_buckets: list, global_results_queue: Any) -> None:
        outcomes: list = [None] * len(write_buckets)

        def write(index: int) -> None:
            outcomes[index] = _write_bucket(transform_list, index, write_buckets[index],
                                            use_msc)

        def write_on_thread(index: int) -> None:
            try:
                write(index)
            except BaseException as exc:  # noqa: BLE001 - a thread's end is reported, not lost
                outcomes[index] = exc

        threads = [threading.Thread(target=write_on_thread, args=(index,), daemon=True,
                                    name=f"mcf-bucket-writer-{index}")
                   for index in range(len(write_buckets) - 1)]
        with _disable_gc():  # as upstream's writers run: no collection while they write
            started = _start(threads)
            # on the calling thread: the last bucket (an interrupt, Ctrl-C, stays one) and
            # any whose thread could not start
            for index in range(started, len(write_buckets)):
                write(index)
            for thread in threads[:started]:
                thread.join()
        logger.debug("rank %d wrote %d checkpoint file(s) with threads", rank,
                     len(write_buckets))
        global_results_queue.put(_report(write_buckets, outcomes))

    return write_preloaded_data_multiproc


def _writer_problems() -> list[str]:
    import inspect

    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    problems = []
    multiproc = inspect.signature(FileSystemWriterAsync.write_preloaded_data_multiproc)
    if list(multiproc.parameters) != ["transform_list", "use_msc", "rank", "write_buckets",
                                      "global_results_queue"]:
        problems.append(f"FileSystemWriterAsync.write_preloaded_data_multiproc takes "
                        f"{list(multiproc.parameters)}, not the parameters it is replaced with")
    params = inspect.signature(FileSystemWriterAsync.write_preloaded_data).parameters
    problems += [f"FileSystemWriterAsync.write_preloaded_data has no parameter {name!r}"
                 for name in ("local_proc_idx", "write_bucket", "results_queue", "count_queue",
                              "use_fsync", "kwargs") if name not in params]
    return problems


PATCHES: tuple[Declared, ...] = (
    Layer(
        name="writer_threads.buckets",
        entry=WRITE_BUCKETS,
        build=threaded_bucket_writers,
        reads=(_DISABLE_GC, f"{_WRITER}.write_preloaded_data"),
        not_needed=writes_with_threads,
        probes=(_writer_problems,),
        why="a save writes its bucket files with threads instead of forking a writer "
            "process per file on every save",
    ),
)
