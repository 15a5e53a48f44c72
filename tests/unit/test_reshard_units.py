"""Single-process pieces of the ZCH resharder: layout validation, lookup, ownership, packing."""

from __future__ import annotations

import pytest
import torch

from megatron_ckpt_fixes.reshard import (
    MISS_ID, BlockOwnership, ModuloOwnership, ReshardError, SlotRanges, TableShard,
)
from megatron_ckpt_fixes.reshard.exchange import pack_blocks, unpack_blocks, word_for
from megatron_ckpt_fixes.reshard.resharder import _keep_mask
from reshard_upstream import slot_routed_tables


def table(start: int, ids: list[int], slots: list[int], size: int) -> TableShard:
    """A valid-by-construction shard: given real ids/slots, padding takes the free slots."""
    free = sorted(set(range(start, start + size)) - set(slots))
    return TableShard(start, torch.tensor(ids + [MISS_ID] * (size - len(ids))),
                      torch.tensor(slots + free))


def test_slot_ranges_from_chunks_names_gaps_overlaps_and_empty_ranks():
    assert SlotRanges.from_chunks("t", [(0, 3), (3, 5)], "saved").bounds == (0, 3, 8)
    with pytest.raises(ReshardError, match=r"'t'.*gap at rank 1.*starts at 4.*ends at 3"):
        SlotRanges.from_chunks("t", [(0, 3), (4, 5)], "saved")
    with pytest.raises(ReshardError, match="overlap at rank 1"):
        SlotRanges.from_chunks("t", [(0, 3), (2, 5)], "saved")
    with pytest.raises(ReshardError, match="rank 1 is empty"):
        SlotRanges.from_chunks("t", [(0, 3), (3, 0)], "saved")
    with pytest.raises(ValueError):
        SlotRanges((1, 4))


def test_slot_ranges_even_split_and_uneven_sizes():
    assert SlotRanges.even(10, 3).bounds == (0, 4, 7, 10)
    r = SlotRanges((0, 2, 7, 9))
    assert (r.size(1), r.miss_slot(1), r.world_size, r.total) == (5, 6, 3, 9)


def test_lookup_is_torchrec_remap_and_misses_hit_the_last_slot():
    t = table(10, [5, 9, 40], [12, 10, 11], 5)
    assert t.lookup(torch.tensor([9, 5, 40, 6, 0, MISS_ID - 1])).tolist() == [10, 12, 11, 14, 14, 14]
    assert t.problems("t", 0) == []


@pytest.mark.parametrize("ids,slots,cause", [
    ([5, 9], [12, 15], "slots outside"),
    ([5, 9], [12, 12], "duplicate slots"),
    ([5, 9], [12, 14], "reserved miss slot"),
    ([9, 5], [12, 10], "not sorted"),
    ([5, 5], [12, 10], "duplicate ids"),
])
def test_table_problems_name_table_rank_and_cause(ids, slots, cause):
    bad = TableShard(10, torch.tensor(ids + [MISS_ID] * 3), torch.tensor(slots + [11, 13, 14]))
    problems = bad.problems("emb_t", 3)
    assert any(cause in p and "'emb_t'" in p and "rank 3" in p for p in problems), problems


def test_block_ownership_follows_fbgemm_block_bucketize():
    own = BlockOwnership(10)  # 4 ranks: blocks of 3; ids past the last block go to id % 4
    assert own.owner(torch.tensor([0, 2, 3, 8, 9, 11, 12, 13]), 4).tolist() == [0, 0, 1, 2, 3, 3, 0, 1]
    big = BlockOwnership()  # default: the whole int64 range, no overflow
    assert big.owner(torch.tensor([0, MISS_ID - 1]), 3).tolist() == [0, 2]
    assert ModuloOwnership().owner(torch.tensor([0, 4, 5]), 3).tolist() == [0, 1, 2]


def test_blocks_round_trip_mixed_dtypes_and_shapes_bitwise():
    cols = [torch.tensor([1, -2, MISS_ID, 7]),
            torch.tensor([[0.5, float("nan")], [1.0, -0.0], [3, 4], [5, 6]]),
            torch.arange(4, dtype=torch.float64), torch.tensor([[True], [False], [True], [True]])]
    order, counts = torch.tensor([2, 0, 3, 1]), [1, 0, 3]
    assert word_for(cols) == torch.uint8 and word_for(cols[:3]) == torch.int64
    back = unpack_blocks(pack_blocks(cols, order, counts), counts, cols)
    for a, b in zip(cols, back):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a[order].view(torch.uint8), b.view(torch.uint8))


def test_blocks_lay_out_each_destination_column_by_column():
    ids, rows = torch.tensor([10, 11, 12]), torch.tensor([[1, 2], [3, 4], [5, 6]])
    flat = pack_blocks([ids, rows], torch.tensor([2, 0, 1]), [2, 1])
    assert flat.tolist() == [12, 10, 5, 6, 1, 2, 11, 3, 4]
    assert [t.shape for t in unpack_blocks(flat[:0], [0, 0], [ids, rows])] == [(0,), (0, 2)]


def test_eviction_keeps_highest_scores_ties_to_lower_ids():
    ids = torch.tensor([1, 2, 3, 4, 5])
    assert _keep_mask(ids, torch.tensor([5, 1, 5, 7, 1]), 3).tolist() == [True, False, True, True, False]
    assert _keep_mask(ids, None, 2).tolist() == [True, True, False, False, False]
    assert _keep_mask(ids, None, 9).all()


def test_upstream_model_keeps_slots_and_can_put_a_real_id_on_a_miss_slot():
    # 1 -> 2 ranks, 6 slots: id 7 sits on slot 2, which is rank 0's miss slot after the change.
    saved = [table(0, [7, 900], [2, 4], 6)]
    new = slot_routed_tables(saved, 2)
    assert [t.start for t in new] == [0, 3]
    assert new[0].lookup(torch.tensor([7])).tolist() == [2] == [new[0].miss_slot]
    assert new[1].lookup(torch.tensor([900])).tolist() == [4]


def test_words_are_ones_every_backend_exchanges_never_int16():
    """Defect (a): a bf16 row of width 3 (6 bytes) or a 1-D fp16 state (2 bytes) used to
    travel as int16, which gloo refuses ('Invalid scalar type') and NCCL lacks."""
    assert word_for([torch.zeros(5, 3, dtype=torch.bfloat16)]) == torch.uint8
    assert word_for([torch.zeros(5, dtype=torch.float16)]) == torch.uint8
    assert word_for([torch.zeros(5, 3)]) == torch.int32
    assert word_for([torch.zeros(5, 8), torch.zeros(5, dtype=torch.int64)]) == torch.int64
