"""Asynchronous saves while the trainer keeps changing its tensors (run by test_async_snapshot).

Every rank holds ``COUNT`` CPU tensors, saves them through megatron-core's API
(``dist_checkpointing.save(..., async_sharded_save=True)``, then ``AsyncCallsQueue``), and
changes them in place with ``add_(1.0)`` the way the next optimizer step does: right after
scheduling returns (a gated writer writes its first item only once the trainer has changed
the tensors), or while the writer is writing (a gated writer tells the trainer when its
first item is in the file, and writes the rest only once the trainer has changed the
tensors): an order of events, not a pause that a loaded machine could outrun. The values at the moment scheduling returned are kept; after
``maybe_finalize_async_calls(blocking=True)`` every loaded value is compared with them
bitwise, and the recorded checksums are checked (where the checksums feature is on).

Paths: the default forked writer (``AsyncCallsQueue()``) with tensors in shared memory (and in
private memory, which the fork freezes on its own), and the persistent worker
(``AsyncCallsQueue(persistent=True)``), one worker for the whole run.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

#: Tensors per rank and float32 elements per tensor (the issue's recipe has 16 MB tensors;
#: 1 MB keeps the CI leg short, and the gated writer makes "during the write" certain).
COUNT = 8
ELEMENTS = 1 << 18
#: A bound on waiting for a marker (a hang becomes an error; no verdict depends on it).
MARKER_TIMEOUT_S = 120.0


class GatedWriter:
    """``async_fn`` whose writer writes its first item, creates ``<gate>.first-item``, and
    writes every later item only once ``<gate>.go`` exists (the trainer has changed its
    tensors); ``from_first``: the first item too waits for it. Picklable by name: it also
    runs in the persistent worker."""

    def __init__(self, async_fn: Callable[..., Any], gate: str, from_first: bool = False) -> None:
        self.async_fn, self.gate, self.from_first = async_fn, gate, from_first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        original, first = filesystem_async._write_item, f"{self.gate}.first-item"

        @functools.wraps(original)  # the writer reads its signature
        def gated_write_item(*a: Any, **k: Any) -> Any:
            if self.from_first or os.path.exists(first):
                _wait_for(f"{self.gate}.go")
            result = original(*a, **k)
            if not os.path.exists(first):
                open(first, "w").close()
            return result

        filesystem_async._write_item = gated_write_item
        try:
            return self.async_fn(*args, **kwargs)
        finally:
            filesystem_async._write_item = original


@dataclass
class Outcome:
    """One save, seen from one rank."""

    tensors: int = 0
    torn: int = 0  # tensors whose loaded values differ from the values at scheduling
    mixed: int = 0  # ... of which part old, part new values
    next_step: int = 0  # ... of which every value is the next step's
    checksums: str = ""  # "verified", "none", or the error's class and first line
    trainer_shared: int = 0  # trainer tensors in shared memory after the save
    shared_before: int = 0  # ... before it
    notes: dict = field(default_factory=dict)


def _values(rank: int, salt: int) -> list[torch.Tensor]:
    base = torch.arange(ELEMENTS, dtype=torch.float32)
    return [base + (1000 * i + 100_000 * rank + 10_000_000 * salt) % 8_000_000
            for i in range(COUNT)]


def _sharded(tensors: list[torch.Tensor], rank: int, ws: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t, (0, rank, ws))
            for i, t in enumerate(tensors)}


def _request(tensors: list[torch.Tensor], rank: int, ws: int, path: str,
             strategy: str = "mcore") -> Any:
    from megatron.core import dist_checkpointing as dc

    if rank == 0:
        os.makedirs(path)
    dist.barrier()
    kwargs = ({"async_strategy": strategy}
              if "async_strategy" in inspect.signature(dc.save).parameters else {})
    return dc.save(_sharded(tensors, rank, ws), path, async_sharded_save=True, **kwargs)


def _checksums(path: str, installed: tuple[str, ...]) -> str:
    if "checksums" not in installed:
        return "none"
    from megatron_ckpt_fixes.fixes.checksums import verify_checkpoint

    try:
        return verify_checkpoint(path).status
    except BaseException as exc:  # noqa: BLE001 - the class and message are the outcome
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


#: The twin: plain megatron-core with the checksums feature hashing live memory (before issue 22).
_TWIN = ("compat.cpu", "checksums")


def _load_unchecked(path: str, like: dict) -> dict:
    """What the files hold, read past the load-time check of the checksums feature: a torn
    save whose checksum was hashed from live memory (the twin) fails that check, and the
    twin's finding is the values written, not the check's verdict (``_checksums`` is)."""
    from unittest import mock

    from megatron.core import dist_checkpointing as dc
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    checked = FileSystemReader._slice_file
    with mock.patch.object(FileSystemReader, "_slice_file",
                           getattr(checked, "__wrapped__", checked)):
        return dc.load(like, path)


def _judge(path: str, expected: list[torch.Tensor], rank: int, ws: int,
           installed: tuple[str, ...]) -> Outcome:
    from megatron.core import dist_checkpointing as dc

    like = _sharded([torch.zeros_like(t) for t in expected], rank, ws)
    # With every fix the load checks what it reads (and must pass); the twin is read past it.
    loaded = dc.load(like, path) if installed != _TWIN else _load_unchecked(path, like)
    out = Outcome(tensors=len(expected))
    for i, want in enumerate(expected):
        got = loaded[f"t{i}"]
        same = got == want
        if not bool(same.all()):
            out.torn += 1
            out.mixed += int(bool(same.any()))
            out.next_step += int(torch.equal(got, want + 1.0))
    out.checksums = _checksums(path, installed)
    return out


def _install(mode: str) -> tuple[str, ...]:
    import megatron_ckpt_fixes

    features = {"upstream": ["compat.cpu"],
                "upstream+checksums": list(_TWIN),
                "fixed": list(megatron_ckpt_fixes.FEATURES)}[mode]
    megatron_ckpt_fixes.install(features)
    return tuple(features)


def _wait_for(marker: str) -> None:
    deadline = time.monotonic() + MARKER_TIMEOUT_S
    while not os.path.exists(marker):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{marker} never appeared")
        time.sleep(0.01)


def _save_and_change(queue: Any, rank: int, ws: int, path: str, tensors: list[torch.Tensor],
                     when: str, strategy: str = "mcore") -> list[torch.Tensor]:
    """Schedule a save of ``tensors``, then change them ``when`` ("scheduled": at once, and
    megatron-core's own writer writes once the change is made; "writing": once the writer has written its
    first item, and before it writes the others, which it does once the change is made); the
    values scheduling saw."""
    request = _request(tensors, rank, ws, path, strategy)
    gate = f"{path}.rank{rank}"
    gated = when == "writing" or strategy == "mcore"  # megatron-core's writer is gated
    if gated:
        request = request._replace(async_fn=GatedWriter(request.async_fn, gate,
                                                        from_first=when == "scheduled"))
    queue.schedule_async_request(request)
    expected = [t.clone() for t in tensors]
    if when == "writing":
        _wait_for(f"{gate}.first-item")
    for t in tensors:
        t.add_(1.0)
    if gated:
        open(f"{gate}.go", "w").close()
    return expected


def snapshot_worker(rank: int, ws: int, root: str, mode: str) -> dict[str, Any]:
    """Every scenario of the module docstring in one run, with ``mode``'s features."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    installed = _install(mode)
    out: dict[str, Any] = {}
    moments: dict[str, list[torch.Tensor]] = {}

    def run(name: str, queue: Any, when: str, shared: bool) -> None:
        tensors = _values(rank, len(out))
        if shared:
            for t in tensors:
                t.share_memory_()
        shared_before = sum(t.is_shared() for t in tensors)
        path = os.path.join(root, name)
        expected = moments[name] = _save_and_change(queue, rank, ws, path, tensors, when)
        queue.maybe_finalize_async_calls(blocking=True)
        outcome = _judge(path, expected, rank, ws, installed)
        outcome.shared_before = shared_before
        outcome.trainer_shared = sum(t.is_shared() for t in tensors)
        out[name] = outcome

    forked = AsyncCallsQueue()
    run("fork-private-scheduled", forked, "scheduled", shared=False)
    run("fork-shared-scheduled", forked, "scheduled", shared=True)
    run("fork-shared-writing", forked, "writing", shared=True)
    forked.close()

    persistent = AsyncCallsQueue(persistent=True)
    run("persistent-scheduled", persistent, "scheduled", shared=False)
    run("persistent-writing", persistent, "writing", shared=False)

    # Two saves in flight: the second is scheduled (and the tensors changed again) before the
    # first is finalized. Each checkpoint must hold its own moment's values. The persistent
    # worker makes scheduling wait until it has preloaded the request (``preload_q.join()``),
    # i.e. until the first is written, upstream and fixed alike: the first writer's gate opens
    # after its change, before the second is scheduled.
    first, second = os.path.join(root, "in-flight-1"), os.path.join(root, "in-flight-2")
    tensors = _values(rank, len(out))
    expected_first = _save_and_change(persistent, rank, ws, first, tensors, "writing")
    expected_second = _save_and_change(persistent, rank, ws, second, tensors, "scheduled")
    persistent.maybe_finalize_async_calls(blocking=True)
    out["in-flight-1"] = _judge(first, expected_first, rank, ws, installed)
    out["in-flight-2"] = _judge(second, expected_second, rank, ws, installed)
    persistent.close()

    if mode == "fixed":
        from megatron_ckpt_fixes.fixes import snapshot

        out["stats"] = snapshot.stats()
        out["records"] = {name: _records(os.path.join(root, name), rank)
                          for name in ("fork-shared-scheduled", "persistent-scheduled")}
        # Written without torch's CRC-32: plain megatron-core (and torch) load them bitwise.
        import megatron_ckpt_fixes

        megatron_ckpt_fixes.uninstall()
        megatron_ckpt_fixes.install(["compat.cpu"])
        out["plain-load"] = {name: _judge(os.path.join(root, name), moments[name], rank, ws,
                                          ()).torn for name in moments}
    return out


