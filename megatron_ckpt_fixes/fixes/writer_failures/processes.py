"""A forked bucket writer that dies fails the save, instead of leaving it waiting forever.

megatron-core 0.16's ``FileSystemWriterAsync.write_preloaded_data_multiproc`` (the body of
every torch_dist save: in the trainer for a synchronous save, in the forked async writer, in
the persistent worker) forks one process per bucket file from ``mp.get_context("fork")``,
then waits for them: ``count_queue.join()`` until each has called ``task_done()``, then one
``local_results_queue.get()`` per writer, both without a timeout. A writer that dies before
it reports (SIGKILL, the OOM killer, a crash outside its own ``try``) never calls
``task_done()``: the save waits forever, and every other rank with it in the next
collective. And a writer whose parent is killed (the forked async writer) goes on writing,
orphaned, into a checkpoint that has failed.

The module's ``mp`` becomes :class:`WatchfulMultiprocessing`: its fork context records the
writer processes it starts, and the two waits on their queues check the writers while they
wait: a writer that exited with anything but 0 (``exitcode`` < 0: killed by that signal)
raises :class:`WriterProcessDied` out of upstream's wait. The wrapped
``write_preloaded_data_multiproc`` then stops the call's other writers, releases the wait,
and reports the failure where upstream reports a writer's error (its results queue, as an
exception): ``retrieve_write_results`` turns it into megatron-core's own write failure, and
the save's agreed outcome (:mod:`.outcome`) makes it every rank's error.

Releases that write with threads (0.19 on) have no such processes: those two patches are
not applied there (detected from the writer class).

The forked writer of an asynchronous save (``TemporalAsyncCaller``, every release) that is
killed leaves no results; upstream's finalize then reports ``results_queue should not be
empty``. Its ``close`` (which joins it) notes how it ended, so the save's agreed outcome
names the cause instead (:func:`writer_death_note`).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import logging
import os
import queue as queue_mod
import signal
import threading
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Declared, Layer, Patch
from megatron_ckpt_fixes.core.rehearsal import replaced
from megatron_ckpt_fixes.core.entry_points import WRITE_BUCKETS
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError

logger = logging.getLogger(__name__)

_FILESYSTEM_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_WRITER = f"{_FILESYSTEM_ASYNC}:FileSystemWriterAsync"
_TEMPORAL = "megatron.core.dist_checkpointing.strategies.async_utils:TemporalAsyncCaller"
_notes = threading.local()  # .death: how this thread's last async writer process died
#: Seconds between two looks at the writers while waiting for them.
POLL_S = 0.1
_PR_SET_PDEATHSIG = 1


class WriterProcessDied(MegatronCkptFixesError, RuntimeError):
    """A checkpoint writer process exited without reporting its write."""


def _exit_text(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}" + (" (as the OOM killer kills)"
                                          if name == "SIGKILL" else "")
    return f"exited with code {exitcode}"


def _dying_with_parent(parent: int, target: Callable[..., Any], *args: Any,
                       **kwargs: Any) -> Any:
    """Run a writer that the kernel kills when the process that forked it dies (Linux's
    ``PR_SET_PDEATHSIG``): a writer of a killed async writer process must not go on writing
    into the checkpoint its rank already declared failed."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the writer may outlive its parent
        pass
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
    return target(*args, **kwargs)


