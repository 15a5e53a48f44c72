"""The pre-flight's rules, one per way a requested key fails to load (pure: no files, no ranks).

A request names a key, its global shape, dtype and the chunk this rank reads; the saved side is
a ``.metadata``'s ``state_dict_metadata``. Each rule is checked against the wrong fix it
catches: a check of key names only passes a shape change, a check of the global shape only
passes a chunk the saved chunks do not hold, and a check that refuses every dtype change
refuses a lossless widening (the load's own rules, :mod:`megatron_ckpt_fixes.fixes.load_casts`).
The record's rules (a plain torch DCP checkpoint, one process): required, it must exist, be
this save's and cover every requested item; a whole file that differs from it always fails.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from megatron_ckpt_fixes.fixes.load_casts import ALLOW_ENV
from megatron_ckpt_fixes.tools.preflight.compare import CAST, LOAD, Request, findings, summary

pytestmark = pytest.mark.varies_with("torch")


def _tensor(shape, dtype=torch.float32, chunks=None) -> TensorStorageMetadata:
    chunks = chunks or [((0,) * len(shape), shape)]
    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s))
                                  for o, s in chunks])


SAVED = {
    "w": _tensor((4, 6), chunks=[((0, 0), (2, 6)), ((2, 0), (2, 6))]),
    "half": _tensor((4,), torch.bfloat16),
    "obj/shard_0_1": BytesStorageMetadata(),
}


def _w(offset=(0, 0), size=(2, 6), shape=(4, 6), dtype=torch.float32, **kw) -> Request:
    return Request("w", shape, dtype, offset, size, **kw)


def test_a_template_of_what_was_saved_has_no_findings(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    requests = [_w(), _w((2, 0)), Request("obj/shard_0_1"),
                Request("half", (4,), torch.float32, (0,), (4,))]  # widening: exact
    assert findings(requests, SAVED) == []


def test_a_missing_key_is_named_once():
    found = findings([Request("opt.exp_avg.emb", (4,), torch.float32, (0,), (4,)),
                      Request("opt.exp_avg.emb", (4,), torch.float32, (0,), (4,)),
                      Request("obj/shard_1_2")], SAVED)
    assert [(f.key, f.kind) for f in found] == [("opt.exp_avg.emb", LOAD),
                                                ("obj/shard_1_2", LOAD)]
    assert str(found[0]) == "'opt.exp_avg.emb': not in the checkpoint (it was saved without " \
                            "this key)"


def test_the_other_kind_is_named():
    found = findings([Request("w"), Request("obj/shard_0_1", (1,), torch.float32, (0,), (1,))],
                     SAVED)
    assert [f.cause for f in found] == ["saved as a tensor, the template asks for an object",
                                        "saved as an object, the template asks for a tensor"]


@pytest.mark.parametrize("request_, cause", [
    (_w(shape=(4, 8)), "saved with global shape (4, 6), the template has (4, 8)"),
    (_w(shape=(24,), offset=(0,), size=(12,)),
     "saved with 2 dimension(s) (4, 6), the template has 1 (24,)"),
    (_w(offset=(3, 0)), "the requested chunk (3, 0)..(5, 6) lies outside the saved shape (4, 6)"),
], ids=["global-shape", "dimensions", "chunk-outside"])
def test_shape_and_chunk_bounds(request_, cause):
    assert [f.cause for f in findings([request_], SAVED)] == [cause]


def test_a_chunk_the_saved_chunks_do_not_hold():
    """The global shape matches but the saved chunks hold half of it (a save that lost a
    rank's chunk): a check of the global shape alone would pass it."""
    saved = {"w": _tensor((4, 6), chunks=[((0, 0), (2, 6))])}
    assert findings([_w()], saved) == []
    assert [f.cause for f in findings([_w((1, 0))], saved)] == [
        "the saved chunks hold 6 of the 12 element(s) of the requested chunk (1, 0)..(3, 6)"]


def test_allow_shape_mismatch_keeps_upstreams_contract():
    assert findings([_w(shape=(5, 6), size=(5, 6), flexible_shape=True)], SAVED) == []


def test_a_lossy_cast_is_the_loads_own_refusal(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    found = findings([_w(dtype=torch.bfloat16), Request("half", (4,), torch.float16, (0,),
                                                        (4,))], SAVED)
    assert [(f.key, f.kind) for f in found] == [("w", CAST)]
    assert found[0].cause.startswith("LossyCastError: 'w' saved as torch.float32, the template "
                                     "is torch.bfloat16: loading would round its values (and 1 "
                                     "more key(s)")
    monkeypatch.setenv(ALLOW_ENV, "1")
    assert findings([_w(dtype=torch.bfloat16)], SAVED) == []


def test_a_ranks_line_shows_three_findings_and_counts_the_rest():
    found = findings([Request(f"k{i}") for i in range(5)], SAVED)
    assert summary(found) == ("'k0': not in the checkpoint (it was saved without this key); "
                              "'k1': not in the checkpoint (it was saved without this key); "
                              "'k2': not in the checkpoint (it was saved without this key) "
                              "(and 2 more key(s))")


# -- the checksum record's rules (metadata only: the record, and the whole files it covers) --


@pytest.fixture
def dcp_ckpt(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"a": torch.ones(4), "b": torch.zeros(2)}, checkpoint_id=str(tmp_path),
             no_dist=True)
    return tmp_path


def _record(ckpt, keys, save_id=None, metadata_checksum=None) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_ckpt_fixes.fixes.checksums.files import read_back
    from megatron_ckpt_fixes.fixes.checksums.record import (
        ChecksumRecord,
        items_of,
        save_id_of,
        write_record,
    )

    metadata = FileSystemReader(str(ckpt)).read_metadata()
    length, checksum = read_back(ckpt / ".metadata")
    write_record(ckpt, ChecksumRecord(
        save_id_of(metadata) if save_id is None else save_id,
        {(i.file, i.offset): (i.length, 0) for i in items_of(metadata) if i.key in keys},
        whole_files={".metadata": (length, checksum if metadata_checksum is None
                                   else metadata_checksum)}))


def _record_findings(ckpt, keys, required):
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_ckpt_fixes.tools.preflight.records import record_findings

    status, files, found = record_findings(ckpt, FileSystemReader(str(ckpt)).read_metadata(),
                                           keys, required)
    return status, files, [str(f) for f in found]


def test_no_record_fails_only_where_it_is_required(dcp_ckpt):
    assert _record_findings(dcp_ckpt, {"a"}, False) == ("absent", 0, [])
    assert _record_findings(dcp_ckpt, {"a"}, True) == ("absent", 0, [
        "checksum record: absent (.checksums.json missing: saved without the checksums "
        "feature); the check was asked for"])


def test_a_record_of_another_save_is_no_record(dcp_ckpt):
    """A check of "is there a .checksums.json" alone passes a record an earlier save left."""
    _record(dcp_ckpt, {"a", "b"}, save_id="another save")
    assert _record_findings(dcp_ckpt, {"a"}, False) == ("stale", 0, [])
    status, _, found = _record_findings(dcp_ckpt, {"a"}, True)
    assert status == "stale" and found == [
        "checksum record: not checked (.checksums.json belongs to another save of this "
        "directory, not to its .metadata); the check was asked for"]


def test_the_record_must_cover_the_requested_items(dcp_ckpt):
    _record(dcp_ckpt, {"a"})
    assert _record_findings(dcp_ckpt, {"a"}, True) == ("verified", 1, [])
    assert _record_findings(dcp_ckpt, {"a", "b"}, True)[2] == [
        "checksum record: 1 requested item(s) have no checksum; the check was asked for"]
    assert _record_findings(dcp_ckpt, {"a", "b"}, False)[2] == []


def test_a_whole_file_that_differs_from_its_record_fails_even_unrequired(dcp_ckpt):
    _record(dcp_ckpt, {"a", "b"}, metadata_checksum=1)
    _, files, found = _record_findings(dcp_ckpt, {"a"}, False)
    assert files == 1 and len(found) == 1 and found[0].startswith(".metadata (bytes 0..")
    assert "checksum mismatch (recorded" in found[0]
