"""Pure layout math of dtensor.mcore: a DTensor's block composed with megatron's tensor
parallelism and prepended axes, checked against torch's own splitting for every mesh
coordinate, and the chunk-exact validation of the irregular grids it produces."""

from __future__ import annotations

import itertools

import pytest
import torch
from megatron.core.dist_checkpointing import validation
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from megatron_ckpt_fixes.dtensor import PlacementError
from megatron_ckpt_fixes.integrations.mcore_dtensor.layout import mesh_shard, sharded_tensor_fields
from megatron_ckpt_fixes.fixes.structure.integrity import chunk_exact_problems, problems_of_my_keys


def _split(full: torch.Tensor, mesh_shape, coord, placements) -> torch.Tensor:
    """What distribute_tensor gives the rank at ``coord``: each placement's own split, in
    mesh order (the truth the layout must match)."""
    local = full
    for axis, placement in enumerate(placements):
        if isinstance(placement, (Shard, _StridedShard)):
            local = placement._split_tensor(local, mesh_shape[axis], with_padding=False)[0][
                coord[axis]]
    return local


def _coords(mesh_shape):
    return list(itertools.product(*map(range, mesh_shape)))


def _sharded(key, fields, replica_id, data=None) -> ShardedTensor:
    return ShardedTensor(key, data, torch.float32, fields.local_shape, fields.global_shape,
                         fields.global_offset, fields.axis_fragmentations, replica_id,
                         fields.prepend_axis_num)


def _all_ranks(shape, mesh_shape, placements, tp=None, prepend=()):
    """Fields of every (tp rank, mesh coordinate), each checked against torch's split of a
    full tensor whose values are their own flat index; returns (fields, replica ids)."""
    tp_axis, tp_size = tp if tp else (None, 1)
    full_shape = list(shape)
    if tp_axis is not None:
        full_shape[tp_axis] *= tp_size
    full = torch.arange(torch.Size(full_shape).numel(), dtype=torch.float32).reshape(full_shape)
    prepended = full.reshape((1,) * len(prepend) + tuple(full_shape))
    out = []
    for tp_rank in range(tp_size):
        tp_chunk = full if tp_axis is None else full.chunk(tp_size, tp_axis)[tp_rank]
        for coord in _coords(mesh_shape):
            local = _split(tp_chunk, mesh_shape, coord, placements)
            shard = mesh_shard("w", 0, tuple(tp_chunk.shape), mesh_shape, coord, placements,
                               tuple(local.shape))
            fields = sharded_tensor_fields(
                "w", 0, shard, prepend, None if tp_axis is None else (tp_axis, tp_rank, tp_size))
            assert fields.local_shape == tuple(local.shape)
            offsets = [0 if p < len(prepend) else o for p, o in enumerate(fields.global_offset)]
            view = prepended[tuple(slice(o, o + n) for o, n in zip(
                offsets, (1,) * len(prepend) + tuple(local.shape)))]
            assert torch.equal(view.reshape(local.shape), local), (tp_rank, coord)
            out.append((fields, (0, 0, shard.replica)))
    return out


