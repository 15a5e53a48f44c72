"""The checksum record and the checksumming write, without a process group."""

from __future__ import annotations

import inspect
import io
import pickle
import pickletools
import subprocess
import sys
import zlib

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _write_item
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from megatron_ckpt_fixes.checksums.record import (
    ChecksumRecord,
    Item,
    RecordError,
    crc32_of_range,
    share,
)
from megatron_ckpt_fixes.checksums.writer import BUFFER_LIMIT, checksummed_write_item, record_of

PARAMS = inspect.signature(_write_item).parameters


def _call_args(stream, data, name):
    """torch's arguments as megatron-core's writer passes them (positional, then kwargs)."""
    kind = WriteItemType.BYTE_IO if isinstance(data, io.BytesIO) else WriteItemType.TENSOR
    item = WriteItem(MetadataIndex(name), kind)
    args = [stream, data, item, "f.distcp"]
    if "transforms" in PARAMS:
        from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

        args.insert(0, _StorageWriterTransforms())
    kwargs = {}
    if "serialization_format" in PARAMS:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        kwargs["serialization_format"] = SerializationFormat.TORCH_SAVE
    return args, kwargs


ITEMS = [("obj", io.BytesIO(b"pickled object bytes" * 10)),
         ("small", torch.arange(16.0)),
         ("large", torch.arange(BUFFER_LIMIT // 4 + 10, dtype=torch.float32)),  # tapped
         ("after", torch.ones(3, 5))]


def _write_all(tmp_path, write, name):
    path = tmp_path / name
    with open(path, "wb") as stream:
        results = []
        for key, data in ITEMS:
            if isinstance(data, io.BytesIO):
                data.seek(0)
            args, kwargs = _call_args(stream, data, key)
            results.append(write(*args, **kwargs))
    return path, results


def test_the_file_is_byte_identical_and_each_checksum_covers_its_range(tmp_path):
    plain_path, plain = _write_all(tmp_path, _write_item, "plain.distcp")
    path, results = _write_all(tmp_path, checksummed_write_item(_write_item), "sum.distcp")
    assert path.read_bytes() == plain_path.read_bytes()
    for before, after in zip(plain, results):
        assert after.storage_data == before.storage_data and after.index == before.index
        info = after.storage_data
        assert after.crc32 == crc32_of_range(str(path), info.offset, info.length)[0]


def test_the_stream_may_come_as_a_keyword(tmp_path):
    wrapped = checksummed_write_item(_write_item)
    names = list(PARAMS)
    with open(tmp_path / "k.distcp", "wb") as stream:
        args, kwargs = _call_args(stream, torch.arange(4.0), "k")
        kwargs.update(zip(names, args))
        result = wrapped(**kwargs)
    data = (tmp_path / "k.distcp").read_bytes()
    assert result.crc32 == zlib.crc32(data) and result.storage_data.length == len(data)


def _globals_in(pickled: bytes) -> set[str]:
    """The modules a pickle makes its reader import (GLOBAL / STACK_GLOBAL opcodes)."""
    modules, strings = set(), []
    for op, arg, _ in pickletools.genops(pickled):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            modules.add(strings[-2])
        elif op.name == "GLOBAL":
            modules.add(arg.split(" ")[0])
    return modules


def test_write_results_cross_process_queues_as_upstreams_class_only(tmp_path):
    """megatron-core's spawned results manager unpickles write results in one thread per
    writer; a class of this package there made it import the package concurrently with
    torch's checkpoint modules and die of an import-lock deadlock (the persistent worker
    exited 1 in megatron-core's own test_async_save at 8 ranks). The results must need
    nothing beyond what upstream's own need, and keep their checksum across the pickle."""
    _, results = _write_all(tmp_path, checksummed_write_item(_write_item), "p.distcp")
    pickled = pickle.dumps(results)
    assert {m.split(".")[0] for m in _globals_in(pickled)} == {"torch"}, _globals_in(pickled)
    script = ("import pickle, sys; sys.modules['megatron_ckpt_fixes'] = None; "
              "print([r.crc32 for r in pickle.loads(sys.stdin.buffer.read())])")
    out = subprocess.run([sys.executable, "-c", script], input=pickled, capture_output=True,
                         check=True)
    assert out.stdout.decode().strip() == str([r.crc32 for r in results])
    assert all(type(r) is WriteResult for r in results)


def test_record_of_counts_results_without_a_checksum(tmp_path):
    _, results = _write_all(tmp_path, checksummed_write_item(_write_item), "r.distcp")
    plain = WriteResult(results[0].index, 1, results[0].storage_data)
    record, missing = record_of([results, [plain]], "save-1")
    assert missing == 1 and record.save_id == "save-1" and len(record.checksums) == len(ITEMS)


def test_the_record_round_trips_and_refuses_what_it_cannot_read():
    record = ChecksumRecord("id", {("a", 0): (10, 1), ("a", 10): (5, 2), ("b", 0): (7, 2**32 - 1)})
    assert ChecksumRecord.from_json(record.to_json()) == record
    for bad in ("{", '{"format": "other"}', record.to_json().replace('"crc32":[1,2]',
                                                                    '"crc32":[1]')):
        with pytest.raises(RecordError, match="unreadable"):
            ChecksumRecord.from_json(bad)


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_shares_partition_the_items_balanced_by_bytes(world):
    items = [Item(f"k{i}", None, f"__{i % 3}_0.distcp", i * 100, (i * 37) % 500 + 1)
             for i in range(200)]
    shares = [share(items, rank, world) for rank in range(world)]
    assert sorted((i for s in shares for i in s), key=items.index) == items  # each once
    loads = [sum(i.length for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(i.length for i in items)
    assert share(list(reversed(items)), 0, world) == shares[0]  # the same on every rank