def _records(path: str, rank: int) -> dict[str, int]:
    """This rank's saved records (byte ranges from ``.metadata``) as zip archives, read with
    plain ``torch.load``: tensor records with and without torch's CRC-32 (without: 0 in the
    zip entries, the checksum replaces it), and other records (objects megatron-core
    serialized before the writer, with torch's CRC-32 as the user's torch.save writes it)."""
    import io
    import pickle
    import zipfile

    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    counts = {"tensor_with_crc": 0, "tensor_without_crc": 0, "other": 0}
    for info in metadata.storage_data.values():
        if not info.relative_path.startswith(f"__{rank}_"):
            continue
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            record = f.read(info.length)
        crc = zipfile.ZipFile(io.BytesIO(record)).testzip() is None
        value = torch.load(io.BytesIO(record), weights_only=False)
        if isinstance(value, torch.Tensor) and value.numel() == ELEMENTS:
            counts["tensor_with_crc" if crc else "tensor_without_crc"] += 1
        else:
            counts["other"] += 1
    return counts


def _nvrx_platform(nvrx: str, env_dir: str) -> None:
    """nvidia-resiliency-ext importable here and in the worker it spawns, and the CPU
    platform open in both: here now, in the worker at its start-up (``env_dir``'s
    ``sitecustomize``, on the ``PYTHONPATH`` it inherits). Set in the rank, so that the rank
    itself forks from the fork server instead of being spawned for a changed start-up."""
    import sys
    from pathlib import Path

    sys.path[:0] = [nvrx, str(Path(__file__).resolve().parents[2] / "scripts" / "mcore_suite")]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [nvrx, env_dir, os.environ.get("PYTHONPATH")]))
    os.environ["MCF_NVRX_CPU"] = "1"
    import cpu_platform

    cpu_platform.CpuPlatform().open()


def nvrx_worker(rank: int, ws: int, root: str, mode: str, nvrx: str,
                env_dir: str) -> dict[str, Any]:
    """nvidia-resiliency-ext's persistent worker (``--async-strategy nvrx``, its default),
    tensors changed right after scheduling, with ``mode``'s features."""
    _nvrx_platform(nvrx, env_dir)
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

    installed = _install(mode)
    tensors = _values(rank, 0)
    queue = AsyncCallsQueue(persistent=True)
    path = os.path.join(root, "nvrx-persistent-scheduled")
    expected = _save_and_change(queue, rank, ws, path, tensors, "scheduled", "nvrx")
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    outcome = _judge(path, expected, rank, ws, ())
    outcome.trainer_shared = sum(t.is_shared() for t in tensors)
    outcome.notes = {"installed": installed}
    return {"nvrx-persistent-scheduled": outcome}