class WatchedForkContext:
    """The fork context of one ``write_preloaded_data_multiproc`` call: the writer processes
    it starts are recorded, and its queues' waits look at them."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self.writers: list[tuple[Any, str]] = []  # (process, its bucket file)
        self._joinables: list[_WatchedJoinableQueue] = []

    def Process(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - multiprocessing's name
        if "target" in kwargs:
            kwargs["target"] = functools.partial(_dying_with_parent, os.getpid(),
                                                 kwargs["target"])
        process = self._context.Process(*args, **kwargs)
        bucket = (kwargs.get("kwargs") or {}).get("write_bucket")
        self.writers.append((process, bucket[1] if bucket else "?"))
        return process

    def Queue(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        return _WatchedQueue(self._context.Queue(*args, **kwargs), self)

    def JoinableQueue(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        joinable = _WatchedJoinableQueue(self._context.JoinableQueue(*args, **kwargs), self)
        self._joinables.append(joinable)
        return joinable

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def check(self) -> None:
        """Raise :class:`WriterProcessDied` if a writer exited abnormally."""
        dead = [f"the checkpoint writer process {p.pid} (file {file}) {_exit_text(p.exitcode)}"
                for p, file in self.writers if p.pid is not None and p.exitcode not in (None, 0)]
        if dead:
            error = WriterProcessDied("; ".join(dead) + " before reporting its write")
            error.context = self  # type: ignore[attr-defined]
            raise error

    def abandon(self) -> None:
        """After a writer died: kill the call's writers still running (a failed save's
        bytes are moot; a process that exits joins its children first) and end the waits
        on their queues (no waiter thread is left behind)."""
        for process, _file in self.writers:
            if process.pid is not None and process.exitcode is None:
                process.kill()
                process.join()
        for joinable in self._joinables:
            joinable.release()


class _WatchedQueue:
    """The writers' results queue; a wait for a result looks at the writers."""

    def __init__(self, real: Any, context: WatchedForkContext) -> None:
        self._real, self._context = real, context

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if not block or timeout is not None:
            return self._real.get(block, timeout)
        while True:
            try:
                return self._real.get(timeout=POLL_S)
            except queue_mod.Empty:
                self._context.check()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _WatchedJoinableQueue:
    """The writers' completion queue; ``join`` looks at the writers while it waits."""

    def __init__(self, real: Any, context: WatchedForkContext) -> None:
        self._real, self._context = real, context

    def join(self) -> None:
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (self._real.join(), done.set()), daemon=True,
                                  name="mcf-writers-join")
        waiter.start()
        while not done.wait(POLL_S):
            self._context.check()

    def release(self) -> None:
        """End the wait for writers that will never report (each ``task_done`` owed)."""
        while True:
            try:
                self._real.task_done()
            except ValueError:  # none owed any more
                return

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class WatchfulMultiprocessing:
    """``filesystem_async``'s ``mp``: torch.multiprocessing, whose fork contexts watch their
    writer processes (:class:`WatchedForkContext`); everything else unchanged."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def get_context(self, method: str | None = None) -> Any:
        context = self._real.get_context(method)
        return WatchedForkContext(context) if method == "fork" else context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def failing_on_dead_writers(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``write_preloaded_data_multiproc``: a dead writer becomes the call's reported
    failure (on its results queue, where upstream reports a writer's error)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def write_preloaded_data_multiproc(*args: Any, **kwargs: Any) -> None:
        try:
            return original(*args, **kwargs)
        except WriterProcessDied as exc:
            context: WatchedForkContext = exc.context  # type: ignore[attr-defined]
            logger.error("%s", exc)
            context.abandon()
            results = signature.bind(*args, **kwargs).arguments["global_results_queue"]
            results.put(RuntimeError(str(exc)))
            return None

    return write_preloaded_data_multiproc


def writer_death_note() -> str | None:
    """How the async writer process this thread last joined died (None: it did not); read
    once."""
    note, _notes.death = getattr(_notes, "death", None), None
    return note


def noting_writer_death(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``TemporalAsyncCaller.close`` (it joins the forked writer): note an abnormal
    end for the finalize that follows on this thread."""

    @functools.wraps(original)
    def close(self: Any, abort: bool = False) -> Any:
        process = self.process
        result = original(self, abort=abort)
        _notes.death = None
        if process is not None and not abort and process.exitcode not in (None, 0):
            _notes.death = (f"the asynchronous checkpoint writer process {process.pid} "
                            f"{_exit_text(process.exitcode)} before it reported its writes")
        return result

    return close


def writes_with_threads() -> str | None:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    if hasattr(FileSystemWriterAsync, "write_preloaded_data_multithread") and \
            not hasattr(FileSystemWriterAsync, "write_preloaded_data_multiproc"):
        return "megatron-core's file writer writes with threads, not forked processes"
    return None


class _Seen:
    """Passes attribute access to ``real``, recording ``<name>.<attribute>``; what the
    contexts and queues it hands out do is recorded too."""

    def __init__(self, real: Any, name: str, seen: set[str]) -> None:
        self._real, self._name, self._seen = real, name, seen

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._real, attr)
        self._seen.add(f"{self._name}.{attr}")
        if attr in ("get_context", "JoinableQueue"):
            return lambda *args, **kwargs: _Seen(value(*args, **kwargs), attr, self._seen)
        return value


def _multiproc_problems() -> list[str]:
    """The forked writers come from the module's ``mp`` and are awaited on one of its
    joinable queues (watched on a save with nothing to write, which forks nothing)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    multiproc = inspect.unwrap(filesystem_async.FileSystemWriterAsync
                               .write_preloaded_data_multiproc)
    if "global_results_queue" not in inspect.signature(multiproc).parameters:
        return ["FileSystemWriterAsync.write_preloaded_data_multiproc has no parameter "
                "'global_results_queue': a dead writer could not be reported"]
    seen: set[str] = set()
    with replaced(filesystem_async, "mp", _Seen(filesystem_async.mp, "mp", seen)):
        multiproc([], False, 0, [], queue.Queue())
    wanted = {"mp.get_context": "its writers would not be watched",
              "get_context.JoinableQueue": "its wait for the writers would not be watched",
              "JoinableQueue.join": "its wait for the writers would not be watched"}
    return [f"FileSystemWriterAsync.write_preloaded_data_multiproc did not use {name}: {why}"
            for name, why in wanted.items() if name not in seen]


PATCHES: tuple[Declared, ...] = (
    Patch(
        name="writer_failures.processes.mp",
        target=_FILESYSTEM_ASYNC,
        attr="mp",
        build=WatchfulMultiprocessing,
        not_needed=writes_with_threads,
        probes=(_multiproc_problems,),
        why="the forked checkpoint writers are watched while the save waits for them",
    ),
    Layer(
        name="writer_failures.processes.multiproc",
        entry=WRITE_BUCKETS,
        build=failing_on_dead_writers,
        not_needed=writes_with_threads,
        probes=(_multiproc_problems,),
        why="a checkpoint writer process that dies (SIGKILL, the OOM killer) fails the save "
            "instead of leaving it waiting forever",
    ),
    Patch(
        name="writer_failures.processes.async_writer",
        target=_TEMPORAL,
        attr="close",
        build=noting_writer_death,
        reads=(f"{_TEMPORAL}.is_current_async_call_done",),
        why="a killed asynchronous writer process is named as the save's cause",
    ),
)
