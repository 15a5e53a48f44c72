"""The persistent worker's watchdog tells a worker that ended from one not started yet.

megatron-core assigns the caller's worker ``Process`` before it starts it, and starting a
spawned interpreter takes a while on a loaded machine: a watchdog that took "not alive" for
"dead" failed the first persistent save of a run on every rank ("the persistent checkpoint
worker (pid None) exited with code None"), seen in the Megatron-LM async twin under load.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading
from types import SimpleNamespace

import pytest

from megatron_ckpt_fixes.fixes import async_worker

pytestmark = pytest.mark.varies_with("python")


class _Queue:
    def __init__(self) -> None:
        self.released = 0

    def task_done(self) -> None:
        self.released += 1


def _watch(process: mp.Process | None, polls: int = 3) -> SimpleNamespace:
    """Run the staging watchdog over a caller holding ``process`` for a few polls."""
    caller = SimpleNamespace(process=process, preload_q=_Queue(), comp_q=None)
    done = threading.Event()
    watchdog = threading.Thread(target=async_worker._release_staging_if_worker_dies,
                                args=(caller, done))
    watchdog.start()
    watchdog.join(async_worker._POLL_S * polls)
    done.set()
    watchdog.join()
    return caller


def test_a_worker_not_started_yet_is_not_dead():
    caller = _watch(mp.get_context("spawn").Process(target=print))
    assert async_worker._DEAD_ATTR not in caller.__dict__
    assert caller.preload_q.released == 0


def test_a_worker_that_exited_is_dead_and_staging_is_released():
    process = mp.get_context("fork").Process(target=sys.exit, args=(3,))
    process.start()
    process.join()
    caller = _watch(process, polls=30)
    assert caller.__dict__[async_worker._DEAD_ATTR] == (
        f"the persistent checkpoint worker (pid {process.pid}) exited with code 3 before "
        "finishing its save")
    assert caller.preload_q.released == 1
