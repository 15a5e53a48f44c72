"""The reshard benchmark on a real TorchRec model (``bench_reshard.py --torchrec``).

A ``ManagedCollisionEmbeddingCollection`` with one MCH table (DistanceLFU metadata: counts
and last access) sharded row-wise by ``DistributedModelParallel`` (fused CPU kernel, exact
Adagrad: one momentum row per embedding row). Its state is filled directly (sorted ids from
each rank's routing block, a random slot permutation, random rows and momentum) instead of by
training, which would take hours at this size; everything else is the real module, the real
``state_dict`` and the real DCP checkpoint. Saved at 4 ranks, loaded at 3: plain
``dcp.load`` of the same state dict (positional, the bytes a TorchRec user reads today)
against ``megatron_ckpt_fixes.reshard.torchrec_dmp.load``, in the same processes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

TABLE, FEATURE = "t0", "f0"
HASH = 1 << 40
BUCKETS = 12
SAMPLE = 2000  # ids per rank whose rows are compared after the load


def build(world: int, zch: int, dim: int) -> torch.nn.Module:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule,
    )

    tables = [EmbeddingConfig(name=TABLE, embedding_dim=dim, num_embeddings=zch, feature_names=[FEATURE])]
    mch = MCHManagedCollisionModule(zch_size=zch, device=torch.device("cpu"),
                                    eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=1,
                                    input_hash_size=HASH, buckets=BUCKETS)
    model = ManagedCollisionEmbeddingCollection(
        EmbeddingCollection(tables=tables, device=torch.device("meta")),
        ManagedCollisionCollection({TABLE: mch}, embedding_configs=tables))
    sharder = ManagedCollisionEmbeddingCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.05})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"),
        constraints={TABLE: ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused"])})
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    device=torch.device("cpu"), sharders=[sharder], plan=plan)


def _parts(model: torch.nn.Module) -> tuple:
    sharded = model.module
    mc = sharded._managed_collision_collection._managed_collision_modules[TABLE]
    tbe, index = sharded._table_to_tbe_and_index[TABLE]
    return mc, tbe.split_embedding_weights()[int(index)], tbe.split_optimizer_states()[int(index)][0]


def state_dict(model: torch.nn.Module) -> dict:
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


def local_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's shard of the table: MC buffers, embedding rows, momentum rows."""
    mc, weight, momentum = _parts(model)
    buffers = [mc._mch_sorted_raw_ids, mc._mch_remapped_ids_mapping, *mc._mch_metadata.values()]
    return sum(t.numel() * t.element_size() for t in (*buffers, weight, momentum))


@torch.no_grad()
def fill_and_save(rank: int, world: int, ckpt: str, zch: int, dim: int, fill: float) -> dict:
    """A trained-looking state: ids from this rank's routing block, random slots and rows."""
    model = build(world, zch, dim)
    mc, weight, momentum = _parts(model)
    g = torch.Generator().manual_seed(rank)
    size, start = mc.output_size(), mc._output_global_offset
    k = int(fill * (size - 1))
    block = -(-HASH // world)
    stride = block // k
    ids = rank * block + torch.arange(k) * stride + torch.randint(0, stride, (k,), generator=g)
    mc._mch_sorted_raw_ids[:k] = ids
    perm = start + torch.randperm(size - 1, generator=g)
    mc._mch_remapped_ids_mapping.copy_(torch.cat([perm[:k], perm[k:].sort().values,
                                                  torch.tensor([start + size - 1])]))
    mc._mch_counts[:k] = torch.randint(1, 1 << 20, (k,), generator=g)
    mc._mch_last_access_iter[:k] = torch.randint(0, 1000, (k,), generator=g)
    mc._current_iter_tensor.fill_(1000)
    weight.copy_(torch.randn(weight.shape, generator=g))
    momentum.copy_(torch.rand(momentum.shape, generator=g))
    pick = torch.randperm(k, generator=g)[:SAMPLE]
    local = mc._mch_remapped_ids_mapping[pick] - start
    sample = {"ids": ids[pick].tolist(), "weight": weight[local].tolist(), "momentum": momentum[local].tolist()}
    dcp.save(state_dict(model), checkpoint_id=ckpt)
    return sample


def load_both(rank: int, world: int, ckpt: str, zch: int, dim: int, samples: list[dict],
              peak_rss: type) -> dict:
    """Plain DCP load (positional), then the value-aware load, in fresh models."""
    from megatron_ckpt_fixes.reshard.torchrec_dmp import TorchRecRouting, load

    torch.set_num_threads(1)
    model = build(world, zch, dim)
    dcp.load(state_dict(model), checkpoint_id=ckpt)  # warm-up: page cache and code paths
    state = state_dict(model)
    dist.barrier()
    with peak_rss() as plain_mem:
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=ckpt)
        dist.barrier()
        plain_s = time.perf_counter() - t0
    del state, model
    model = build(world, zch, dim)
    state = state_dict(model)
    dist.barrier()
    with peak_rss() as ours_mem:
        t0 = time.perf_counter()
        reports = load(state, ckpt, model)
        dist.barrier()
        ours_s = time.perf_counter() - t0
    model.load_state_dict(state["model"])  # TorchRec's validate_state passes
    mc, weight, momentum = _parts(model)
    routing = TorchRecRouting(HASH, mc.buckets())
    wrong = checked = 0
    for sample in samples:
        ids = torch.tensor(sample["ids"])
        mine = (routing.owner(ids, world) == rank).nonzero().squeeze(1)
        pos = torch.searchsorted(mc._mch_sorted_raw_ids, ids[mine])
        found = mc._mch_sorted_raw_ids[pos.clamp(max=mc.output_size() - 1)] == ids[mine]
        local = mc._mch_remapped_ids_mapping[pos.clamp(max=mc.output_size() - 1)] - mc._output_global_offset
        for j, i in enumerate(mine.tolist()):
            checked += 1
            wrong += int(not bool(found[j]) or weight[local[j]].tolist() != sample["weight"][i]
                         or momentum[local[j]].tolist() != sample["momentum"][i])
    mib = 1 << 20
    report = next(iter(reports.values()))
    return {"plain_s": plain_s, "reshard_s": ours_s,
            "plain_peak": (plain_mem.peak - plain_mem.before) / mib,
            "reshard_peak": (ours_mem.peak - ours_mem.before) / mib, "shard": local_bytes(model) / mib,
            "kept": report.kept_total, "evicted": report.evicted_total, "wrong": wrong, "checked": checked}
