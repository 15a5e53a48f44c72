"""The pre-flight's rules, one per way a requested key fails to load (pure: no files, no ranks).

A request names a key, its global shape, dtype and the chunk this rank reads; the saved side is
a ``.metadata``'s ``state_dict_metadata``. Each rule is checked against the wrong fix it
catches: a check of key names only passes a shape change, a check of the global shape only
passes a chunk the saved chunks do not hold, and a check that refuses every dtype change
refuses a lossless widening (the load's own rules, :mod:`megatron_ckpt_fixes.load_casts`).
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

from megatron_ckpt_fixes.load_casts import ALLOW_ENV
from megatron_ckpt_fixes.preflight.compare import CAST, LOAD, Request, findings, summary

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
