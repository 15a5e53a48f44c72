"""A dead persistent checkpoint worker makes every rank raise, instead of a trainer that waits.

megatron-core's persistent async saves (``AsyncCallsQueue(persistent=True)``) hand each save
to one long-lived worker process per rank and wait for it at two points: right after
scheduling, until the worker has staged the tensors (``JoinableQueue.join()``), and when
finalizing, until the worker reports the save done. Neither wait looks at the worker: if it
dies (killed, out of memory, a crash in its own code) the trainer waits forever, and so do
the other ranks in the next collective.

The patched caller watches its worker instead:

- while scheduling, a watchdog thread releases the staging wait (``task_done()``, public
  queue API) when the worker dies before staging;
- before each completion check, a rank waits for the worker's report or its death; whether
  some rank's worker died is agreed by all ranks (one all_reduce, in step with upstream's own
  per-check collective), and then every rank raises the same :class:`AsyncWorkerError`
  naming the rank, the worker's pid and its exit code. A check with ``no_dist=True`` has no
  collective upstream, so it raises on its own rank only;
- closing the caller (explicitly, or when it is garbage collected) aborts instead of
  handing a dead worker its "DONE" and joining the queue forever.

The queues are upstream's (``preload_q``/``comp_q`` per caller in megatron-core 0.16,
class-level ``_persistent_preload_q``/``_persistent_comp_q`` from 0.17); which one exists is
read from the caller, and ``install()`` refuses a caller that has neither.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable

from torch.distributed.checkpoint import CheckpointException

from megatron_ckpt_fixes.core import agreement
from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError

logger = logging.getLogger(__name__)

_CALLER = "megatron.core.dist_checkpointing.strategies.async_utils:PersistentAsyncCaller"
#: (preload queue, completion queue) attribute names, per megatron-core layout.
_QUEUE_ATTRS = (("_persistent_preload_q", "_persistent_comp_q"), ("preload_q", "comp_q"))
_DEAD_ATTR = "_mcf_dead_worker"
_POLL_S = 0.1


class AsyncWorkerError(MegatronCkptFixesError, CheckpointException):
    """A persistent checkpoint worker died before finishing its save; raised on every rank.

    A ``CheckpointException``, like the write failures ``maybe_finalize_async_calls``
    already raises; ``failures`` maps each rank whose worker died to what is known of it.
    """

    def __init__(self, what: str, errors: dict[int, Any]) -> None:
        CheckpointException.__init__(self, agreement.describe_failures(what, errors), errors)
        self.summary = agreement.describe_failures(what, errors)

    def __str__(self) -> str:
        return self.summary


def _queues(caller: Any) -> tuple[Any, Any]:
    for preload, completion in _QUEUE_ATTRS:
        if getattr(caller, preload, None) is not None or hasattr(type(caller), preload):
            return getattr(caller, preload), getattr(caller, completion)
    raise AttributeError(f"{type(caller).__name__} has none of the queues {_QUEUE_ATTRS}")


def _death(process: Any) -> str:
    return (f"the persistent checkpoint worker (pid {process.pid}) exited with code "
            f"{process.exitcode} before finishing its save")


def _ended(process: Any) -> bool:
    """Whether ``process`` was started and has ended. Not ``not is_alive()``: upstream
    assigns the worker's ``Process`` before it starts it (spawning takes a while on a loaded
    machine), and a process not started yet is not alive either."""
    return process is not None and process.exitcode is not None


def _release_staging_if_worker_dies(caller: Any, done: threading.Event) -> None:
    """Watchdog: a worker that died before staging never calls ``task_done()``; do it."""
    while not done.wait(_POLL_S):
        process = caller.process
        if _ended(process):
            caller.__dict__[_DEAD_ATTR] = _death(process)
            try:
                _queues(caller)[0].task_done()
            except ValueError:  # nothing was waiting for staging
                pass
            return


def watched_schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def schedule_async_call(self: Any, async_req: Any) -> Any:
        done = threading.Event()
        watchdog = threading.Thread(target=_release_staging_if_worker_dies, args=(self, done),
                                    name="mcf-async-worker-watchdog", daemon=True)
        watchdog.start()
        try:
            return original(self, async_req)
        finally:
            done.set()
            watchdog.join()

    return schedule_async_call


def _wait_for_report_or_death(caller: Any, blocking: bool) -> str | None:
    """Why this rank's worker cannot finish its save (it died), or None."""
    dead = caller.__dict__.get(_DEAD_ATTR)
    process = caller.process
    if dead or process is None or caller.cur_item is not None:
        return dead
    completion = _queues(caller)[1]
    while completion.empty():
        if _ended(process):
            return _death(process)
        if not blocking:
            return None
        time.sleep(_POLL_S)
    return None


def agreed_liveness(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def is_current_async_call_done(self: Any, blocking: bool = False,
                                   no_dist: bool = False) -> bool:
        dead = _wait_for_report_or_death(self, blocking)
        what = "persistent async checkpoint save"
        if no_dist and dead:
            raise AsyncWorkerError(what, {agreement.rank_and_size()[0]: dead})
        if not no_dist:
            agreement.check(dead, what, raise_as=AsyncWorkerError)
        return original(self, blocking, no_dist)

    return is_current_async_call_done


def no_wait_on_dead_worker(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def close(self: Any, abort: bool = False) -> Any:
        process = self.process
        if not abort and process is not None and not process.is_alive():
            # Upstream would send "DONE" and join the queue: nobody is left to answer.
            logger.warning("closing the persistent async caller: %s", _death(process))
            abort = True
        return original(self, abort=abort)

    return close


def _caller_queues_probe() -> list[str]:
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    caller = PersistentAsyncCaller()
    caller.close = lambda *_args, **_kwargs: None  # no worker to close (its __del__ calls it)
    problems = [f"PersistentAsyncCaller has no attribute {a!r}" for a in ("process", "cur_item")
                if not hasattr(caller, a)]
    try:
        _queues(caller)
    except AttributeError as exc:
        problems.append(str(exc))
    return problems


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="async_worker.schedule_async_call",
        target=_CALLER,
        attr="schedule_async_call",
        build=watched_schedule,
        probes=(_caller_queues_probe,),
        why="scheduling a save does not wait forever for a worker that died before staging",
    ),
    Patch(
        name="async_worker.is_current_async_call_done",
        target=_CALLER,
        attr="is_current_async_call_done",
        build=agreed_liveness,
        probes=(_caller_queues_probe,),
        why="a persistent checkpoint worker that died makes every rank raise, never wait",
    ),
    Patch(
        name="async_worker.close",
        target=_CALLER,
        attr="close",
        build=no_wait_on_dead_worker,
        probes=(_caller_queues_probe,),
        why="closing (also at garbage collection) does not wait forever for a dead worker",
    ),
)
