"""Writer failures during a megatron-core save, on real gloo ranks (run by test_writer_failures.py).

Each case saves a small sharded state dict (two tensors per rank, two writers per rank: two
bucket files) through one of megatron-core's save paths and makes a writer fail for real:

- ``EISDIR``: rank 1's first bucket file already exists as a directory: that writer's
  ``open`` raises (a writer thread on megatron-core >= 0.19 and on 0.16 with the fixes'
  ``writer_threads``, a forked writer process on plain 0.16), the other writer succeeds;
- ``EISDIR-metadata``: the coordinator's ``.metadata.tmp`` is a directory: its metadata
  write fails after every writer succeeded;
- ``killed``: rank 1's first bucket file is a named pipe, so its writer blocks in ``open``
  (mid-save: no byte written); the rank then SIGKILLs the process the case names, as the
  OOM killer does: a forked bucket writer (0.16), the forked writer of megatron-core's
  asynchronous save, or the persistent worker;
- ``EIO``: the checkpoint directory is on an ext4 file system (a loop device) that rank 0
  shuts down (``EXT4_IOC_SHUTDOWN``) once the save is planned: every write after it fails
  with the kernel's EIO; ``ENOSPC``: it is on a tmpfs too small for the data. Both need the
  mounts :func:`mounted_roots` describes (test_writer_failures.py makes them in a private
  mount namespace).

The save (and its finalize) runs in a thread of the rank. A save that cannot end is told
from a slow one by where it waits, once its writer is dead: rank 1's save thread in a wait
that only that writer could end (multiprocessing's ``JoinableQueue.join``/``Queue.get``
called by megatron-core's ``write_preloaded_data_multiproc`` itself, with no watcher of the
fixes between). Rank 1 then leaves a marker, and every rank reports ``waiting`` with the
functions it waits in. Otherwise each rank reports how its save ended: ``ok`` (the save
reported success), or ``error`` (class names and message); ``metadata``: whether
``.metadata`` was written; ``orphans``: writers of a killed process that outlive it (neither
dead nor dying once it is dead: :func:`_outliving`).

A case that leaves its ranks waiting breaks their process group: it must be a run's last.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import write_results_manager_pid

#: Seconds a save may take at most, on a loaded machine (a hang that no stack shows).
DEADLINE_S = 120.0
#: Seconds to let the writers reach the named pipe (and the other writer finish).
SETTLE_S = 1.0
#: ``PF_EXITING`` in ``/proc/<pid>/stat``'s flags: the process is in its exit.
_PF_EXITING = 0x4
#: The rank whose writer fails; writers (bucket files) per rank.
FAILING_RANK = 1
WRITERS = 2
#: Waits that only a writer can end: (function, file ending), inside megatron-core's
#: ``write_preloaded_data_multiproc``.
_WRITER_WAITS = (("join", "multiprocessing/queues.py"), ("get", "multiprocessing/queues.py"))


@dataclass(frozen=True)
class Case:
    name: str
    #: "sync" (``execute_sync``), "async" (megatron-core's forked writer, ``AsyncCallsQueue()``)
    #: or "persistent" (``AsyncCallsQueue(persistent=True)``).
    path: str
    #: "EISDIR" or "killed" (see the module docstring).
    failure: str
    #: for "killed": "bucket" (a forked bucket writer, 0.16), "writer" (the async writer
    #: process), "worker" (the persistent worker).
    victim: str | None = None


CASES = {case.name: case for case in (
    Case("thread-exception-sync", "sync", "EISDIR"),
    Case("thread-exception-async", "async", "EISDIR"),
    Case("thread-exception-persistent", "persistent", "EISDIR"),
    Case("killed-bucket-sync", "sync", "killed", "bucket"),
    Case("killed-bucket-async", "async", "killed", "bucket"),
    Case("killed-bucket-persistent", "persistent", "killed", "bucket"),
    Case("killed-writer-async", "async", "killed", "writer"),
    Case("killed-worker-persistent", "persistent", "killed", "worker"),
    Case("metadata-write-fails", "sync", "EISDIR-metadata"),
    Case("eio", "sync", "EIO"),
    Case("enospc", "sync", "ENOSPC"),
)}

#: Cases that need a mounted file system (the environment variable names its directory).
MOUNTED = {"eio": "MCF_TEST_EXT4_DIR", "enospc": "MCF_TEST_SMALL_TMPFS_DIR"}
_EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
_EXT4_GOING_FLAGS_NOLOGFLUSH = 2


def _shut_down(directory: str) -> None:
    """Shut the ext4 file system holding ``directory`` down: from now on every write to it
    fails with EIO (as on a disk that failed)."""
    import fcntl
    import struct

    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)


def writes_with_processes() -> bool:
    """Whether megatron-core's file writer forks a process per bucket (0.16) rather than
    running threads (0.19 on): asked of the writer class, not of a version number."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    return hasattr(FileSystemWriterAsync, "write_preloaded_data_multiproc")


