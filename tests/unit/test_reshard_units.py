"""Single-process pieces of the ZCH resharder: layout validation, lookup, ownership, read
windows, the checks of a saved rank, slot runs, placement, the entry exchange."""

from __future__ import annotations

import pytest
import torch

from megatron_ckpt_fixes.reshard import (
    MISS_ID, BlockOwnership, ModuloOwnership, ReshardError, SlotRanges, TableShard,
)
from megatron_ckpt_fixes.reshard.exchange import grouping, send_rows, word_for
from megatron_ckpt_fixes.reshard.resharder import _Arrived, _keep_mask, _place, _runs
from megatron_ckpt_fixes.reshard.window import ReshardSpec, _saved_rank_problems, read_windows
from megatron_ckpt_fixes.reshard.routing import route
from reshard_upstream import slot_routed_tables

pytestmark = pytest.mark.varies_with("torch", "python")


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


def test_read_windows_hold_whole_saved_ranks_spread_evenly():
    saved = SlotRanges((0, 10, 20, 30, 40))
    assert read_windows(saved, 3) == (0, 20, 30, 40)  # 4 -> 3: one rank reads two saved ranks
    assert read_windows(saved, 4) == saved.bounds  # same world size: rank r reads saved rank r
    assert read_windows(SlotRanges((0, 10, 20, 30)), 4) == (0, 10, 20, 30, 30)  # 3 -> 4: one reads none
    assert read_windows(SlotRanges((0, 90)), 3) == (0, 90, 90, 90)
    for n, m in [(4, 3), (3, 4), (8, 3), (3, 8), (5, 5)]:
        bounds = SlotRanges.even(100 * n, n).bounds
        windows = read_windows(SlotRanges(bounds), m)
        assert set(windows) <= set(bounds) and windows[0] == 0 and windows[-1] == bounds[-1]
        sizes = [(b - a) // 100 for a, b in zip(windows, windows[1:])]
        assert max(sizes) == -(-n // m)  # no rank reads more saved ranks than it must


def test_saved_rank_checks_quick_path_and_each_failure():
    ids = torch.tensor([3, 8, 9, MISS_ID, MISS_ID])
    slots = torch.tensor([12, 10, 11, 13, 14])
    assert _saved_rank_problems("t", 0, 2, 10, ids, slots) == ([], 3)
    cases = [
        (ids, torch.tensor([12, 10, 12, 13, 14]), "saved slot 12 of saved rank 2 (slots [10, 15)) is mapped from 2"),
        (ids, torch.tensor([12, 10, 16, 13, 14]), "1 out-of-range slots in saved rank 2"),
        (ids, torch.tensor([14, 10, 11, 13, 12]), "id 3 holds the reserved miss slot 14"),
        (torch.tensor([3, 9, 8, MISS_ID, MISS_ID]), slots, "not sorted at position 12"),
        (torch.tensor([3, 8, 8, MISS_ID, MISS_ID]), slots, "id 8 appears twice"),
        (torch.tensor([3, 8, 9, MISS_ID, 20]), slots, "reserved last position 14 of saved rank 2 (slots [10, 15)) holds id 20"),
        (torch.tensor([3, MISS_ID, 8, 9, MISS_ID]), slots, "not sorted at position 12"),
    ]
    for bad_ids, bad_slots, words in cases:
        problems, _ = _saved_rank_problems("t", 1, 2, 10, bad_ids, bad_slots)
        assert any(words in p and "'t'" in p and "rank 1" in p for p in problems), (words, problems)


def test_runs_cut_by_saved_rank_and_follow_the_saved_slots():
    """Entries arrive in saved position order; inside the run of a saved rank, local slots
    follow the saved slots, so the rows are read in increasing order."""
    saved = SlotRanges((0, 10, 25, 30))
    old = torch.tensor([3, 7, 1, 20, 12, 11, 29, 26])
    slot_of_kept = torch.empty(8, dtype=torch.int64)
    runs = _runs(old.clone(), saved, slot_of_kept)  # _runs overwrites its input
    assert [(r.chunk, r.first, r.end, r.rows.tolist()) for r in runs] == [
        (0, 0, 3, [1, 3, 7]), (1, 3, 6, [1, 2, 10]), (2, 6, 8, [1, 4])]
    assert slot_of_kept.tolist() == [1, 2, 0, 5, 4, 3, 7, 6]
    for r in runs:  # each kept entry's row is the one its saved slot addresses
        rows = saved.start(r.chunk) + r.rows
        assert rows[slot_of_kept[r.first:r.end] - r.first].tolist() == old[r.first:r.end].tolist()
    assert _runs(old[:0], saved, slot_of_kept[:0]) == []


def _spec(target: SlotRanges, score: str | None = None) -> ReshardSpec:
    return ReshardSpec("t", SlotRanges((0, 10, 20)), target, (0, 10, 20), BlockOwnership(100), score)


def test_place_sorted_arrivals_keep_their_order_and_get_slots_by_saved_slot():
    arrived = _Arrived(torch.tensor([4, 2, 15, 11]), torch.tensor([5, 6, 30, 31]), [torch.tensor([1, 2, 3, 4])])
    placed = _place(arrived, _spec(SlotRanges((0, 20))), 0, ["counts"], None)
    assert placed.ids.tolist() == [5, 6, 30, 31] and placed.meta[0].tolist() == [1, 2, 3, 4]
    assert placed.slots.tolist() == [1, 0, 3, 2] and placed.evicted_ids.numel() == 0
    assert [(r.chunk, r.rows.tolist()) for r in placed.runs] == [(0, [2, 4]), (1, [1, 5])]


def test_place_sorts_mixed_arrivals_refuses_duplicates_and_evicts_lowest_scores():
    def arrived() -> _Arrived:  # _place consumes its saved slots
        return _Arrived(torch.tensor([4, 2, 15, 11]), torch.tensor([30, 6, 5, 31]), [torch.tensor([9, 1, 7, 8])])

    placed = _place(arrived(), _spec(SlotRanges((0, 20))), 0, ["counts"], None)
    assert placed.ids.tolist() == [5, 6, 30, 31] and placed.meta[0].tolist() == [7, 1, 9, 8]
    by_id = dict(zip(placed.ids.tolist(), placed.slots.tolist()))
    assert by_id == {30: 1, 6: 0, 5: 3, 31: 2}  # each id keeps the rank of its saved slot in its run
    small = _place(arrived(), _spec(SlotRanges((0, 3)), "counts"), 0, ["counts"], None)  # 2 usable slots
    assert small.ids.tolist() == [30, 31] and small.evicted_ids.tolist() == [5, 6]
    assert [(r.chunk, r.first, r.end, r.rows.tolist()) for r in small.runs] == [(0, 0, 1, [4]), (1, 1, 2, [1])]
    twice = _Arrived(torch.tensor([4, 2]), torch.tensor([30, 30]), [torch.tensor([1, 1])])
    with pytest.raises(ReshardError, match="id 30 appears 2\\+ times"):
        _place(twice, _spec(SlotRanges((0, 20))), 0, ["counts"], None)


def test_grouping_is_stable_and_skips_rows_already_in_order():
    assert grouping(torch.tensor([0, 0, 1, 2]), 3) is None
    index = torch.tensor([5, 6, 7])
    assert grouping(torch.tensor([0, 1, 1]), 2, index) is index
    assert grouping(torch.tensor([2, 0, 1, 0, 2]), 3).tolist() == [1, 3, 2, 0, 4]
    assert grouping(torch.tensor([1, 0]), 2, index[:2]).tolist() == [6, 5]


def test_send_rows_moves_mixed_columns_bitwise(single_rank_group):
    cols = [torch.tensor([1, -2, MISS_ID, 7]),
            torch.tensor([[0.5, float("nan")], [1.0, -0.0], [3, 4], [5, 6]]),
            torch.arange(4, dtype=torch.float64), torch.tensor([[True], [False], [True], [True]]),
            torch.arange(12, dtype=torch.bfloat16).reshape(4, 3)]
    index = torch.tensor([2, 0, 3])
    got = send_rows(cols, torch.zeros(3, dtype=torch.int64), index)
    assert got.counts == [3]
    for a, b in zip(cols, got.columns):
        assert a.dtype == b.dtype and b.shape == (3, *a.shape[1:])
        assert torch.equal(a[index].view(torch.uint8), b.view(torch.uint8))
    plain = send_rows(cols, torch.zeros(4, dtype=torch.int64))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(cols, plain.columns))


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


@pytest.mark.parametrize("ownership", [BlockOwnership(10_000), BlockOwnership(97), BlockOwnership()])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_block_cuts_route_like_owner(ownership, world):
    cuts = ownership.cuts(world)
    g = torch.Generator().manual_seed(world)
    inner = torch.tensor(cuts[1:-1], dtype=torch.int64)
    ids = torch.cat([torch.randint(0, min(cuts[-1], 1 << 62), (2000,), generator=g), inner, inner - 1,
                     torch.tensor([0, cuts[-1] - 1])])
    assert torch.equal(torch.searchsorted(torch.tensor(cuts), ids, right=True) - 1, ownership.owner(ids, world))


def test_route_by_ranges_finds_each_ranks_part_without_owners_per_id():
    """Two saved ranks in one window (real prefixes at 0 and 10), block routing by 100s."""
    ids = torch.tensor([5, 60, 130, 140, MISS_ID] + [MISS_ID] * 5 + [150, 210, 260, MISS_ID, MISS_ID])
    sent = route(ids, [(0, 4), (10, 3)], BlockOwnership(300), 3)
    assert sent.dest is None and sent.counts == [2, 3, 2]
    assert sent.take(ids).tolist() == [5, 60, 130, 140, 150, 210, 260]
    one = route(ids, [(10, 3)], BlockOwnership(300), 3)
    assert one.span == slice(10, 13) and one.index is None and one.counts == [0, 1, 2]
    assert one.elsewhere(1) and not route(ids, [(0, 2)], BlockOwnership(300), 3).elsewhere(0)


def test_route_without_ranges_gives_each_ids_owner():
    ids = torch.tensor([5, 60, 130, MISS_ID, 150, 211, MISS_ID])
    sent = route(ids, [(0, 3), (4, 2)], ModuloOwnership(), 3)
    assert sent.counts is None and sent.index.tolist() == [0, 1, 2, 4, 5]
    assert sent.dest.tolist() == [2, 0, 1, 0, 1]
    outside = route(torch.tensor([5, 400, MISS_ID]), [(0, 2)], BlockOwnership(300), 3)  # 400: past the blocks
    assert outside.counts is None and outside.dest.tolist() == [0, 400 % 3]
