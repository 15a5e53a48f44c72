"""The checksum record and the checksumming write, without a process group."""

from __future__ import annotations

import inspect
import io
import json
import pickle
import pickletools
import subprocess
import sys
import zlib

import pytest
import torch
import xxhash
from torch.distributed.checkpoint.filesystem import _write_item
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from megatron_ckpt_fixes.fixes.checksums.algorithms import ALGORITHMS, DEFAULT, checksum_of_range
from megatron_ckpt_fixes.fixes.checksums.hashing import CHUNK, ItemTap
from megatron_ckpt_fixes.fixes.checksums.record import (
    ChecksumRecord,
    Item,
    RecordError,
    check_items,
    share,
)
from megatron_ckpt_fixes.fixes.checksums.writer import (
    BUFFER_LIMIT,
    CHECKSUM_ATTR,
    checksummed_write_item,
    record_of,
)

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
         ("big object", io.BytesIO(bytes(range(256)) * 1024)),  # tapped, BYTE_IO
         ("view", torch.arange(2 * BUFFER_LIMIT, dtype=torch.float32)[:BUFFER_LIMIT // 2]),
         ("after", torch.ones(3, 5))]


def _write_all(tmp_path, write, name):
    """Write ITEMS into one file as megatron-core's writer does."""
    path = tmp_path / name
    with open(path, "wb") as stream:
        results = []
        for key, data in ITEMS:
            if isinstance(data, io.BytesIO):
                data.seek(0)
            args, kwargs = _call_args(stream, data, key)
            results.append(write(*args, **kwargs))
    return path, results


def _checksum(path, info):
    return DEFAULT.name, checksum_of_range(str(path), info.offset, info.length, DEFAULT)[0]


def test_the_file_is_byte_identical_and_each_checksum_covers_its_range(tmp_path):
    plain_path, plain = _write_all(tmp_path, _write_item, "plain.distcp")
    path, results = _write_all(tmp_path, checksummed_write_item(_write_item), "sum.distcp")
    assert path.read_bytes() == plain_path.read_bytes()
    for before, after in zip(plain, results):
        assert after.storage_data == before.storage_data and after.index == before.index
        assert getattr(after, CHECKSUM_ATTR) == _checksum(path, after.storage_data)


def test_the_stream_may_come_as_a_keyword(tmp_path):
    wrapped = checksummed_write_item(_write_item)
    names = list(PARAMS)
    with open(tmp_path / "k.distcp", "wb") as stream:
        args, kwargs = _call_args(stream, torch.arange(4.0), "k")
        kwargs.update(zip(names, args))
        result = wrapped(**kwargs)
    data = (tmp_path / "k.distcp").read_bytes()
    assert result.checksum == ("xxh3_64", xxhash.xxh3_64_intdigest(data))
    assert result.storage_data.length == len(data)


def test_the_tap_writes_a_large_buffer_in_pieces_and_hashes_every_byte():
    """A write larger than ``CHUNK`` reaches the file piece by piece, each piece hashed as
    it passes: the file holds every byte in order and the checksum covers them all (a tap
    hashing only the first piece, or writing a piece twice, fails here)."""
    stream = io.BytesIO()
    tap = ItemTap(stream)
    large = torch.arange((5 * CHUNK) // 2 // 4 + 3, dtype=torch.float32)  # not a multiple
    pieces = [b"header" * 7, memoryview(large.numpy()).cast("B"), b"tail"]
    for piece in pieces:
        tap.write(piece)
    expected = b"".join(bytes(p) for p in pieces)
    assert stream.getvalue() == expected and tap.count == len(expected)
    assert tap.hasher.value() == xxhash.xxh3_64_intdigest(expected)


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
              "print([r.checksum for r in pickle.loads(sys.stdin.buffer.read())])")
    out = subprocess.run([sys.executable, "-c", script], input=pickled, capture_output=True,
                         check=True)
    assert out.stdout.decode().strip() == str([r.checksum for r in results])
    assert all(type(r) is WriteResult for r in results)


def test_record_of_counts_results_without_a_checksum(tmp_path):
    _, results = _write_all(tmp_path, checksummed_write_item(_write_item), "r.distcp")
    plain = WriteResult(results[0].index, 1, results[0].storage_data)
    record, missing = record_of([results, [plain]], "save-1")
    assert missing == 1 and record.save_id == "save-1" and len(record.checksums) == len(ITEMS)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_the_record_round_trips_and_refuses_what_it_cannot_read(algorithm):
    top = 2 ** (4 * ALGORITHMS[algorithm].digits) - 1
    record = ChecksumRecord("id", {("a", 0): (10, 1), ("a", 10): (5, 2), ("b", 0): (7, top)},
                            algorithm)
    text = record.to_json()
    assert ChecksumRecord.from_json(text) == record
    doc = json.loads(text)
    assert doc["algorithm"] == algorithm and all(  # hexadecimal: any JSON reader keeps them
        isinstance(v, str) for f in doc["files"].values() for v in f["checksum"])
    short = json.loads(text)
    short["files"]["a"]["checksum"].pop()
    unknown = {**doc, "algorithm": "md4"}
    for bad in ("{", '{"format": "other"}', json.dumps(short), json.dumps(unknown)):
        with pytest.raises(RecordError, match="unreadable"):
            ChecksumRecord.from_json(bad)


def _record_v1(record: ChecksumRecord) -> str:
    """A record as the package wrote it before xxh3 (format version 1, CRC-32 integers)."""
    files: dict = {}
    for (file, offset), (length, crc) in record.checksums.items():
        columns = files.setdefault(file, {"offset": [], "length": [], "crc32": []})
        columns["offset"].append(offset)
        columns["length"].append(length)
        columns["crc32"].append(crc)
    return json.dumps({"format": "megatron-ckpt-fixes/checksums", "version": 1,
                       "algorithm": "crc32", "save_id": record.save_id, "files": files},
                      separators=(",", ":"))


def test_records_written_before_xxh3_still_verify(tmp_path):
    """Version 1 records (CRC-32) read and check as before: a flipped byte is caught."""
    path, results = _write_all(tmp_path, _write_item, "f.distcp")  # the results' file name
    data = path.read_bytes()
    crcs = {(r.storage_data.relative_path, r.storage_data.offset):
            (r.storage_data.length, zlib.crc32(data[r.storage_data.offset:
                                                    r.storage_data.offset + r.storage_data.length]))
            for r in results}
    old = ChecksumRecord.from_json(_record_v1(ChecksumRecord("s", crcs, "crc32")))
    assert old.algorithm == "crc32" and old.checksums == crcs
    items = [Item(str(r.index.fqn), None, "f.distcp", r.storage_data.offset,
                  r.storage_data.length) for r in results]
    assert check_items(tmp_path, items, old) == ([], [])
    flipped = bytearray(data)
    flipped[items[2].offset + items[2].length // 2] ^= 0x10
    path.write_bytes(bytes(flipped))
    [mismatch], _ = check_items(tmp_path, items, old)
    assert mismatch.item == items[2] and "recorded crc32 " in mismatch.cause


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_shares_partition_the_items_balanced_by_bytes(world):
    items = [Item(f"k{i}", None, f"__{i % 3}_0.distcp", i * 100, (i * 37) % 500 + 1)
             for i in range(200)]
    shares = [share(items, rank, world) for rank in range(world)]
    assert sorted((i for s in shares for i in s), key=items.index) == items  # each once
    loads = [sum(i.length for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(i.length for i in items)
    assert share(list(reversed(items)), 0, world) == shares[0]  # the same on every rank


def test_megatron_cores_file_writer_results_leave_with_their_checksums(tmp_path):
    """With the feature installed, megatron-core's per-file writer puts results on its
    results queue that carry every item's checksum, of the bytes in the file."""
    import queue

    import megatron_ckpt_fixes
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    tensors = [torch.randn(100_000), torch.arange(8.0), torch.randn(3, 500_000)]
    items = [WriteItem(MetadataIndex(f"t{i}"), WriteItemType.TENSOR) for i in range(3)]
    transforms = []
    if "transforms" in PARAMS:
        from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

        transforms = [_StorageWriterTransforms()]
    results, count = queue.Queue(), queue.Queue()
    count.put(0)
    bucket = (str(tmp_path / "__0_0.distcp"), "__0_0.distcp", ([], list(zip(items, tensors))))
    megatron_ckpt_fixes.install(["checksums"])
    try:
        FileSystemWriterAsync.write_preloaded_data(transforms, 0, bucket, results, count, True)
    finally:
        megatron_ckpt_fixes.uninstall()
    _, written = results.get_nowait()
    assert len(written) == 3
    for result in written:
        assert result.checksum == _checksum(tmp_path / "__0_0.distcp", result.storage_data)


# -- whole files and the record's own checksum -------------------------------------------------

def _record_with_files() -> ChecksumRecord:
    return ChecksumRecord("save-1", {("__0_0.distcp", 0): (10, 0xABC), ("__0_0.distcp", 10): (5, 7)},
                          whole_files={".metadata": (120, 0x1234), "common.pt": (900, 0xFFFF)})


@pytest.mark.varies_with()
def test_a_record_with_whole_files_round_trips_with_its_own_checksum():
    record = _record_with_files()
    text = record.to_json()
    assert json.loads(text)["digest"]  # its own checksum, written with it
    assert ChecksumRecord.from_json(text) == record


@pytest.mark.varies_with()
def test_every_flipped_bit_of_a_record_is_an_error_naming_the_record():
    """Not a false item mismatch, not a pass: whichever byte changes (a value, a key, the
    checksum itself), reading the record fails and says which file is bad."""
    text = _record_with_files().to_json().encode()
    for at in range(len(text)):
        for bit in (0x01, 0x20):
            flipped = bytearray(text)
            flipped[at] ^= bit
            with pytest.raises(RecordError, match=r"^\.checksums\.json is unreadable: "):
                ChecksumRecord.from_json(flipped.decode("latin-1"))


@pytest.mark.varies_with()
def test_a_record_from_before_file_checksums_still_reads():
    """Written by the previous release: no whole files, no checksum of its own."""
    doc = json.loads(_record_with_files().to_json())
    del doc["digest"], doc["whole_files"]
    record = ChecksumRecord.from_json(json.dumps(doc))
    assert record.whole_files == {} and record.checksums == _record_with_files().checksums
    doc["whole_files"] = {}  # but file checksums without its own checksum are refused
    with pytest.raises(RecordError, match="no checksum of its own"):
        ChecksumRecord.from_json(json.dumps(doc))


@pytest.mark.varies_with()
def test_a_whole_file_is_judged_by_its_bytes(tmp_path):
    from megatron_ckpt_fixes.fixes.checksums.files import (
        FileChecksumError,
        check_file,
        check_files,
        checksum_of_bytes,
    )

    data = b"\x80\x04 a pickle of every item's place"
    record = ChecksumRecord("s", {}, whole_files={".metadata": (len(data),
                                                                checksum_of_bytes(data))})
    check_file(record, ".metadata", data)
    check_file(record, "common.pt", b"not covered: read as before")
    with pytest.raises(FileChecksumError, match=rf"^\.metadata \(bytes 0\.\.{len(data)}\): "
                                                r"checksum mismatch \(recorded xxh3_64 "):
        check_file(record, ".metadata", data[:-1] + b"X")
    (tmp_path / ".metadata").write_bytes(data[:-1])
    checked, problems = check_files(tmp_path, record)
    assert checked == 1 and problems == {".metadata": f".metadata (bytes 0..{len(data) - 1}): "
                                         f"the record says {len(data)} bytes, the file has "
                                         f"{len(data) - 1}"}


@pytest.mark.varies_with()
def test_a_record_changed_in_place_is_read_again(tmp_path):
    """Parsed once per load, but never served from memory once its file changed."""
    import os

    from megatron_ckpt_fixes.fixes.checksums.record import SIDECAR, read_record, write_record

    write_record(tmp_path, _record_with_files())
    assert read_record(tmp_path) is read_record(tmp_path)  # parsed once
    path = tmp_path / SIDECAR
    stat = path.stat()
    text = path.read_bytes()
    path.write_bytes(text.replace(b"save-1", b"save-2"))  # same size, same inode
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # clock granularity
    with pytest.raises(RecordError, match="does not match its own checksum"):
        read_record(tmp_path)
