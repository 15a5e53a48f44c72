"""The snapshot of an asynchronous save's request, on real megatron-core requests (one rank).

Each check runs against the fix and against a trivial wrong fix, which it must catch: a copy
made only on the first save (buffers reused, never refreshed), a copy skipped when "nobody
else holds" the bucket's tensor (its Python refcount: megatron-core's bucket holds a fresh
``detach()`` of the trainer's tensor, with the trainer's storage), and a staging buffer handed
to a second save while the first one's writer may still read it.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import types

import pytest
import torch

from megatron_ckpt_fixes.fixes import snapshot
from megatron_ckpt_fixes.fixes.snapshot.arena import ArenaSet, exact_storages
from megatron_ckpt_fixes.fixes.snapshot.staging import StagingPool

ELEMENTS = 64
_SAVES = itertools.count()


@pytest.fixture
def cpu_world(single_rank_group):
    """A one-rank gloo world with plain megatron-core made runnable on CPU."""
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install(["compat.cpu"])
    yield
    megatron_ckpt_fixes.uninstall()


def _request(tmp_path, tensors: list[torch.Tensor], name: str):
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor

    path = tmp_path / f"{name}-{next(_SAVES)}"
    path.mkdir()
    sd = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", t) for i, t in enumerate(tensors)}
    kwargs = ({"async_strategy": "mcore"}
              if "async_strategy" in inspect.signature(dc.save).parameters else {})
    return dc.save(sd, str(path), async_sharded_save=True, **kwargs)


def _tensors(buckets) -> list[torch.Tensor]:
    assert buckets is not None
    return [t for _, _, (_, tensors) in buckets for _, t in tensors]


def _written(request) -> list[torch.Tensor]:
    """What the writer would write: the tensors after the request's own preload step."""
    return _tensors(request.preload_fn())


def _release(request) -> None:
    """The request's first finalize step (the writer has returned on every rank)."""
    request.finalize_fns[0]()


def _values(salt: float) -> list[torch.Tensor]:
    return [torch.arange(ELEMENTS, dtype=torch.float32) + 100 * i + salt for i in range(3)]


