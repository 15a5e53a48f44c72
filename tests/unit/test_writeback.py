"""Each large item of a checkpoint file is handed to the disk once it is in the file
(megatron_ckpt_fixes.speedups.writeback), through megatron-core's own writer on one gloo rank.

What it must not do, and is checked: hint a range the file does not hold yet (bytes still in
the stream's buffer), miss an item's bytes, or spend a call on small items; every checkpoint
the other tests save and load bitwise is written with it (a default feature). Whether it
pays off is a benchmark's question (benchmarks/bench_realistic_save.py prints the raw write
both ways), not a test's.
"""

from __future__ import annotations

import io
import os

import pytest
import torch

from megatron_ckpt_fixes.speedups import writeback

LARGE = 1 << 20  # float32 elements: 4 MiB


@pytest.fixture
def writing_back(single_rank_group):
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install(["compat.cpu", "writeback"])
    yield
    megatron_ckpt_fixes.uninstall()


def _save(path, tensors: dict[str, torch.Tensor]) -> None:
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor

    path.mkdir()
    dc.save({k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}, str(path))


def _records(path) -> dict[str, tuple[str, int, int]]:
    """Each saved tensor's (file, offset, length) in the checkpoint, from its .metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    return {index.fqn: (info.relative_path, info.offset, info.length)
            for index, info in FileSystemReader(str(path)).read_metadata().storage_data.items()}


def test_the_hint_is_given_on_this_platform(tmp_path):
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * LARGE)
        assert writeback.start_writeback(f, 0, LARGE)
    assert not writeback.start_writeback(io.BytesIO(b"x"), 0, 1)  # no descriptor: nothing


def _recording(log, hint):
    """``hint`` (the real ``start_writeback`` or a wrong one), logging each call and whether
    the hinted bytes were in the file by then, to ``log``: megatron-core 0.16 writes in
    forked processes."""

    def record(stream, start: int, end: int) -> bool:
        handed = hint(stream, start, end)
        in_file = os.fstat(stream.fileno()).st_size >= end
        with open(log, "a") as f:
            f.write(f"{os.path.basename(stream.name)} {start} {end} {handed} {in_file}\n")
        return handed

    return record


def _calls(log) -> list[tuple[str, int, int, bool, bool]]:
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [(n, int(s), int(e), h == "True", i == "True")
                for n, s, e, h, i in (line.split() for line in f)]


def test_each_large_item_is_handed_over_once_it_is_in_the_file(writing_back, tmp_path,
                                                               monkeypatch):
    log = tmp_path / "hints"
    monkeypatch.setattr(writeback, "start_writeback",
                        _recording(log, writeback.start_writeback))
    large = ("a", "b", "c", "d")  # more than the writer's files: some lie after another
    tensors = {**{k: torch.randn(LARGE) for k in large}, "small": torch.randn(16)}
    _save(tmp_path / "ckpt", tensors)
    calls, records = _calls(log), _records(tmp_path / "ckpt")
    assert any(offset > 0 for key, (_, offset, _) in records.items() if key in large), records
    assert all(handed and in_file for *_, handed, in_file in calls), calls
    covered = {key for key, (name, offset, length) in records.items()
               for file, start, end, *_ in calls
               if file == name and start <= offset and offset + length <= end}
    assert covered == set(large), (records, calls)
    assert len(calls) == len(large), calls  # none for the small item
