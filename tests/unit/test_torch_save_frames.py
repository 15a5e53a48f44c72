"""The speed-up torch_save_frames: torch.save's framing replayed, the same bytes as
torch's own save, used from a layout's third save on, never where the framing could differ.

Wrong fixes each check catches: a replay never used (nothing gained), a replay from the
first record on (a framing that changes per call would be replayed unchecked), a layout key
that misses the storage offset or size (another layout's framing: wrong bytes), and a replay
outside a checksummed record or of a tensor whose pickle carries more than its layout.
"""

from __future__ import annotations

import io

import pytest
import torch

from megatron_ckpt_fixes.speedups import torch_save_frames as frames
from megatron_ckpt_fixes.fixes.checksums import writer


def replay_allowed():
    """Inside a checksummed record, as the checksums feature's writer makes one."""
    return writer._without_torch_crc32(None)


@pytest.fixture
def crc_off():
    """torch's CRC-32 off, as inside the checksums feature's records; frames forgotten."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    frames._frames.clear()
    yield
    frames._frames.clear()
    torch.serialization.set_crc32_options(before)


def _counting_save() -> tuple[list[int], object]:
    calls: list[int] = []

    def original(obj, f, *args, **kwargs):
        calls.append(1)
        torch.save(obj, f, *args, **kwargs)

    return calls, frames.replaying_save(original)


def _bytes(save, tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    with replay_allowed():
        save(tensor, buffer)
    return buffer.getvalue()


def _torch_bytes(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _layouts(seed: int) -> list[torch.Tensor]:
    """Tensors of distinct layouts, their values drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(600_000, generator=g)
    base = torch.randn(64, 48, generator=g)
    return [big, big[1000:301_000], base, base.t(), base[3:40],  # offsets and strides
            base[1:], base[:-1], big[:1000], torch.randn(1000, generator=g),  # offset, size
            base.to(torch.bfloat16), torch.randint(0, 9, (5, 7), generator=g),
            torch.randint(0, 9, (33,), generator=g).to(torch.uint16),  # torch's v3 dtypes
            torch.rand(17, generator=g) > 0.5, torch.tensor(float(seed)), torch.randn(3, generator=g)]


def test_a_replay_writes_torchs_own_bytes_from_a_layouts_third_save(crc_off):
    calls, save = _counting_save()
    for seed in range(4):
        tensors = _layouts(seed)
        before = len(calls)
        for tensor in tensors:
            written = _bytes(save, tensor)
            assert written == _torch_bytes(tensor)
            loaded = torch.load(io.BytesIO(written))
            assert torch.equal(loaded, tensor) and loaded.stride() == tensor.stride()
        # torch's own save for the first two saves of each layout, replays after
        assert len(calls) - before == (len(tensors) if seed < 2 else 0)


def test_a_failure_of_its_own_falls_back_to_torchs_save(crc_off, monkeypatch, caplog):
    """A torch that no longer behaves as the layout check expects (here: the check raising)
    must not fail the save inside the writer: torch's own save runs, logged once."""
    calls, save = _counting_save()

    def renamed(_obj):
        raise AttributeError("module 'torch._utils' has no attribute '_get_obj_state'")

    monkeypatch.setattr(frames, "layout_of", renamed)
    monkeypatch.setattr(frames, "_failed", [])
    tensor = torch.randn(100)
    for _ in range(3):
        assert _bytes(save, tensor) == _torch_bytes(tensor)
    assert len(calls) == 3
    assert caplog.text.count("falls back to torch.save") == 1


def test_what_it_reads_is_declared_and_a_missing_one_skips_it_loudly(clean_install,
                                                                   monkeypatch):
    """A torch whose serialization setting the layout depends on is renamed: the speed-up
    is skipped, naming it, and every fix is installed."""
    import dataclasses

    assert frames.PATCHES[0].reads == frames.READS
    renamed = dataclasses.replace(
        frames.PATCHES[0], reads=("torch.utils.serialization.config:save.renamed_alignment",))
    monkeypatch.setattr(frames, "PATCHES", (renamed,))
    clean_install.install(["compat.cpu", "checksums", "torch_save_frames"])
    why = clean_install.installed()["torch_save_frames.save"]
    assert why.startswith("not applied: optional") and "renamed_alignment" in why
    assert "checksums.write_item" in clean_install.installed()


def test_a_framing_that_varies_between_saves_is_never_replayed(crc_off):
    count = [0]

    def stamped(obj, f):  # torch's framing plus a per-call mark (a counter, a timestamp)
        count[0] += 1
        torch.save({"t": obj, "n": count[0]}["t"], f)
        f.write(str(count[0]).encode())

    save = frames.replaying_save(stamped)
    tensor = torch.randn(1000)
    outputs = [_bytes(save, tensor) for _ in range(4)]
    assert count[0] == 4
    assert [o[-1:] for o in outputs] == [b"1", b"2", b"3", b"4"]


@pytest.mark.parametrize("case", ["outside a record", "requires grad", "parameter",
                                  "python state", "extra argument"])
def test_torchs_own_save_wherever_the_framing_could_say_more(crc_off, case):
    calls, save = _counting_save()
    tensor = torch.randn(100, 10)
    if case == "requires grad":
        tensor.requires_grad_()
    elif case == "parameter":
        tensor = torch.nn.Parameter(tensor)
    elif case == "python state":
        tensor.tensor_model_parallel = True
    for _ in range(3):
        buffer = io.BytesIO()
        if case == "outside a record":
            save(tensor, buffer)
        else:
            with replay_allowed():
                if case == "extra argument":
                    save(tensor, buffer, _disable_byteorder_record=True)
                else:
                    save(tensor, buffer)
    assert len(calls) == 3


@pytest.mark.parametrize("numel", [100_000, 1000])  # through the checksum's tap; in memory
def test_megatron_cores_writer_replays_and_its_records_load_bitwise(numel):
    """megatron-core's ``_write_item`` as its writer calls it, after ``install``: from the
    third record of a layout on, replayed; every record loads bitwise with plain torch and
    carries the checksum of its bytes as written."""
    import megatron_ckpt_fixes
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.filesystem import (SerializationFormat,
                                                         _StorageWriterTransforms)
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from megatron_ckpt_fixes.fixes.checksums.hashing import checksum_of

    frames._frames.clear()
    megatron_ckpt_fixes.install(["compat.cpu", "checksums", "torch_save_frames"])
    try:
        assert "torch_save_frames.save" in megatron_ckpt_fixes.installed()
        for seed in range(3):
            tensor = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
            stream = io.BytesIO()
            result = filesystem_async._write_item(
                _StorageWriterTransforms(), stream, tensor,
                WriteItem(MetadataIndex("t"), WriteItemType.TENSOR), "key",
                SerializationFormat.TORCH_SAVE)
            record = stream.getvalue()
            assert torch.equal(torch.load(io.BytesIO(record), weights_only=True), tensor)
            assert result.checksum[1] == checksum_of(record)
        assert frames._frames[frames.layout_of(tensor)][1]  # replayed from the third on
    finally:
        megatron_ckpt_fixes.uninstall()
        frames._frames.clear()
