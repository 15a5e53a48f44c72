"""The reader that reads only the saved rows a rank asks for, by byte range of the chunks'
records in a real torch DCP checkpoint (``megatron_ckpt_fixes.reshard.saved_chunks``).

Checked against DCP's own load, bitwise: ranges across chunk boundaries, scattered gathers,
records at unaligned file offsets, bf16 rows of odd width, 1-D fp16. A record that is not a
plain ``torch.save`` record (compressed member, big-endian, non-contiguous, stream
transform, damaged header, cut file, metadata that disagrees) is read through DCP with the
reason, or refused, never read as raw bytes. The trivial wrong fixes are caught here: reading
the whole chunk anyway (DCP's load, a whole-chunk read or a whole map: bytes read and page
faults are counted), trusting ``torch.load``'s storage offset without the zip's own headers
(a compressed member would read as garbage), and gathering by position instead of by index.
"""

from __future__ import annotations

import io
import logging
import os
import resource
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

from megatron_ckpt_fixes.reshard import CheckpointRows, NotPlainRecord, read_rows
from megatron_ckpt_fixes.reshard.records import locate
from dcp_records import big_endian, deflated, rewrite_record, storage, write_metadata

pytestmark = pytest.mark.varies_with("torch", "python")

BOUNDS = (0, 7, 20, 33)  # three chunks of uneven sizes


def _chunked(full: torch.Tensor) -> object:
    """``full`` as a row-wise ShardedTensor of one rank holding three chunks."""
    shards = [Shard(full[a:b].clone(), ShardMetadata([a] + [0] * (full.dim() - 1), [b - a, *full.shape[1:]],
                                                    "rank:0/cpu")) for a, b in zip(BOUNDS, BOUNDS[1:])]
    return init_from_local_shards(shards, *full.shape)


def _columns() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = BOUNDS[-1]
    return {"ids": torch.randint(-(1 << 62), 1 << 62, (n,), generator=g),
            "emb": torch.randn(n, 16, generator=g),
            "odd": torch.randn(n, 3, generator=g).to(torch.bfloat16),  # 6-byte rows
            "half": torch.randn(n, generator=g).to(torch.float16)}