def applicable(name: str) -> bool:
    """Forked bucket writers exist only where the writer forks them."""
    return CASES[name].victim != "bucket" or writes_with_processes()


def _forked_children(pid: int) -> list[psutil.Process]:
    """Live processes forked by ``pid`` (same command line: not spawned helpers), but for
    the rank's write-results Manager (forked too)."""
    parent = psutil.Process(pid)
    found = []
    for child in parent.children():
        try:
            if child.pid != write_results_manager_pid() and \
                    child.status() != psutil.STATUS_ZOMBIE and child.cmdline() == parent.cmdline():
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _dying(process: psutil.Process) -> bool:
    """Dead, in its exit, or with a SIGKILL pending (delivered when it next runs, which a
    loaded machine may delay): it will not outlive the moment."""
    try:
        with open(f"/proc/{process.pid}/stat") as f:
            flags = int(f.read().rsplit(")", 1)[1].split()[6])
        with open(f"/proc/{process.pid}/status") as f:
            pending = [int(line.split()[1], 16) for line in f
                       if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return not _alive(process) or bool(flags & _PF_EXITING) or \
        any(mask & (1 << (signal.SIGKILL - 1)) for mask in pending)


def _outliving(victims: list[psutil.Process], processes: list[psutil.Process]) -> list[str]:
    """The command lines of ``processes`` (the victims' writers) that outlive the victims.

    Once a victim has exited, the kernel has already sent its children their parent-death
    signal (``PR_SET_PDEATHSIG``, which the fixes' writers ask for): each is then dead or
    dying, or nothing will ever end it. An order of events, not a grace period: it waits
    for the victims' exit only (a hang shows at :data:`DEADLINE_S`)."""
    deadline = time.monotonic() + DEADLINE_S
    while any(_alive(v) for v in victims) and time.monotonic() < deadline:
        time.sleep(0.05)
    names = []
    for process in processes:
        if _dying(process):
            continue
        try:
            names.append(" ".join(process.cmdline())[:200])
        except psutil.Error:
            names.append(str(process.pid))
    return names


def _state(rank: int, ws: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {key: ShardedTensor.from_rank_offsets(key, torch.arange(16_384.0) + 100 * i + rank,
                                                 (0, rank, ws))
            for i, key in enumerate(("a", "b"))}


def _request(directory: str, rank: int, ws: int) -> Any:
    """The save's request, two writers per rank (0.16's default; 0.19 threads: Megatron-LM's
    ``--dist-ckpt-workers 2``), megatron-core's own async strategy."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    mcore = ({"async_strategy": "mcore"}
             if "async_strategy" in inspect.signature(dc.save).parameters else {})
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=WRITERS)
    return dc.save(_state(rank, ws), directory, strategy, async_sharded_save=True, **mcore)


def _victims(case: Case, queue: Any) -> list[psutil.Process]:
    """Whom to SIGKILL, once the writers settled."""
    if case.victim == "bucket" and case.path == "sync":
        return _forked_children(os.getpid())
    caller = queue.async_calls[0].async_caller if queue.async_calls else None
    process = getattr(caller, "process", None)
    if process is None:
        return []
    return _forked_children(process.pid) if case.victim == "bucket" else [psutil.Process(
        process.pid)]


def _waits(thread: threading.Thread) -> list[str]:
    """Where ``thread`` is: ``function (file)`` from the innermost frame outwards."""
    frame = sys._current_frames().get(thread.ident)
    found = []
    while frame is not None:
        found.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename})")
        frame = frame.f_back
    return found


def _in_writer_wait(waits: list[str]) -> bool:
    """Whether the innermost frames are megatron-core's writer collection waiting on its
    writers' queues itself: no frame of the fixes between (their watcher waits in short
    polls that check the writers, and raises once one is dead)."""
    names = [w.split(" (")[0] for w in waits]
    if "write_preloaded_data_multiproc" not in names:
        return False
    inner = waits[:names.index("write_preloaded_data_multiproc")]
    return not any("megatron_ckpt_fixes" in w for w in inner) and \
        any(w.startswith(f"{fn} (") and w.endswith(f"{tail})")
            for w in inner for fn, tail in _WRITER_WAITS)


def _save_in_thread(case: Case, directory: str, rank: int, ws: int, queue: Any,
                    out: dict) -> threading.Thread:
    def save() -> None:
        try:
            request = _request(directory, rank, ws)
            if case.failure == "EIO":  # planned, common state written: the disk fails now
                dist.barrier()
                if rank == 0:
                    _shut_down(directory)
                dist.barrier()
            if queue is None:
                request.execute_sync()
            else:
                queue.schedule_async_request(request)
                queue.maybe_finalize_async_calls(blocking=True)
            out["outcome"] = "ok"
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
            out.update(outcome="error", error=str(exc),
                       classes=[c.__name__ for c in type(exc).__mro__])

    thread = threading.Thread(target=save, daemon=True)
    thread.start()
    return thread


def _kill_victims(case: Case, queue: Any, thread: threading.Thread,
                  orphans: list[psutil.Process]) -> list[psutil.Process]:
    """SIGKILL the case's victims once they are blocked on the named pipe."""
    deadline = time.monotonic() + DEADLINE_S
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(SETTLE_S)
        victims = _victims(case, queue)
        if victims:
            for process in victims:
                orphans += process.children(recursive=True)  # upstream leaves them
                process.send_signal(signal.SIGKILL)
            return victims
    return []


def _in_collective(waits: list[str]) -> bool:
    return bool(waits) and any(w.endswith("distributed_c10d.py)") for w in waits[:3])


def run_case(rank: int, ws: int, case: Case, root: str) -> dict:
    """One case on every rank (the features are installed by the caller)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    directory = os.path.join(os.environ.get(MOUNTED.get(case.name, ""), root), case.name)
    if rank == 0:
        os.makedirs(directory)
        if case.failure == "EISDIR-metadata":
            os.mkdir(os.path.join(directory, ".metadata.tmp"))
    dist.barrier()
    assert os.path.isdir(directory), (f"rank {rank}: {directory} is missing after the barrier "
                                      f"(collectives started: {_collectives_started()})")
    if rank == FAILING_RANK and case.failure in ("EISDIR", "killed"):
        path = os.path.join(directory, f"__{rank}_0.distcp")
        os.mkdir(path) if case.failure == "EISDIR" else os.mkfifo(path)
    queue = None if case.path == "sync" else AsyncCallsQueue(persistent=case.path == "persistent")
    saved: dict = {}  # the save thread's own outcome
    out: dict = {}
    orphans: list[psutil.Process] = []
    victims: list[psutil.Process] = []
    started = time.monotonic()
    thread = _save_in_thread(case, directory, rank, ws, queue, saved)
    if case.failure == "killed" and rank == FAILING_RANK:
        victims = _kill_victims(case, queue, thread, orphans)
        out["killed"] = [v.pid for v in victims]
    _until_every_rank_ended_or_stuck(rank, ws, thread, os.path.join(root, case.name), saved, out,
                                     victims)
    out["seconds"] = round(time.monotonic() - started, 1)
    out["metadata"] = os.path.exists(os.path.join(directory, ".metadata"))
    if queue is not None and out["outcome"] != "waiting":
        queue.close(abort=out["outcome"] == "error")
    out["orphans"] = _outliving(victims, orphans)  # the killed writer's own writers
    # stuck writers, megatron-core's results manager: not past the test
    for process in [*orphans, *(psutil.Process().children(recursive=True)
                                if out["outcome"] == "waiting" else [])]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return out


def _collectives_started() -> int:
    """How many collectives this rank has started on the default group (gloo numbers them:
    the same count on every rank once each rank has joined the same collectives)."""
    return dist.group.WORLD._get_sequence_number_for_group()


def _until_every_rank_ended_or_stuck(rank: int, ws: int, thread: threading.Thread,
                                     prefix: str, saved: dict, out: dict,
                                     victims: list[psutil.Process]) -> None:
    """Wait for this rank's save to end, or to be stuck for good: in upstream's writer wait
    (:func:`_in_writer_wait`) once the writers this rank killed (``victims``) are dead, or
    in a collective that no other rank will join
    (every other rank ended, and this rank started more collectives than any of them: an
    exact rule, so a save thread that a loaded machine leaves unscheduled for seconds after
    the others ended is not taken for a stuck one). Each rank leaves a marker
    (``<prefix>.<rank>``: ``ended|waiting <collectives started>``) and returns once every
    rank did, so no rank's exit ends another's wait; ``out["ranks_waiting"]`` lists the
    ranks that reported waiting, the same list on every rank. The verdict is taken when the
    marker is written: ``saved`` (the save thread's outcome) is copied into ``out`` then, and
    a stuck save thread that fails later (its peer left the process group) changes nothing."""
    mine = f"{prefix}.{rank}"
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        thread.join(0.5)
        if not os.path.exists(mine):
            waits = _waits(thread) if thread.is_alive() else []
            others = [_marker(f"{prefix}.{r}") for r in range(ws) if r != rank]
            alone = all(o is not None for o in others) and \
                _collectives_started() > max(seq for _state, seq in others)
            writers_dead = bool(victims) and not any(_alive(v) for v in victims)
            stuck = thread.is_alive() and ((writers_dead and _in_writer_wait(waits)) or
                                           (alone and _in_collective(waits)))
            if not thread.is_alive() or stuck:
                out.update(_verdict(thread, waits, saved))
                _write_marker(mine, "waiting" if out["outcome"] == "waiting" else "ended")
        markers = [_marker(f"{prefix}.{r}") for r in range(ws)]
        if all(m is not None for m in markers):
            out["ranks_waiting"] = [r for r, (state, _) in enumerate(markers)
                                    if state == "waiting"]
            return
    if "outcome" not in out:  # the deadline passed before this rank's verdict
        out.update(_verdict(thread, _waits(thread), saved))  # no frames once it ended


def _verdict(thread: threading.Thread, waits: list[str], saved: dict) -> dict:
    """A rank's outcome now: waiting (with the functions it waits in) while its save thread
    lives, else what the thread saved."""
    if thread.is_alive():
        return {"outcome": "waiting", "waits": [w.split(" (")[0] for w in waits][:8]}
    return dict(saved)


def _write_marker(path: str, state: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(f"{state} {_collectives_started()}")
    os.replace(path + ".tmp", path)  # a reader sees the whole marker or none


def _marker(path: str) -> tuple[str, int] | None:
    try:
        with open(path) as f:
            state, seq = f.read().split()
    except FileNotFoundError:
        return None
    return state, int(seq)


def features(case: Case, fixes: bool) -> list[str] | None:
    """What a case installs: plain upstream on gloo (``compat.cpu``), or every feature; a
    forked bucket writer exists with the fixes only where ``writer_threads`` (which writes
    the buckets with threads) is left out, as a user may."""
    from megatron_ckpt_fixes import FEATURES

    if not fixes:
        return ["compat.cpu"]
    return [f for f in FEATURES if f != "writer_threads"] if case.victim == "bucket" else None


def run_cases(rank: int, ws: int, names: list[str], fixes: bool) -> dict[str, dict]:
    """``names`` one after the other on every rank, each with its :func:`features`. A case
    that leaves the ranks waiting ends the run."""
    import megatron_ckpt_fixes

    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    results = {}
    for name in names:
        megatron_ckpt_fixes.uninstall()
        megatron_ckpt_fixes.install(features(CASES[name], fixes))
        results[name] = run_case(rank, ws, CASES[name], root[0])
        if results[name].get("ranks_waiting", [rank]):  # every rank stops alike
            break
    if not any(r.get("ranks_waiting", [rank]) for r in results.values()):
        for process in psutil.Process().children(recursive=True):
            process.kill()  # megatron-core's results manager, spawned helpers
    return results

