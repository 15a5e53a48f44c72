"""torch's CRC-32 is off for the records the checksummed writer writes, and nowhere else.

``torch.serialization.set_crc32_options`` is process-wide; the checksums feature answers
False to ``get_crc32_options`` only in the thread that is serializing one of the writer's
checksummed records. Checked here with megatron-core's own ``_write_item`` (as its writer
calls it): its record has no CRC-32 (zip tools see bad CRCs), loads bitwise with plain
``torch.load``, and carries the item's checksum; a ``torch.save`` in another thread *while*
that record is being written keeps its CRC-32, and so does one in the same thread outside the
writer; the user's own setting is kept; a record that goes through a stream transform keeps
torch's CRC-32 (the checksum could not vouch for those bytes). ``MEGATRON_CKPT_FIXES_KEEP_CRC32=1``
at install keeps torch's CRC-32 in the writer's records too, still checksummed.
"""

from __future__ import annotations

import io
import threading
import zipfile

import pytest
import torch
from torch.distributed.checkpoint.filesystem import SerializationFormat, _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

TENSOR = torch.arange(100_000, dtype=torch.float32)  # above the in-memory limit: the tap


@pytest.fixture
def checksums():
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install(["compat.cpu", "checksums"])
    yield
    megatron_ckpt_fixes.uninstall()


def _crc_ok(record: bytes) -> bool:
    return zipfile.ZipFile(io.BytesIO(record)).testzip() is None


def _user_record() -> bytes:
    buffer = io.BytesIO()
    torch.save(TENSOR, buffer)
    return buffer.getvalue()


def _writer_record(stream, transforms=None):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    item = WriteItem(MetadataIndex("t"), WriteItemType.TENSOR)
    return filesystem_async._write_item(transforms or _StorageWriterTransforms(), stream,
                                        TENSOR, item, "key", SerializationFormat.TORCH_SAVE)


def test_the_writers_record_has_no_crc32_and_loads_bitwise(checksums):
    stream = io.BytesIO()
    result = _writer_record(stream)
    record = stream.getvalue()
    assert not _crc_ok(record)  # what zip tools report: bad CRC, expected 00000000
    assert torch.equal(torch.load(io.BytesIO(record), weights_only=True), TENSOR)
    assert result.checksum[0] == "xxh3_64"
    assert _crc_ok(_user_record())  # the same thread, outside the writer


class _BlockingStream(io.BytesIO):
    """A file the writer writes into, which holds its first large write until released."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.release = threading.Event(), threading.Event()

    def write(self, data) -> int:
        if memoryview(data).nbytes > 4096 and not self.inside.is_set():
            self.inside.set()
            assert self.release.wait(30)
        return super().write(data)


def test_another_thread_keeps_its_crc32_while_the_writer_writes(checksums):
    stream = _BlockingStream()
    writer = threading.Thread(target=_writer_record, args=(stream,))
    writer.start()
    assert stream.inside.wait(30)  # the writer is inside its record, CRC-32 off for it
    try:
        concurrent = _user_record()
    finally:
        stream.release.set()
        writer.join(30)
    assert _crc_ok(concurrent)
    assert not _crc_ok(stream.getvalue())


def test_the_users_own_setting_is_kept(checksums):
    torch.serialization.set_crc32_options(False)
    try:
        _writer_record(io.BytesIO())
        assert torch.serialization.get_crc32_options() is False
        assert not _crc_ok(_user_record())
    finally:
        torch.serialization.set_crc32_options(True)
    assert torch.serialization.get_crc32_options() is True


def test_a_transformed_record_keeps_torchs_crc32(checksums):
    """A transform may put other bytes into the file than the record: no checksum vouches
    for them, so torch's CRC-32 stays."""

    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class Identity(StreamTransformExtension):  # a transform that changes nothing, but is one
        @staticmethod
        def registry_name() -> str:
            return "identity"

        @staticmethod
        def from_descriptor(version: str) -> "Identity":
            return Identity()

        def get_descriptor(self) -> str:
            return "identity"

        def transform_to(self, output):
            return output

        def transform_from(self, input):
            return input

    stream = io.BytesIO()
    _writer_record(stream, _StorageWriterTransforms([Identity()]))
    assert _crc_ok(stream.getvalue())


def test_uninstall_restores_torchs_own_function():
    import megatron_ckpt_fixes

    original = torch.serialization.get_crc32_options
    megatron_ckpt_fixes.install(["compat.cpu", "checksums"])
    assert torch.serialization.get_crc32_options is not original
    megatron_ckpt_fixes.uninstall()
    assert torch.serialization.get_crc32_options is original


@pytest.mark.parametrize("value, kept", [("1", True), ("0", False)])
def test_the_switch_keeps_torchs_crc32_in_the_writers_records(monkeypatch, value, kept):
    """For tooling that checks zip CRCs: opt-in, read when install() runs; the item's
    checksum is recorded either way, and installed() says why the CRC-32 stays."""
    import megatron_ckpt_fixes
    from megatron_ckpt_fixes.fixes.checksums.writer import KEEP_CRC32_ENV

    monkeypatch.setenv(KEEP_CRC32_ENV, value)
    megatron_ckpt_fixes.install(["compat.cpu", "checksums"])
    try:
        stream = io.BytesIO()
        result = _writer_record(stream)
        assert _crc_ok(stream.getvalue()) is kept
        assert result.checksum[0] == "xxh3_64"
        why = megatron_ckpt_fixes.installed()["checksums.torch_crc32"]
        assert (KEEP_CRC32_ENV in why and why.startswith("not applied")) is kept, why
    finally:
        megatron_ckpt_fixes.uninstall()
