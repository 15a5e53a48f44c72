"""Every load checks the bytes it deserializes against the checksums recorded at save time.

Single process, plain torch DCP loads of a checkpoint megatron-core saved with the checksums
feature. The reader's file system (torch's ``FileSystemReader.fs``, its extension point) is
replaced by one whose file serves different bytes on different reads of one position: a read
that goes wrong once (a flaky network file system, a file rewritten while it is read). The
load must either fail or give exactly the saved values, whichever read goes wrong, which
holds only if the bytes hashed are the bytes deserialized: hashing a second read of the
range, before or after the one deserialized, fails one of the two cases.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckpt_files import flip_tensor_byte, storage_entry
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem

import megatron_ckpt_fixes
from megatron_ckpt_fixes.fixes.checksums import SIDECAR
from megatron_ckpt_fixes.fixes.checksums.reader import ItemChecksumError

W = torch.arange(50_000, dtype=torch.float32)  # large: the item is a torch.save archive of it


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """megatron-core checkpoints of ``W``: with the checksums feature, and without."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    root = tmp_path_factory.mktemp("reader")
    dist.init_process_group("gloo", init_method=f"file://{root / 'rdzv'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        for name, features in (("ckpt", None),
                               ("plain", [f for f in megatron_ckpt_fixes.FEATURES
                                          if f != "checksums"])):
            megatron_ckpt_fixes.uninstall()
            megatron_ckpt_fixes.install(features)
            (root / name).mkdir()
            dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", W.clone())},
                                    str(root / name))
    finally:
        megatron_ckpt_fixes.uninstall()
        dist.destroy_process_group()
    return root


@pytest.fixture
def checksums(clean_install):
    clean_install.install(["checksums"])
    return clean_install


class _ChangingFile:
    """A data file whose byte at ``position`` reads flipped on the reads ``bad(n)`` says
    (n: 0 for the first read that covers it)."""

    def __init__(self, raw, position: int, bad) -> None:
        self.raw, self.position, self.bad, self.covering_reads = raw, position, bad, 0

    def _deliver(self, start: int, data: bytes) -> bytes:
        if start <= self.position < start + len(data):
            if self.bad(self.covering_reads):
                at = self.position - start
                data = data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]
            self.covering_reads += 1
        return data

    def read(self, size: int = -1) -> bytes:
        start = self.raw.tell()
        return self._deliver(start, self.raw.read(size))

    def readinto(self, buffer) -> int:
        start = self.raw.tell()
        data = self._deliver(start, self.raw.read(len(buffer)))
        buffer[:len(data)] = data
        return len(data)

    def __getattr__(self, name):
        return getattr(self.raw, name)


class _ChangingFileSystem(FileSystem):
    def __init__(self, position: int, bad) -> None:
        super().__init__()
        self.position, self.bad = position, bad

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _ChangingFile(stream, self.position, self.bad) if str(path).endswith(
                ".distcp") else stream


def _load(path, fs=None) -> torch.Tensor:
    reader = FileSystemReader(str(path))
    if fs is not None:
        reader.fs = fs
    target = {"w": torch.zeros_like(W)}
    dcp.load(target, storage_reader=reader)
    return target["w"]


def _middle_of_w(path) -> int:
    info = storage_entry(path, "w", (0,))
    return info.offset + info.length // 2  # inside the tensor's raw bytes


def test_a_flipped_byte_fails_the_load(saved, tmp_path, checksums):
    """No ``verify`` before: the load itself checks (upstream loads the flipped value)."""
    path = shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    file = flip_tensor_byte(path, "w", (0,))
    with pytest.raises(CheckpointException) as raised:
        _load(path)
    [(error, _trace)] = raised.value.failures.values()
    assert isinstance(error, ItemChecksumError)
    info = storage_entry(path, "w", (0,))
    assert (f"'w' chunk at (0,) in {file} (bytes {info.offset}..{info.offset + info.length}):"
            " checksum mismatch (recorded ") in str(error)
    checksums.uninstall()
    assert not torch.equal(_load(path), W)  # the upstream twin: silently wrong


@pytest.mark.parametrize("bad_reads, outcome", [
    (lambda n: n == 0, "fails"),   # the read that is deserialized must be the one hashed
    (lambda n: n > 0, "exact"),    # ... and no other read may be hashed instead
], ids=["first-read-wrong", "later-reads-wrong"])
def test_the_bytes_checked_are_the_bytes_deserialized(saved, checksums, bad_reads, outcome):
    fs = _ChangingFileSystem(_middle_of_w(saved / "ckpt"), bad_reads)
    if outcome == "fails":
        with pytest.raises(CheckpointException, match="checksum mismatch"):
            _load(saved / "ckpt", fs)
    else:
        assert torch.equal(_load(saved / "ckpt", fs), W)
    assert fs.position and _load(saved / "ckpt").equal(W)


def test_the_upstream_reader_deserializes_a_read_that_went_wrong(saved, clean_install):
    """The twin of the first case: upstream gives the wrong value, no error."""
    fs = _ChangingFileSystem(_middle_of_w(saved / "ckpt"), lambda n: n == 0)
    assert not torch.equal(_load(saved / "ckpt", fs), W)


def test_without_a_record_the_load_is_unchecked_with_one_info_line(saved, checksums, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_ckpt_fixes.fixes.checksums.reader"):
        assert torch.equal(_load(saved / "plain"), W)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"loading {saved / 'plain'} without checking its bytes: no checksum "
                     "record (saved without the checksums feature)"], lines


def test_a_record_of_another_save_is_not_used(saved, tmp_path, checksums, caplog):
    path = shutil.copytree(saved / "plain", tmp_path / "plain")
    shutil.copy(saved / "ckpt" / SIDECAR, path / SIDECAR)  # left by an earlier save
    with caplog.at_level(logging.INFO, logger="megatron_ckpt_fixes.fixes.checksums.reader"):
        assert torch.equal(_load(path), W)
    assert [r.getMessage() for r in caplog.records] == [
        f"loading {path} without checking its bytes: {SIDECAR} belongs to another save of "
        "this directory"]