LAYOUTS = {
    "uneven rows (5 over 2)": ((5, 4), (2,), (Shard(0),)),
    "empty shard (3 over 4)": ((3, 4), (4,), (Shard(0),)),
    "columns, uneven (2 x 5 over 3)": ((2, 5), (3,), (Shard(1),)),
    "two mesh axes on one dim (7 over 2 x 2)": ((7, 3), (2, 2), (Shard(0), Shard(0))),
    "two dims (5 x 3 over 2 x 2)": ((5, 3), (2, 2), (Shard(0), Shard(1))),
    "strided shard, even (8)": ((8, 2), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    "strided shard, uneven (6)": ((6, 2), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    "HSDP: replicate x shard (5)": ((5, 3), (2, 2), (Replicate(), Shard(0))),
    "even (6 over 3)": ((6, 2), (3,), (Shard(0),)),
}


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("tp", [None, (0, 2), (1, 2)], ids=["no-tp", "tp-dim0", "tp-dim1"])
def test_every_rank_gets_its_exact_block_and_main_replicas_tile_the_tensor(name, tp):
    shape, mesh_shape, placements = LAYOUTS[name]
    ranks = _all_ranks(shape, mesh_shape, placements, tp)
    shardings = list(enumerate(_sharded("w", f, r) for f, r in ranks))
    regular = {f.axis_fragmentations is not None for f, _ in ranks}
    assert len(regular) == 1
    if regular.pop():
        assert not validation._validate_sharding_for_key(shardings)  # upstream's grid check
    assert chunk_exact_problems(shardings) == []
    # every block is written once: main replicas hold disjoint blocks of the full volume
    main = [f for f, r in ranks if r == (0, 0, 0)]
    assert sum(torch.Size(f.local_shape).numel() for f in main) == torch.Size(
        main[0].global_shape).numel()


def test_prepended_expert_axis_and_uneven_fsdp_rows():
    ranks = _all_ranks((5, 4), (2,), (Shard(0),), prepend=((0, 1, 3),))
    assert [(f.global_shape, f.global_offset, f.prepend_axis_num) for f, _ in ranks] == [
        ((3, 5, 4), (1, 0, 0), 1), ((3, 5, 4), (1, 3, 0), 1)]
    assert all(f.axis_fragmentations is None for f, _ in ranks)


def test_even_shards_keep_upstreams_regular_grid():
    """Where upstream's even-chunk arithmetic was right (a 1-D mesh in data-parallel order),
    the fields are exactly what its from_rank_offsets gives: upstream's own loaders and
    validation keep applying."""
    for tp_axis in (0, 1):
        local = torch.zeros(3, 4)
        for tp_rank, dp_rank in _coords((2, 2)):
            shard = mesh_shard("w", 0, (6, 4), (2,), (dp_rank,), (Shard(0),), (3, 4))
            fields = sharded_tensor_fields("w", 0, shard, (), (tp_axis, tp_rank, 2))
            offsets = [(0, tp_rank * 2 + dp_rank, 4)] if tp_axis == 0 else \
                [(1, tp_rank, 2), (0, dp_rank, 2)]
            upstream = ShardedTensor.from_rank_offsets("w", local, *offsets)
            assert (fields.global_shape, fields.global_offset, fields.axis_fragmentations) == (
                upstream.global_shape, upstream.global_offset, upstream.axis_fragmentations)


def test_replica_index_counts_over_replicate_axes_only():
    replicas = {coord: mesh_shard("w", 0, (4, 2), (2, 3, 2), coord,
                                  (Replicate(), Shard(0), Replicate()),
                                  _split(torch.zeros(4, 2), (2, 3, 2), coord,
                                         (Replicate(), Shard(0), Replicate())).shape).replica
                for coord in _coords((2, 3, 2))}
    assert replicas[(0, 2, 0)] == 0 and replicas[(1, 0, 1)] == 3 and replicas[(0, 1, 1)] == 1


def test_interleaving_strided_shard_is_refused():
    """_StridedShard without the later axis it stands for interleaves rows; torch still
    reports one offset for it, which would save values at the wrong places."""
    placements = (Shard(0), _StridedShard(0, split_factor=2))
    local = _split(torch.arange(8.0).reshape(8, 1), (2, 2), (0, 0), placements)
    assert local.flatten().tolist() == [0.0, 2.0]  # not contiguous
    with pytest.raises(PlacementError, match="contiguous blocks"):
        mesh_shard("w", 3, (8, 1), (2, 2), (0, 0), placements, tuple(local.shape))


def test_local_shard_that_does_not_fit_the_global_shape_names_key_rank_and_cause():
    """DTensor.from_local without shape= on uneven rows: rank 1 holds 1 row but believes
    the tensor has 2 (its own local size x 2); rank 0 believes 4 and holds 2 - each is
    self-consistent, caught across ranks by the sharding validation; a rank whose local
    shard contradicts its own global shape is caught here."""
    with pytest.raises(PlacementError) as err:
        mesh_shard("layers.0.w", 1, (3, 4), (2,), (1,), (Shard(0),), (2, 4))
    assert "'layers.0.w' on rank 1" in str(err.value) and "from_local without shape=" in str(
        err.value)


def test_partial_and_bad_offsets_are_refused():
    with pytest.raises(PlacementError, match="checkpoints need Shard/Replicate"):
        mesh_shard("w", 0, (2, 2), (2,), (0,), (Partial(),), (2, 2))
    shard = mesh_shard("w", 0, (2, 2), (1,), (0,), (Shard(0),), (2, 2))
    with pytest.raises(PlacementError, match="Invalid rank offsets"):
        sharded_tensor_fields("w", 0, shard, ((0, 3, 3),))
    with pytest.raises(PlacementError, match="not on one of the 1 prepended axes"):
        sharded_tensor_fields("w", 0, shard, ((1, 0, 2),))


# -- chunk-exact validation -------------------------------------------------------------

def _chunk(rank, offset, local, global_shape=(5, 4), replica=0, prepend=0):
    return rank, ShardedTensor("w", None, torch.float32, local, global_shape, offset, None,
                               (0, 0, replica), prepend)


def test_chunk_exact_accepts_uneven_and_empty_chunks_and_ignores_copies():
    assert chunk_exact_problems([_chunk(0, (0, 0), (3, 4)), _chunk(1, (3, 0), (2, 4)),
                                 _chunk(2, (5, 0), (0, 4)),
                                 _chunk(3, (0, 0), (3, 4), replica=1)]) == []


def test_chunk_exact_reports_gaps_and_overlaps_with_their_ranks():
    gap = chunk_exact_problems([_chunk(0, (0, 0), (2, 4)), _chunk(1, (3, 0), (2, 4))])
    assert len(gap) == 1 and "4 of 20 elements are covered by no main replica" in gap[0] \
        and "[2:3, 0:4]" in gap[0] and "'w'" in gap[0]
    overlap = chunk_exact_problems([_chunk(0, (0, 0), (3, 4)), _chunk(1, (2, 0), (3, 4))])
    assert len(overlap) == 1 and "elements [2:3, 0:4]" in overlap[0] \
        and "ranks [0, 1]" in overlap[0]
    outside = chunk_exact_problems([_chunk(0, (0, 0), (3, 4)), _chunk(1, (3, 0), (3, 4))])
    assert "chunk of rank 1 at offset [3, 0] with shape [3, 4] lies outside" in outside[0]


def test_chunk_exact_with_a_prepended_axis():
    chunks = [_chunk(r, (e, o, 0), (n, 4), (2, 5, 4), prepend=1)
              for r, (e, o, n) in enumerate([(0, 0, 3), (0, 3, 2), (1, 0, 3), (1, 3, 2)])]
    assert chunk_exact_problems(chunks) == []
    assert "covered by no main replica" in chunk_exact_problems(chunks[:3])[0]


def test_collective_validator_applies_chunk_exact_to_irregular_keys_only():
    """Upstream's validator skips a key without a regular grid; the patched one does not.
    Regular keys keep upstream's own message."""
    irregular = [[_chunk(0, (0, 0), (3, 4))[1]], [_chunk(1, (2, 0), (3, 4))[1]]]
    assert not validation._validate_sharding_for_key(
        [(r, s[0]) for r, s in enumerate(irregular)])  # upstream: nothing found
    assert "written by more than one main replica" in problems_of_my_keys(irregular, 0, 1)[0]
    regular = [[ShardedTensor.from_rank_offsets("v", torch.zeros(2), (0, 0, 2))]] * 2
    assert "Invalid access pattern for ShardedTensor(key='v'" in problems_of_my_keys(
        regular, 0, 1)[0]
