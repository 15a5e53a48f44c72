"""Speed-up, on by default: a save's write results stay in memory when its writers run in the
process that saves.

megatron-core's ``FileSystemWriterAsync.prepare_write_data`` hands every save the queue of
``get_write_results_queue`` (0.16: ``_get_write_results_queue``): a queue served by a
``multiprocessing`` Manager, a separate process, so that a forked writer or the persistent
async worker can report to the trainer. The writer puts one report (every bucket's write
results: one ``WriteResult`` per item), the finalize's ``retrieve_write_results`` takes it
back: two round trips through that process, each pickling every result, on every save, also
when the writers are threads of the saving process itself (every synchronous save on 0.19+;
0.16 with ``writer_threads``), where nothing has to cross a process: milliseconds of each
synchronous save's critical path, and the Manager's CPU time beside it (docs/benchmarks.md).

The save's queue is wrapped (:class:`InProcessFirst`): a report put by the process that
prepared the save stays in an in-memory queue, which ``get_nowait``/``get`` read first; a
report from any other process goes to the Manager as before. Another process holds either a
fork's copy of the wrapper (it sees its own process id differ and puts to the Manager) or
the Manager's proxy itself: pickling the wrapper (the persistent worker receives the save
through a multiprocessing queue) gives the proxy. Nothing else changes: the same report,
the same checks in ``retrieve_write_results``, the same errors; a failure to wrap leaves
upstream's queue. Unnecessary once megatron-core hands writers in the saving process a plain
queue.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.core.rehearsal import results_read_by_the_writer, writer_save_call

logger = logging.getLogger(__name__)

_WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync"


class InProcessFirst:
    """megatron-core's write-results queue (a Manager proxy) as one save uses it: reports of
    this process in memory, of any other process through the proxy (see the module)."""

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy
        self.owner = os.getpid()
        self.local: queue.Queue = queue.Queue()

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        if os.getpid() == self.owner:
            self.local.put(item)
        else:  # a forked writer's copy of this wrapper
            self.proxy.put(item, *args, **kwargs)

    def get_nowait(self) -> Any:
        try:
            return self.local.get_nowait()
        except queue.Empty:
            return self.proxy.get_nowait()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        try:
            return self.local.get_nowait()
        except queue.Empty:
            return self.proxy.get(block, timeout)

    def __reduce__(self) -> Any:
        """Pickled (to another process), the wrapper is the Manager's proxy."""
        return self.proxy.__reduce__()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["proxy"], name)


def in_process_results(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``FileSystemWriterAsync.prepare_write_data``: the save's results queue wrapped."""

    @functools.wraps(original)
    def prepare_write_data(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.results_queue is not None and not isinstance(self.results_queue,
                                                             InProcessFirst):
            self.results_queue = InProcessFirst(self.results_queue)

    return prepare_write_data


def _writer_problems() -> list[str]:
    """The writer hands its ``results_queue`` to the save function and reads its reports
    from that attribute (watched on a small save), so a wrapper put there sees both."""
    results: queue.Queue = queue.Queue()
    problems = []
    if not any(arg is results for arg in writer_save_call(results)[2]):
        problems.append("FileSystemWriterAsync.get_save_function_and_args no longer hands the "
                        "writer's results_queue to the save function")
    if not results_read_by_the_writer():
        problems.append("FileSystemWriterAsync.retrieve_write_results no longer reads the "
                        "writer's results_queue")
    return problems


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="write_results.in_process",
        target=_WRITER,
        attr="prepare_write_data",
        build=in_process_results,
        probes=(_writer_problems,),
        why="write results of writers in the saving process stay in memory instead of a "
            "round trip through megatron-core's Manager process",
    ),
)