def _dcp_rows(ckpt: str, key: str, start: int, n: int, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty((n, *like.shape[1:]), dtype=like.dtype)
    read_rows(ckpt, {key: (start, out)})
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture
def chunked_checkpoint(tmp_path, single_rank_group):
    ckpt = str(tmp_path / "ckpt")
    columns = _columns()
    dcp.save({k: _chunked(v) for k, v in columns.items()}, checkpoint_id=ckpt)
    return ckpt, columns


def test_byte_range_reads_equal_dcp_load_bitwise(chunked_checkpoint):
    ckpt, columns = chunked_checkpoint
    metadata = dcp.FileSystemReader(ckpt).read_metadata()
    g = torch.Generator().manual_seed(1)
    with CheckpointRows(ckpt, metadata, piece_bytes=64) as rows:  # tiny pieces: many maps per chunk
        for key, full in columns.items():
            for start, n in [(0, 33), (5, 4), (6, 15), (7, 13), (19, 14), (32, 1)]:  # across chunk bounds
                got = torch.full((n, *full.shape[1:]), 7, dtype=full.dtype)
                rows.read(key, start, got)
                assert torch.equal(_bits(got), _bits(_dcp_rows(ckpt, key, start, n, full)))
                assert torch.equal(_bits(got), _bits(full[start:start + n]))
            index = torch.randperm(30, generator=g)[:17].sort().values
            got = torch.empty((17, *full.shape[1:]), dtype=full.dtype)
            rows.gather(key, 3, index, got)
            assert torch.equal(_bits(got), _bits(full[3 + index])), f"{key}: gathered by position, not by index?"
            strided = torch.empty((full.shape[0], 2, *full.shape[1:]), dtype=full.dtype)[:17, 1]
            rows.gather(key, 3, index, strided)  # a non-contiguous destination
            assert torch.equal(_bits(strided), _bits(full[3 + index]))
        assert rows.fallbacks == {}
        offsets = {layout.data_offset % 8 for layout in rows._layouts.values()}
    assert offsets - {0}, "records at unaligned file offsets are part of the check"


def test_a_gather_reads_only_the_rows_it_needs(tmp_path):
    """The wrong fixes 'load the chunk through DCP', 'pread the whole chunk' and 'map the
    whole chunk and copy it' all move 32 MiB; a gather of three rows moves a few pages."""
    ckpt = str(tmp_path / "big")
    full = torch.randn(1 << 19, 16)  # 32 MiB in one chunk
    dcp.save({"emb": full}, checkpoint_id=ckpt, no_dist=True)
    index = torch.tensor([5, 200_000, 500_000])
    out = torch.empty(3, 16)
    with CheckpointRows(ckpt, dcp.FileSystemReader(ckpt).read_metadata()) as rows:
        rows.gather("emb", 0, index[:1], out[:1])  # the record is inspected once, before counting
        read_before, faults_before = _read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        rows.gather("emb", 0, index, out)
        read, faults = _read_bytes() - read_before, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    assert torch.equal(out, full[index])
    assert read < 64 << 10, f"{read} bytes read for 3 rows of 64 bytes"
    assert faults < 200, f"{faults} page faults for 3 rows (a whole 32 MiB chunk is 8192 pages)"


def test_records_written_without_crc32_read_by_byte_range(tmp_path):
    """torch.save's CRC-32 switched off (issue 24's writer option, on i22-writer): every CRC
    field is 0; nothing here reads them, so the rows still come by byte range."""
    ckpt = str(tmp_path / "nocrc")
    full = torch.randn(50, 8)
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        dcp.save({"emb": full}, checkpoint_id=ckpt, no_dist=True)
    finally:
        torch.serialization.set_crc32_options(before)
    out = torch.empty(7, 8)
    with CheckpointRows(ckpt, dcp.FileSystemReader(ckpt).read_metadata()) as rows:
        rows.gather("emb", 2, torch.tensor([0, 3, 5, 20, 30, 41, 47]), out)
        assert rows.fallbacks == {}
    assert torch.equal(out, full[2 + torch.tensor([0, 3, 5, 20, 30, 41, 47])])


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


# ---- records that are not plain ---------------------------------------------------------

def _damage(ckpt: str, key: str, how: str) -> None:
    metadata, index = storage(ckpt, key)
    info = metadata.storage_data[index]
    if how == "transform":
        info.transform_descriptors = ["stream.zstd/1"]
        write_metadata(ckpt, metadata)
    elif how == "dtype":
        metadata.state_dict_metadata[key].properties.dtype = torch.float64
        write_metadata(ckpt, metadata)
    elif how == "cut":  # the file ends inside the record (its record is the file's last)
        os.truncate(os.path.join(ckpt, info.relative_path), info.offset + info.length // 2)
    elif how == "header":  # the storage member's local header signature
        path = os.path.join(ckpt, info.relative_path)
        with open(path, "rb") as f:
            f.seek(info.offset)
            record = f.read(info.length)
        at = zipfile.ZipFile(io.BytesIO(record)).getinfo("archive/data/0").header_offset
        with open(path, "r+b") as f:
            f.seek(info.offset + at)
            f.write(b"XX")
    else:
        rewrite_record(ckpt, key, {"deflate": deflated, "big_endian": big_endian}[how])


# (how, words in the reason, whether DCP still loads the chunk: then the fallback must equal it)
NOT_PLAIN = [
    ("deflate", "is compressed", True),
    ("big_endian", "big-endian", True),
    ("noncontiguous", "non-contiguous", True),
    ("transform", "stream transforms", False),
    ("dtype", "the metadata says torch.float64", None),
    ("header", "no local header", False),
    ("cut", "beyond the end", False),
]


@pytest.mark.parametrize("how,words,dcp_loads", NOT_PLAIN, ids=[c[0] for c in NOT_PLAIN])
def test_a_record_that_is_not_plain_falls_back_to_dcp_with_its_reason(tmp_path, caplog, how, words, dcp_loads):
    ckpt = str(tmp_path / how)
    g = torch.Generator().manual_seed(2)
    emb, other = torch.randn(40, 8, generator=g), torch.randn(40, 8, generator=g)
    # A transposed tensor whose storage is exactly its elements: DCP saves it as it is.
    state = {"other": other, "emb": emb.t().contiguous().t() if how == "noncontiguous" else emb}
    dcp.save(state, checkpoint_id=ckpt, no_dist=True)
    if how != "noncontiguous":
        _damage(ckpt, "emb", how)
    metadata = dcp.FileSystemReader(ckpt).read_metadata()
    index = torch.tensor([1, 4, 30])
    with caplog.at_level(logging.WARNING), CheckpointRows(ckpt, metadata) as rows:
        got, picked = torch.empty(40, 8, dtype=metadata.state_dict_metadata["emb"].properties.dtype), None
        try:
            rows.read("emb", 0, got)
            picked = torch.empty(3, 8, dtype=got.dtype)
            rows.gather("emb", 0, index, picked)
            failed = None
        except BaseException as exc:  # noqa: BLE001 - DCP's own error (CheckpointException is a BaseException)
            failed = exc
        reason = rows.fallbacks.get(("emb", 0), "")
        other_rows = torch.empty(40, 8)
        rows.read("other", 0, other_rows)
        assert torch.equal(other_rows, other) and ("other", 0) not in rows.fallbacks
    assert words in reason, reason
    assert any(words in r.getMessage() and "through DCP" in r.getMessage() for r in caplog.records)
    if dcp_loads is True:
        assert failed is None, failed
        assert torch.equal(got, emb) and torch.equal(picked, emb[index])
    elif dcp_loads is False:
        assert failed is not None, f"{how}: read without an error"
    else:
        assert failed is None and torch.equal(got, emb.double())  # DCP casts, as before


def test_locate_checks_the_zip_not_only_torch_load(tmp_path):
    """``torch.load(map_location='meta')`` reports an offset for a compressed member too:
    raw bytes read from there would be deflate output, not the tensor."""
    ckpt = str(tmp_path / "deflate")
    dcp.save({"emb": torch.randn(64, 8)}, checkpoint_id=ckpt, no_dist=True)
    rewrite_record(ckpt, "emb", deflated)
    metadata, index = storage(ckpt, "emb")
    info = metadata.storage_data[index]
    fd = os.open(os.path.join(ckpt, info.relative_path), os.O_RDONLY)
    try:
        with open(os.path.join(ckpt, info.relative_path), "rb") as f:
            f.seek(info.offset)
            meta = torch.load(io.BytesIO(f.read(info.length)), map_location="meta", weights_only=True)
        assert isinstance(meta.untyped_storage()._checkpoint_offset, int)
        with pytest.raises(NotPlainRecord, match="compressed"):
            locate("emb", fd, info, torch.float32, (64, 8), 0)
    finally:
        os.close(fd)
