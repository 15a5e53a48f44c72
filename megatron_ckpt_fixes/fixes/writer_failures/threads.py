"""A writer thread's exception fails the save with its cause, instead of getting lost.

megatron-core (0.19 on) writes a rank's bucket files with threads
(``FileSystemWriterAsync.write_preloaded_data_multithread``: one thread per bucket but the
last, which the calling thread writes; Megatron-LM's ``--dist-ckpt-workers N``). Each
bucket's writer (``write_preloaded_data``) catches its own failure and reports
``(index, exception)``; the collecting code then asserts that each report is a list, so a
thread's failure (ENOSPC, EIO, any OSError) raises ``AssertionError: <class 'OSError'>``
out of the writer instead of reporting it: a synchronous save raises on that rank alone
while the others wait for it in the next barrier; an asynchronous one reports
``results_queue should not be empty``; the persistent worker dies (and upstream's trainer
waits for it forever). A failure of the calling thread's own bucket is reported, but as
``An error is caught while starting worker 1, error: <class 'OSError'>``: the class
without the error. And a writer whose exception escapes its own ``try`` never calls
``task_done()``: the wait for the threads never ends.

- Each bucket writer (every release) reports whatever escapes it, exactly once, where
  upstream reports a writer's failure (its results queue and ``task_done()``), and notes
  the cause of its file;
- the threaded collection (where upstream has it) reports any failure it raises through
  the save's results queue, with the causes of its files, where upstream reports a
  writer's failure; so does a failure it reports with the class only.

torch DCP's ``FileSystemWriter(thread_count=N)`` (plain DCP users) runs
``_write_files_from_queue`` on N-1 threads besides the calling one: a thread's exception
goes to ``threading.excepthook``, its files' results are simply missing, and the save
writes ``.metadata`` and reports success (pytorch issue 191391). Each thread's failure is
kept as a result, and ``_write_data`` raises it after joining the threads: DCP reports it
as the rank's write failure (``CheckpointException`` on every rank). Not applied where
torch already raises it (asked of torch's own ``_write_data``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.core.rehearsal import calls_during, save_tiny_checkpoint
from megatron_ckpt_fixes.core.agreement import describe_error
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError

logger = logging.getLogger(__name__)

_FILESYSTEM_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_WRITER = f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync"
_DCP = "torch.distributed.checkpoint.filesystem"

#: The cause of each bucket file whose writer failed, until its collection reads it.
_causes: dict[str, str] = {}
_causes_lock = threading.Lock()


class WriterThreadError(MegatronCkptFixesError, RuntimeError):
    """One or more writer threads of a save failed (each cause named)."""


class _Once:
    """A queue as a writer sees it: remembers whether the writer reported (``put``, after
    ``before_put`` saw the report) and signalled its end (``task_done``)."""

    def __init__(self, queue: Any, before_put: Callable[[Any], None] = lambda _item: None
                 ) -> None:
        self.queue, self.before_put = queue, before_put
        self.put_done = self.task_done_done = False

    def put(self, item: Any, *args: Any, **kwargs: Any) -> Any:
        self.before_put(item)
        result = self.queue.put(item, *args, **kwargs)
        self.put_done = True
        return result

    def task_done(self) -> None:
        self.queue.task_done()
        self.task_done_done = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


def reporting_bucket_writer(original: Callable[..., Any]) -> staticmethod:
    """Wrap ``FileSystemWriterAsync.write_preloaded_data`` (one bucket file)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def write_preloaded_data(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        path, file = arguments["write_bucket"][:2]

        def note(output: Any) -> None:
            """Keep a failure's cause for the collection; before the report leaves (the
            collection may read it as soon as the writer signals its end)."""
            if output is not None and isinstance(output[1], BaseException):
                with _causes_lock:
                    _causes[path] = f"writing {file}: {describe_error(output[1])}"

        results = arguments["results_queue"] = _Once(arguments["results_queue"], note) \
            if arguments.get("results_queue") is not None else None
        count = arguments["count_queue"] = _Once(arguments["count_queue"]) \
            if arguments.get("count_queue") is not None else None
        try:
            output = original(*bound.args, **bound.kwargs)
        except Exception as exc:  # noqa: BLE001 - escaped upstream's own try: report it
            output = (arguments["local_proc_idx"], exc)
            if results is not None and not results.put_done:
                results.put(output)
            if count is not None and not count.task_done_done:
                count.get()
                count.task_done()
        if results is None:  # the calling thread's own bucket: returned, not put
            note(output)
        return output

    return staticmethod(write_preloaded_data)


class _ReportingQueue:
    """The save's results queue, as the threaded collection sees it: a failure it puts
    names its files' causes."""

    def __init__(self, queue: Any, causes: Callable[[], list[str]]) -> None:
        self.queue, self.causes, self.put_done = queue, causes, False

    def put(self, item: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(item, Exception) and self.causes():
            item = RuntimeError("; ".join(self.causes()))
        self.put_done = True
        return self.queue.put(item, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


@contextmanager
def _bucket_causes(buckets: list) -> Iterator[Callable[[], list[str]]]:
    files = [bucket[0] for bucket in buckets]

    def causes() -> list[str]:
        with _causes_lock:
            return [_causes[f] for f in files if f in _causes]

    try:
        yield causes
    finally:
        with _causes_lock:
            for file in files:
                _causes.pop(file, None)


def reporting_thread_collection(original: Callable[..., None]) -> staticmethod:
    """Wrap ``FileSystemWriterAsync.write_preloaded_data_multithread``."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def write_preloaded_data_multithread(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        with _bucket_causes(bound.arguments["write_buckets"]) as causes:
            queue = bound.arguments["global_results_queue"] = _ReportingQueue(
                bound.arguments["global_results_queue"], causes)
            try:
                return original(*bound.args, **bound.kwargs)
            except Exception as exc:  # noqa: BLE001 - reported where upstream reports failures
                if queue.put_done:
                    raise
                logger.error("a checkpoint writer failed: %s", describe_error(exc))
                queue.put(RuntimeError(describe_error(exc)))
                return None

    return staticmethod(write_preloaded_data_multithread)


# -- torch DCP's FileSystemWriter -------------------------------------------------------------

class _ThreadFailure:
    """A writer thread's exception, kept among the write results it would have produced."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def keeping_thread_failures(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap torch's ``_write_files_from_queue`` (run by every writer thread)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _write_files_from_queue(*args: Any, **kwargs: Any) -> None:
        try:
            return original(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - raised by _write_data after the join
            signature.bind(*args, **kwargs).arguments["result_queue"].put([_ThreadFailure(exc)])
            return None

    return _write_files_from_queue


def raising_thread_failures(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``_FileSystemWriter._write_data``: a writer thread's failure is the write's."""

    @functools.wraps(original)
    def _write_data(self: Any, planner: Any, file_queue: Any) -> Any:
        future = original(self, planner, file_queue)
        failures = [r.error for r in future.value() if isinstance(r, _ThreadFailure)]
        if failures:
            raise WriterThreadError("; ".join(map(describe_error, failures))) from failures[0]
        return future

    return _write_data


class _ThreadFailingFileSystem:
    """For the probe: writing fails in any thread but the probe's; the probe's own write
    waits until another thread took a file, so a thread always fails."""

    def __init__(self) -> None:
        self.caller = threading.get_ident()
        self.other_started = threading.Event()

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if threading.get_ident() != self.caller:
            self.other_started.set()
            raise OSError(f"probe: writing {path} fails in a writer thread")
        self.other_started.wait(5)
        yield open(os.devnull, mode)

    def concat_path(self, path: Any, suffix: str) -> str:
        return os.path.join(path, suffix)


def _torch_raises_thread_failures() -> str | None:
    """Ask torch's own ``_write_data`` (2 threads, a file each) whether a failure in the
    writer thread reaches the caller."""
    import queue
    import types

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    current = FileSystemWriter._write_data
    upstream = getattr(current, "__wrapped__", current)
    hook, seen = threading.excepthook, []
    threading.excepthook = seen.append  # the thread's exception, not printed
    try:
        with tempfile.TemporaryDirectory() as tmp:
            writer = FileSystemWriter(tmp, thread_count=2, sync_files=False)
            writer.fs = _ThreadFailingFileSystem()
            files: queue.Queue = queue.Queue()
            for n in range(2):
                files.put((os.path.join(tmp, f"f{n}"), f"f{n}", []))
            upstream(writer, types.SimpleNamespace(resolve_data=lambda item: None), files)
    except OSError:
        return "torch's FileSystemWriter raises a writer thread's failure"
    finally:
        threading.excepthook = hook
    if not seen:
        raise RuntimeError("the probe's writer thread did not fail: cannot tell")
    return None


def _no_thread_collection() -> str | None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    if hasattr(FileSystemWriterAsync, "write_preloaded_data_multiproc") and \
            not hasattr(FileSystemWriterAsync, "write_preloaded_data_multithread"):
        return "megatron-core's file writer writes with processes (watched by " \
               "writer_failures.processes), not threads"
    return None


def _bucket_writer_problems() -> list[str]:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    params = inspect.signature(FileSystemWriterAsync.write_preloaded_data).parameters
    return [f"FileSystemWriterAsync.write_preloaded_data has no parameter {name!r}"
            for name in ("local_proc_idx", "write_bucket", "results_queue", "count_queue")
            if name not in params]


def _collection_problems() -> list[str]:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    params = inspect.signature(FileSystemWriterAsync.write_preloaded_data_multithread).parameters
    return [f"FileSystemWriterAsync.write_preloaded_data_multithread has no parameter {name!r}"
            for name in ("write_buckets", "global_results_queue") if name not in params]


def _dcp_problems() -> list[str]:
    from torch.distributed.checkpoint import filesystem

    problems = []
    if "result_queue" not in inspect.signature(filesystem._write_files_from_queue).parameters:
        problems.append("torch's _write_files_from_queue has no parameter 'result_queue'")
    elif not calls_during(filesystem, "_write_files_from_queue", save_tiny_checkpoint):
        problems.append("torch's FileSystemWriter did not write through _write_files_from_queue "
                        "when it saved a checkpoint")
    return problems


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="writer_failures.threads.bucket_writer",
        target=_WRITER,
        attr="write_preloaded_data",
        build=reporting_bucket_writer,
        probes=(_bucket_writer_problems,),
        why="a bucket writer's failure is reported exactly once, with its cause, even when it "
            "escapes the writer (no wait for a task_done that never comes)",
    ),
    Patch(
        name="writer_failures.threads.collection",
        target=_WRITER,
        attr="write_preloaded_data_multithread",
        build=reporting_thread_collection,
        not_needed=_no_thread_collection,
        probes=(_collection_problems,),
        why="a writer thread's failure (ENOSPC, EIO) is the save's reported failure with its "
            "cause, not an AssertionError on one rank while the others wait",
    ),
    Patch(
        name="writer_failures.threads.dcp_thread",
        target=_DCP,
        attr="_write_files_from_queue",
        build=keeping_thread_failures,
        not_needed=_torch_raises_thread_failures,
        probes=(_dcp_problems,),
        why="torch DCP: a writer thread's exception is kept, not lost to threading.excepthook",
    ),
    Patch(
        name="writer_failures.threads.dcp_write",
        target=f"{_DCP}:_FileSystemWriter",
        attr="_write_data",
        build=raising_thread_failures,
        not_needed=_torch_raises_thread_failures,
        probes=(_dcp_problems,),
        why="torch DCP: a save whose writer thread failed fails, instead of writing .metadata "
            "and reporting success (pytorch issue 191391)",
    ),
)
