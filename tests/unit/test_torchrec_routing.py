"""TorchRec routing, single process: the owner of an id is where TorchRec's input dist sends it.

``TorchRecRouting`` calls FBGEMM's ``block_bucketize_sparse_features`` with the parameters
``ShardedManagedCollisionCollection`` gives its ``RwSparseFeaturesDist``; this checks it
against TorchRec's own bucketization entry point and against ``BlockOwnership`` (the
dependency-free rule the generic resharder uses), ids beyond the input space included.
"""

from __future__ import annotations

import pytest
from optional_systems import require

require("torchrec")
import torch
from torchrec import KeyedJaggedTensor
from torchrec.distributed.embedding_sharding import bucketize_kjt_before_all2all

from megatron_ckpt_fixes.reshard import BlockOwnership
from megatron_ckpt_fixes.integrations.torchrec import TorchRecRouting

pytestmark = pytest.mark.varies_with("torch", "python", "torchrec")


@pytest.mark.parametrize("hash_size,world", [(10_000, 1), (10_000, 2), (10_000, 3), (10_000, 4),
                                             (97, 5), (1 << 40, 3)])
def test_routing_is_torchrecs_input_bucketization(hash_size, world):
    g = torch.Generator().manual_seed(world)
    ids = torch.cat([torch.randint(0, hash_size, (3000,), generator=g),
                     torch.tensor([0, hash_size - 1, hash_size, hash_size + 7, (1 << 62) + 3])])
    buckets = world  # what rebuild_with_output_id_range gives a sharded MCH module
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.ones_like(ids))
    bucketized, permute = bucketize_kjt_before_all2all(
        kjt, num_buckets=world, block_sizes=torch.tensor([-(-hash_size // buckets)]),
        total_num_blocks=torch.tensor([buckets]), output_permute=True, keep_original_indices=True)
    per_rank = bucketized.lengths().view(world, -1).sum(1)
    torchrec_owner = torch.searchsorted(torch.cumsum(per_rank, 0), permute, right=True)
    owner = TorchRecRouting(hash_size, buckets).owner(ids, world)
    assert torch.equal(owner, torchrec_owner)
    assert torch.equal(owner, BlockOwnership(hash_size).owner(ids, world))
    assert TorchRecRouting(hash_size, buckets).owner(ids[:0], world).numel() == 0


@pytest.mark.parametrize("hash_size,buckets,world", [(10_000, 12, 3), (10_000, 12, 4), (1 << 40, 12, 3),
                                                     (97, 5, 5), (10_000, 4, 2)])
def test_cuts_route_every_id_inside_them_like_the_fbgemm_op(hash_size, buckets, world):
    """The resharder finds each rank's ids of a sorted run by the cuts, without the op per id."""
    routing = TorchRecRouting(hash_size, buckets)
    cuts = routing.cuts(world)
    assert cuts[0] == 0 and list(cuts) == sorted(cuts)
    g = torch.Generator().manual_seed(buckets + world)
    inner = torch.tensor(cuts[1:-1], dtype=torch.int64)
    ids = torch.cat([torch.randint(0, cuts[-1], (3000,), generator=g), inner, inner - 1, torch.tensor([0, cuts[-1] - 1])])
    assert torch.equal(torch.searchsorted(torch.tensor(cuts), ids, right=True) - 1, routing.owner(ids, world))