def _sorted(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return sorted(tensors, key=lambda t: float(t[0]))


def check_copies_every_save(tmp_path, pool: StagingPool) -> None:
    """Save, finalize, change, save again: each request writes its own moment's values."""
    tensors = _values(0.0)
    for step in range(3):
        request = snapshot.snapshot_request(_request(tmp_path, tensors, f"s{step}"), False, pool)
        expected = [t.clone() for t in tensors]
        for t in tensors:
            t.add_(1.0)
        for got, want in zip(_sorted(_written(request)), expected):
            assert torch.equal(got, want), f"save {step} wrote other values"
        _release(request)


def check_two_saves_in_flight(tmp_path, pool: StagingPool) -> None:
    """A second save scheduled before the first is finalized: the first's buffers keep the
    first moment's values."""
    tensors = _values(0.0)
    first = snapshot.snapshot_request(_request(tmp_path, tensors, "a"), False, pool)
    expected = [t.clone() for t in tensors]
    for t in tensors:
        t.add_(1.0)
    second = snapshot.snapshot_request(_request(tmp_path, tensors, "b"), False, pool)
    for got, want in zip(_sorted(_written(first)), expected):
        assert torch.equal(got, want), "the second save overwrote a buffer the first reads"
    for got, want in zip(_sorted(_written(second)), tensors):
        assert torch.equal(got, want)
    _release(first)
    _release(second)


class FirstOnlyPool(StagingPool):
    """Wrong: copies into the buffers only when they are allocated (the first save)."""

    def targets(self, staging, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out, self.new = staging.targets(tensors)
        return out

    def fill(self, copies) -> None:
        if self.new:
            super().fill(copies)


class SingleSetPool(StagingPool):
    """Wrong: one segment, handed out again while a save still holds it."""

    def acquire(self, shared: bool) -> ArenaSet:
        if not hasattr(self, "only"):
            self.only = ArenaSet()
        return self.only

    def release(self, staging) -> None:
        pass


def test_every_save_writes_its_own_moment(cpu_world, tmp_path):
    check_copies_every_save(tmp_path, StagingPool())


def test_copy_only_on_the_first_save_is_caught(cpu_world, tmp_path):
    with pytest.raises(AssertionError, match="save 1 wrote other values"):
        check_copies_every_save(tmp_path, FirstOnlyPool())


def test_skipping_tensors_nobody_else_holds_is_caught(cpu_world, tmp_path, monkeypatch):
    """megatron-core's bucket holds ``tensor.detach()``: a new tensor object that only the
    bucket references, sharing the trainer's storage."""
    # Calibrate: how many references a tensor that only the request holds has there.
    seen: list[int] = []
    monkeypatch.setattr(snapshot, "needs_copy",
                        lambda tensor, forked: seen.append(sys.getrefcount(tensor)) or True)
    snapshot.snapshot_request(_request(tmp_path, _values(0.0), "calibrate"), False,
                              StagingPool())
    alone = min(seen)
    monkeypatch.setattr(snapshot, "needs_copy",
                        lambda tensor, forked: sys.getrefcount(tensor) > alone)
    with pytest.raises(AssertionError, match="save 0 wrote other values"):
        check_copies_every_save(tmp_path, StagingPool())


def test_two_saves_in_flight_get_two_sets(cpu_world, tmp_path):
    pool = StagingPool()
    check_two_saves_in_flight(tmp_path, pool)
    assert pool.stats.bytes_allocated == 2 * 3 * ELEMENTS * 4  # double-buffered, then kept
    check_two_saves_in_flight(tmp_path, pool)
    assert pool.stats.bytes_allocated == 2 * 3 * ELEMENTS * 4


def test_reusing_a_buffer_a_pending_writer_reads_is_caught(cpu_world, tmp_path):
    with pytest.raises(AssertionError, match="overwrote a buffer the first reads"):
        check_two_saves_in_flight(tmp_path, SingleSetPool())


def test_buffers_are_kept_across_saves(cpu_world, tmp_path):
    pool = StagingPool()
    tensors = _values(0.0)
    first = snapshot.snapshot_request(_request(tmp_path, tensors, "a"), False, pool)
    pointers = {t.data_ptr() for t in _written(first)}
    _release(first)
    second = snapshot.snapshot_request(_request(tmp_path, tensors, "b"), False, pool)
    assert {t.data_ptr() for t in _written(second)} == pointers
    assert pool.stats.saves == 2 and pool.stats.bytes_allocated == 3 * ELEMENTS * 4


def test_a_persistent_worker_gets_one_segment_and_writes_exact_storages(cpu_world, tmp_path):
    """The request holds views of one shared segment (one descriptor to pickle); what the
    worker writes after the preload step holds storages of exactly each tensor's bytes
    (torch.save writes a whole storage), over the segment's memory (no copy)."""
    tensors = _values(0.0) + [torch.arange(5, dtype=torch.int8)]  # sizes off the alignment
    request = snapshot.snapshot_request(_request(tmp_path, tensors, "a"), False, StagingPool())
    held = [t for _, _, (_, ts) in request.async_fn_args[1] for _, t in ts]
    assert len({t.untyped_storage().data_ptr() for t in held}) == 1
    assert all(t.is_shared() for t in held)  # the persistent worker's pickle sends its fd
    written = _written(request)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in written)
    assert {t.data_ptr() for t in written} == {t.data_ptr() for t in held}
    def key(t: torch.Tensor) -> tuple:
        return len(t), float(t[0])

    for got, want in zip(sorted(written, key=key), sorted(tensors, key=key)):
        assert torch.equal(got, want)


def test_writing_the_segment_views_as_they_are_is_caught(tmp_path):
    """Wrong: the worker writes the views themselves: torch.save writes the whole segment
    for each of them."""
    import io

    segment = ArenaSet()
    views, _ = segment.targets([torch.zeros(256), torch.zeros(256)])
    sizes = {}
    for name, preload in (("views", lambda: views), ("exact", lambda: exact_storages(
            lambda: views))):
        buffer = io.BytesIO()
        torch.save(preload()[1], buffer)
        sizes[name] = len(buffer.getvalue())
    assert sizes["views"] >= sizes["exact"] + 1024


def test_the_forked_path_copies_only_what_the_fork_does_not_freeze(cpu_world,
                                                                   tmp_path):
    private, shared = _values(0.0), [t.share_memory_() for t in _values(5.0)]
    request = _request(tmp_path, private, "private")
    assert snapshot.snapshot_request(request, True, StagingPool()) is request
    staged = snapshot.snapshot_request(_request(tmp_path, shared, "shared"), True, StagingPool())
    for got in _written(staged):
        assert not got.is_shared()  # private: the fork's copy-on-write freezes it
        assert all(got.data_ptr() != t.data_ptr() for t in shared)


def test_upstream_does_not_snapshot_and_the_probe_sees_a_copy(monkeypatch):
    """Detected from upstream's preload step, never from a version."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    assert snapshot.upstream_snapshots() is None  # every supported release
    original = FileSystemWriterAsync.preload_tensors

    def copying(buckets, non_blocking=True):
        return [(f, k, (b, [(i, t.clone()) for i, t in ts]))
                for f, k, (b, ts) in original(buckets, non_blocking)]

    monkeypatch.setattr(FileSystemWriterAsync, "preload_tensors", staticmethod(copying))
    assert "already copies" in snapshot.upstream_snapshots()


def test_an_unknown_request_passes_unchanged(caplog):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    request = AsyncRequest(print, (1, 2), [])
    assert snapshot.snapshot_request(request, False) is request
    assert "without a snapshot" in caplog.text


def test_only_cpu_tensors_are_copied():
    """A device tensor is copied to host memory by upstream's own preload step before the
    trainer is released (once: not again here); a CPU-resident one (optimizer CPU offload
    on a GPU machine) needs the copy on the persistent path."""
    device_tensor = torch.empty(4, device="meta")  # stands in for a GPU tensor on CPU
    assert not snapshot.needs_copy(device_tensor, forked=False)
    assert not snapshot.needs_copy(device_tensor, forked=True)
    assert snapshot.needs_copy(torch.zeros(4), forked=False)
    assert not snapshot.needs_copy(torch.zeros(4), forked=True)
    assert snapshot.needs_copy(torch.zeros(4).share_memory_(), forked=True)


def test_an_older_request_type_passes_unchanged():
    """megatron-core still accepts requests of an older layout (local checkpointing's):
    without a preload step there is nothing of the writer's to recognise."""
    from collections import namedtuple

    Old = namedtuple("Old", ["async_fn", "async_fn_args", "finalize_fns"])
    request = Old(None, (), [])
    assert snapshot.snapshot_request(request, False) is request


def test_a_copy_is_exact_for_every_layout_it_meets():
    """The plain memory copy where the bytes are the values, torch's copy for views whose
    bytes are not (a transpose, a conjugate, a negative view)."""
    from megatron_ckpt_fixes.fixes.snapshot.staging import Copies

    real = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    complex_ = torch.arange(6, dtype=torch.float32) * (1 + 2j)
    for source in (real, real.t(), complex_.conj(), torch.ops.aten._neg_view(complex_),
                   torch.empty(0), torch.arange(5, dtype=torch.int8)):
        target = torch.empty(source.shape, dtype=source.dtype)
        Copies.of([target], [source]).run()
        assert torch.equal(target, source.resolve_conj().resolve_neg())


class SlowPool(StagingPool):
    """Copies slowly, or fails, on the copy's thread (a persistent worker's copy)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail

    def fill(self, copies) -> None:
        import time

        time.sleep(0.2)
        if self.fail:
            raise OSError("copy failed")
        super().fill(copies)


def _schedule(pool: StagingPool, run_preload: bool):
    """The snapshot's schedule around a caller that hands the request over and, like
    upstream's, waits for the worker's preload step (``run_preload``), or one that returns
    at once: what the trainer may change after it returns must not reach the request."""
    handed: list = []

    def original(self, request):
        handed.append(request)
        if run_preload:  # what the worker would write right after its preload step
            handed.append([t.clone() for t in _tensors(request.preload_fn())])
        return 7

    schedule = snapshot.snapshotting_schedule(snapshot.mcore_layout, pool)(original)
    return functools.partial(schedule, types.SimpleNamespace(persistent=True)), handed


@pytest.mark.parametrize("run_preload", [True, False])
def test_the_copy_overlaps_the_hand_over_and_is_over_when_scheduling_returns(
        cpu_world, tmp_path, run_preload):
    """The copy runs on a thread while the request is handed over; the worker's preload step
    waits for it, and scheduling returns only once it is over (even if the caller did not
    wait for the preload step). Wrong fixes caught: the worker not waiting (it would write
    zeros: the segment is fresh), scheduling returning before the copy's end."""
    tensors = _values(0.0)
    expected = [t.clone() for t in tensors]
    schedule, handed = _schedule(SlowPool(), run_preload)
    assert schedule(_request(tmp_path, tensors, "overlap")) == 7
    for t in tensors:
        t.add_(1.0)  # the trainer's next step, right after scheduling returned
    request = handed[0]
    written = handed[1] if run_preload else _tensors(request.preload_fn())
    for got, want in zip(_sorted(written), expected):
        assert torch.equal(got, want)
    _release(request)


def test_a_failed_copy_raises_on_the_trainer_and_the_worker_writes_nothing(cpu_world,
                                                                          tmp_path):
    from megatron_ckpt_fixes.fixes.snapshot.overlap import SnapshotCopyError

    schedule, handed = _schedule(SlowPool(fail=True), run_preload=False)
    with pytest.raises(OSError, match="copy failed"):
        schedule(_request(tmp_path, _values(0.0), "failed"))
    with pytest.raises(SnapshotCopyError, match="did not complete"):
        handed[0].preload_fn()
