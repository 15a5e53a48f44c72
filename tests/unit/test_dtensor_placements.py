"""Pure placement math: chunk semantics, multi-axis dims, _StridedShard, permutations."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from megatron_ckpt_fixes.dtensor import (PlacementError, contiguous_stride, infer_global_shape,
                                         local_shape_and_offset, merge_param_sharding,
                                         permute_placements, transpose_placements)
from megatron_ckpt_fixes.dtensor.placements import (check_local_shapes,
                                                    check_strided_divisible,
                                                    normalize_placements)

pytestmark = pytest.mark.varies_with("torch", "python")


def _chunk(t: torch.Tensor, n: int, i: int, dim: int = 0) -> torch.Tensor:
    """DTensor's chunk rule: ceil(size / n) per shard, trailing shards short or empty."""
    step = -(-t.shape[dim] // n)
    start = min(step * i, t.shape[dim])
    return t.narrow(dim, start, min(step, t.shape[dim] - start))


def _coords(mesh_shape):
    return list(itertools.product(*(range(s) for s in mesh_shape)))


@pytest.mark.parametrize("size,n", [(5, 2), (3, 4), (0, 2), (8, 4), (7, 3), (1, 4)])
def test_uneven_and_empty_shards_follow_chunk_semantics(size, n):
    idx = torch.arange(size)
    shapes = {}
    for i in range(n):
        shape, offset = local_shape_and_offset((size,), (n,), (i,), [Shard(0)])
        expected = _chunk(idx, n, i)
        assert shape == (expected.numel(),)
        if expected.numel():
            assert offset == (int(expected[0]),)
        shapes[(i,)] = shape
    assert infer_global_shape("w", shapes, (n,), [Shard(0)]) == (size,)


def test_several_mesh_axes_shard_one_dim():
    full = torch.arange(7 * 3).reshape(7, 3)
    placements = (Shard(0), Shard(0))  # dp first, then ep inside each dp chunk
    shapes = {}
    for dp, ep in _coords((2, 2)):
        local = _chunk(_chunk(full, 2, dp), 2, ep)
        shape, offset = local_shape_and_offset((7, 3), (2, 2), (dp, ep), placements)
        assert shape == tuple(local.shape)
        if local.numel():
            assert offset == (int(local[0, 0]) // 3, 0)
        shapes[(dp, ep)] = shape
    assert infer_global_shape("w", shapes, (2, 2), placements) == (7, 3)
    check_local_shapes("w", (7, 3), shapes, (2, 2), placements)


def test_global_shape_inference_ignores_replicated_axes():
    shapes = {(dp, ep): (3 if ep == 0 else 2, 4) for dp, ep in _coords((2, 2))}
    assert infer_global_shape("w", shapes, (2, 2), (Replicate(), Shard(0))) == (5, 4)


def test_local_shape_not_following_chunk_semantics_is_named():
    shapes = {(0,): (2, 4), (1,): (3, 4)}  # 5 rows split 2/3; torch.chunk gives 3/2
    match = r"'w'.*rank 0.*local shape \[2, 4\].*expected \[3, 4\]"
    with pytest.raises(PlacementError, match=match):
        check_local_shapes("w", infer_global_shape("w", shapes, (2,), [Shard(0)]), shapes,
                           (2,), [Shard(0)], rank_of={(0,): 0, (1,): 1})


def test_wrong_global_shape_is_named():
    with pytest.raises(PlacementError, match=r"'w'.*global shape \[6, 4\]"):
        check_local_shapes("w", (6, 4), {(0,): (3, 4), (1,): (2, 4)}, (2,), [Shard(0)])


def test_contiguous_stride():
    assert contiguous_stride((4, 6, 5)) == torch.empty(4, 6, 5).stride()
    assert contiguous_stride((3, 0, 2)) == torch.empty(3, 0, 2).stride()
    assert contiguous_stride(()) == ()


@pytest.mark.parametrize("placements,mesh_ndim,ndim,match", [
    ((Shard(0),), 2, 2, "1 placements .* 2 axes"),
    ((Replicate(), Shard(3)), 2, 3, "shards dim 3 of a 3-d tensor"),
    ((Partial(), Shard(0)), 2, 3, "Partial|checkpoints need"),
])
def test_placements_that_do_not_fit_the_mesh(placements, mesh_ndim, ndim, match):
    with pytest.raises(PlacementError, match=r"'experts\.w' on rank 3: .*" + match):
        normalize_placements("experts.w", 3, placements, mesh_ndim, ndim)


def test_negative_shard_dims_are_normalized():
    got = normalize_placements("w", 0, (Shard(-1), _StridedShard(-2, split_factor=2)), 2, 3)
    assert got == (Shard(2), _StridedShard(1, split_factor=2))


@pytest.mark.parametrize("experts,ep,dp", [(4, 2, 2), (8, 2, 4), (6, 3, 2), (6, 2, 3), (2, 2, 2)])
def test_fsdp_shard_merged_into_checkpoint_axis(experts, ep, dp):
    """EP shards experts first, FSDP2 shards each rank's expert slice again: the dp axis
    (left of ep) needs _StridedShard so torch's left-to-right reading gives the same slice."""
    full = torch.arange(experts * 3).reshape(experts, 3)
    merged = merge_param_sharding("experts.w", (Replicate(), Shard(0)), ("dp", "ep"), (dp, ep),
                                  (Shard(0),), ("dp",))
    assert merged == (_StridedShard(0, split_factor=ep), Shard(0))
    check_strided_divisible("experts.w", (experts, 3), merged)
    for d, e in _coords((dp, ep)):
        local = _chunk(_chunk(full, ep, e), dp, d)
        shape, offset = local_shape_and_offset((experts, 3), (dp, ep), (d, e), merged)
        assert shape == tuple(local.shape)
        if local.numel():
            assert offset == (int(local[0, 0]) // 3, 0)


def test_fsdp_shard_on_another_dim_merges_as_plain_shard():
    merged = merge_param_sharding("w", (Replicate(), Shard(0)), ("dp", "ep"), (2, 2),
                                  (Shard(1),), ("dp",))
    assert merged == (Shard(1), Shard(0))


def test_strided_merge_of_indivisible_dim_is_refused():
    with pytest.raises(PlacementError, match="not divisible by the split factor 2"):
        check_strided_divisible("w", (7, 3), (_StridedShard(0, split_factor=2), Shard(0)))


@pytest.mark.parametrize("ckpt,param_names,match", [
    ((Replicate(), Shard(0)), ("fsdp",), "'fsdp'.*not an axis"),
    ((Shard(1), Shard(0)), ("dp",), "shards both"),
])
def test_merge_conflicts_are_named(ckpt, param_names, match):
    with pytest.raises(PlacementError, match=match):
        merge_param_sharding("w", ckpt, ("dp", "ep"), (2, 2), (Shard(0),), param_names)


def test_transpose_swaps_shard_and_strided_shard():
    placements = (_StridedShard(1, split_factor=2), Shard(2), Replicate())
    assert transpose_placements(placements, 3, 1, 2) == (
        _StridedShard(2, split_factor=2), Shard(1), Replicate())


@pytest.mark.parametrize("perm", list(itertools.permutations(range(3))))
def test_permuted_placements_match_sharding_the_permuted_tensor(perm):
    """For every permutation: permuting each local shard equals sharding the permuted full
    tensor with the permuted placements."""
    full = torch.arange(4 * 5 * 6).reshape(4, 5, 6)
    placements = (Shard(0), Shard(2))
    new = permute_placements(placements, perm)
    permuted = full.permute(perm)
    for c in _coords((2, 3)):
        shape, offset = local_shape_and_offset(full.shape, (2, 3), c, placements)
        local = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        new_shape, new_offset = local_shape_and_offset(permuted.shape, (2, 3), c, new)
        expected = permuted[tuple(slice(o, o + s) for o, s in zip(new_offset, new_shape))]
        assert torch.equal(local.permute(perm), expected)


def test_bad_permutation_is_named():
    with pytest.raises(PlacementError, match=r"'w'.*\[0, 0, 1\] is not a permutation"):
        permute_placements((Shard(0),), (0, 0, 1), key="w")
