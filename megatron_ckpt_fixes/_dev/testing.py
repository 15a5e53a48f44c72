"""Run a function on N real processes with a gloo process group (tests, benchmarks, demos).

The backend can be switched for a GPU machine (:data:`BACKEND_ENV`, scripts/gpu_check.sh).

Every rank reports back a value or its error. A rank that never reports within the deadline
is a hang: all processes are killed and the hang is reported, so a test of "never hangs"
fails instead of blocking CI.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import queue as queue_mod
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_ckpt_fixes.activation import ENV, switched_on

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankResult:
    rank: int
    value: Any = None
    error_type: str | None = None  # class name; exceptions themselves may not pickle
    error: str | None = None  # str(exception)
    trace: str | None = None
    error_classes: tuple[str, ...] = ()  # names along the exception's MRO

    @property
    def ok(self) -> bool:
        return self.error_type is None

    def raised(self, class_name: str) -> bool:
        """Whether the rank raised an instance of a class of that name (``except`` would catch)."""
        return class_name in self.error_classes


class RanksFailed(AssertionError):
    """At least one rank raised, or hung."""

    def __init__(self, results: list[RankResult | None]) -> None:
        self.results = results
        lines = []
        for rank, res in enumerate(results):
            if res is None:
                lines.append(f"rank {rank}: no result (hung or killed)")
            elif not res.ok:
                lines.append(f"rank {rank}: {res.error_type}: {res.error}\n{res.trace}")
        super().__init__("\n".join(lines))


#: The process-group backend of the ranks: gloo unless this variable names another torch
#: backend spec (scripts/gpu_check.sh: ``cpu:gloo,cuda:nccl``, each rank on its own GPU).
BACKEND_ENV = "MCF_TEST_BACKEND"


def init_test_group(rank: int, world_size: int, init_method: str,
                    timeout: datetime.timedelta) -> None:
    """The process group of one test rank, on the backend :data:`BACKEND_ENV` names.

    Ends with a barrier: gloo's ``init_process_group`` may return on one rank while another
    still completes its connection handshake, and a rank whose test needs no collective then
    leaves and closes its side under it (CI: ``Gloo connectFullMesh failed ... Connection
    closed by peer`` on the slower rank, which reported nothing)."""
    backend = os.environ.get(BACKEND_ENV, "gloo")
    if "nccl" in backend:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, timeout=timeout)
    if world_size > 1:
        dist.barrier()


#: What the ranks' fork server imports once, so that each rank starts with it imported: torch
#: and its distributed checkpointing are about 2 s of CPU per process, megatron-core's
#: checkpointing and the modules the tests' ranks use about 2.5 s more: most of a short test's
#: time on a 2-core machine. A module that does not import (no megatron-core here) is left out.
PRELOAD = ("torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "numpy")
#: megatron-core's part of :data:`PRELOAD`, imported only where the server starts without the
#: activation switch: importing megatron-core fires the switch's hook (``install()``), and a
#: rank of a test that sets the switch is spawned anyway (a start-up variable changed). Each
#: rank imports this package itself and installs what its test asks for; the release is
#: that of the caller's environment (another one on ``PYTHONPATH`` also means a spawn).
PRELOAD_MEGATRON = ("megatron.core", "megatron.core.dist_checkpointing",
                    "megatron.core.dist_checkpointing.strategies.torch",
                    "megatron.core.dist_checkpointing.strategies.filesystem_async",
                    "megatron.core.dist_checkpointing.strategies.fully_parallel",
                    "megatron.core.rerun_state_machine", "megatron.core.tensor_parallel",
                    "megatron.core.transformer", "megatron.core.optimizer")


def _feature_modules() -> list[str]:
    """The modules of this package's megatron-core features: imported, not installed (each
    rank installs what its test asks for): a few tenths of a second of CPU per rank."""
    from megatron_ckpt_fixes.core.features import MEGATRON_CORE, REGISTRY

    return [f"megatron_ckpt_fixes.{f.module}" for f in REGISTRY
            if f.default and f.system == MEGATRON_CORE]


def _startup_environment() -> dict[str, str]:
    """The variables an interpreter's start-up reads: Python's own (``PYTHONPATH``, and a
    ``sitecustomize`` found on it) and the package's activation switch (its ``.pth`` file)."""
    return {k: v for k, v in os.environ.items() if k.startswith("PYTHON") or k == ENV}


#: What the fork server starts with: the process's start-up variables when it imported this
#: module (before any test set one for its ranks; imports set others, such as torch's
#: ``TORCHINDUCTOR_CACHE_DIR``, which each rank gets from its caller).
_SERVER_STARTUP = _startup_environment()


def _context() -> Any:
    """Ranks are forked from one server process that imported :data:`PRELOAD` (Python's
    ``forkserver``: a fresh, single-threaded process, unlike a fork of the caller), while
    the caller's start-up variables are the ones that server started with. Otherwise they
    are spawned: a forked rank would carry the server's start-up instead of the caller's."""
    if _startup_environment() != _SERVER_STARTUP:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    armed = switched_on(os.environ.get(ENV))
    ctx.set_forkserver_preload(
        list(PRELOAD) + ([] if armed else [*PRELOAD_MEGATRON, *_feature_modules()]))
    return ctx


def send_result(results: Any, result: RankResult) -> None:
    """Put ``result`` on the ranks' queue by value (plain pickle), not as torch's
    multiprocessing pickler would: that one passes a tensor's storage as a file descriptor that
    the parent fetches from the rank's own process, which a rank that has already exited no
    longer serves (CI on a loaded machine: ``FileNotFoundError`` in ``resource_sharer`` while
    reading a rank's result)."""
    results.put(pickle.dumps(result))


def receive_result(results: Any, timeout: float) -> RankResult:
    """The next result :func:`send_result` put on ``results``."""
    return pickle.loads(results.get(timeout=timeout))


#: megatron-core's module holding the queue its checkpoint writers report to.
_FILESYSTEM_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_write_results_manager: Any = None


def _fork_write_results_manager() -> None:
    """Start the Manager behind megatron-core's write-results queue by forking this rank.

    megatron-core starts it with ``spawn`` at a rank's first save: a new interpreter that
    imports torch when the first result reaches it, several seconds of CPU per rank and most
    of a short test's time (every releases' module keeps it in ``_results_queue``). A fork of
    the rank, still single-threaded here (before its process group starts), has torch already.
    Where to start a Manager is no part of what the tests prove: the queue, its proxies and
    every checkpoint path are upstream's. Only where the fork server preloaded the module."""
    global _write_results_manager
    module = sys.modules.get(_FILESYSTEM_ASYNC)
    if module is not None and getattr(module, "_results_queue", "absent") is None:
        _write_results_manager = mp.get_context("fork").Manager()
        module._results_queue = _write_results_manager.Queue()


def write_results_manager_pid() -> int | None:
    """The process of this rank's write-results Manager (:func:`_fork_write_results_manager`),
    a fork of the rank with its command line: tests that look for the rank's forked checkpoint
    writers leave it out."""
    return None if _write_results_manager is None else _write_results_manager._process.pid


def _worker(rank: int, world_size: int, init_method: str, fn: Callable, args: tuple,
            collective_timeout_s: float, results: Any, env: dict[str, str] | None) -> None:
    if env is not None:  # forked: the fork server's variables, the caller's instead
        os.environ.clear()
        os.environ.update(env)
    torch.set_num_threads(1)
    _fork_write_results_manager()
    init_test_group(rank, world_size, init_method,
                    datetime.timedelta(seconds=collective_timeout_s))
    try:
        value = fn(rank, world_size, *args)
        send_result(results, RankResult(rank, value))
    except BaseException as exc:  # CheckpointException derives from BaseException
        send_result(results, RankResult(rank, None, type(exc).__name__, str(exc),
                                        traceback.format_exc(),
                                        tuple(cls.__name__ for cls in type(exc).__mro__)))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 240.0,
              collective_timeout_s: float = 60.0, check: bool = True) -> list[RankResult | None]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (forked from the
    fork server, or spawned where the start-up variables changed: :func:`_context`).

    ``fn`` must be importable (module level). With ``check`` (default) any error or hang
    raises :class:`RanksFailed`; otherwise the per-rank results are returned (``None`` for a
    rank that never reported).
    """
    ctx = _context()
    env = dict(os.environ) if ctx.get_start_method() == "forkserver" else None
    results_q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_method, fn, args,
                                              collective_timeout_s, results_q,
                                              env), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: list[RankResult | None] = [None] * world_size
        deadline = time.monotonic() + timeout_s
        pending = world_size
        while pending and time.monotonic() < deadline:
            try:
                res = receive_result(results_q, timeout=0.5)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and results_q.empty():
                    break
                continue
            results[res.rank] = res
            pending -= 1
        for p in procs:
            p.join(timeout=5 if pending == 0 else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    if check and any(r is None or not r.ok for r in results):
        raise RanksFailed(results)
    return results


@contextlib.contextmanager
def shared_temp_dir() -> Iterator[str]:
    """A temporary directory that rank 0 creates, every rank uses, and rank 0 removes only
    after every rank is done with it.

    Each rank may leave its last load at a different time; if rank 0 removed the directory as
    soon as it left, another rank could still be reading the checkpoint inside it (seen in CI:
    ``FileNotFoundError`` on ``.metadata`` in a rank that was still loading). A rank that
    raises skips the closing barrier: the run fails anyway, and the others must not wait for
    it. A barrier that fails because a peer is gone (some tests leave a rank crashed on
    purpose) ends the wait: a rank that is gone reads nothing more."""
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(root, src=0)
        yield root[0]
        try:
            dist.barrier()
        except RuntimeError as exc:  # gloo: the peer's connection closed, or it timed out
            logger.info("rank %d: a peer left before the shared directory's last barrier: %s",
                        dist.get_rank(), exc)


def loads_exactly(directory: str, state: Callable[[], dict[str, Any]]) -> bool:
    """Whether the checkpoint in ``directory`` loads, into zeros shaped like the
    ShardedTensors ``state()`` builds, exactly the values ``state()`` holds (collective:
    megatron-core's load on every rank)."""
    from megatron.core import dist_checkpointing as dc

    template = state()
    for sharded in template.values():
        sharded.data = torch.zeros_like(sharded.data)
    loaded, expected = dc.load(template, directory), state()
    return all(torch.equal(loaded[key], expected[key].data) for key in loaded)
