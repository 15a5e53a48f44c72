"""A real TorchRec model for the resharding tests: a managed-collision embedding collection
(one MCH table, DistanceLFU eviction) sharded row-wise by DistributedModelParallel with the
fused CPU kernel, next to a dense layer; trained on a fixed pool of ids.

Module-level functions only: spawned ranks import them. Needs TorchRec (see
scripts/install_torchrec_cpu.sh).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingCollection, EmbeddingConfig, JaggedTensor, KeyedJaggedTensor
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule,
)

ZCH = 64  # slots (embedding rows) of the table
H = 10_000  # input id space
DIM = 8
BUCKETS = 12  # the planner wants buckets divisible by the world size (1, 2, 3, 4)
POOL = [17 + 208 * i for i in range(48)]  # the ids training sees: 12 per quarter of [0, H)
TABLE, FEATURE = "t0", "f0"


class Model(torch.nn.Module):
    """Sparse (managed-collision embeddings) and dense parts, like a small ranking model."""

    def __init__(self, device: torch.device, zch: int = ZCH, dim: int = DIM, input_hash_size: int = H) -> None:
        super().__init__()
        tables = [EmbeddingConfig(name=TABLE, embedding_dim=dim, num_embeddings=zch, feature_names=[FEATURE])]
        mch = MCHManagedCollisionModule(zch_size=zch, device=device, eviction_policy=DistanceLFU_EvictionPolicy(),
                                        eviction_interval=1, input_hash_size=input_hash_size, buckets=BUCKETS)
        self.sparse = ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(tables=tables, device=torch.device("meta")),
            ManagedCollisionCollection({TABLE: mch}, embedding_configs=tables),
            return_remapped_features=True)
        self.dense = torch.nn.Linear(dim, 1)

    def forward(self, ids: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        emb, remapped = self.sparse(ids)
        rows = emb[FEATURE].values()
        return rows, remapped[FEATURE].values(), self.dense(rows).sum()


def build(world: int, seed: int = 0, zch: int = ZCH, dim: int = DIM, input_hash_size: int = H
          ) -> DistributedModelParallel:
    """The model sharded over the default group: row-wise, fused kernel, exact Adagrad (the
    CPU kernel's optimizers; rowwise Adagrad's eviction reset is CUDA-only). The tests use
    the small defaults; ``benchmarks/bench_reshard.py --torchrec`` the same model at scale."""
    torch.manual_seed(seed)
    device = torch.device("cpu")
    model = Model(device, zch, dim, input_hash_size)
    sharder = ManagedCollisionEmbeddingCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.05})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"),
        constraints={TABLE: ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused"])})
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    device=device, sharders=[sharder], plan=plan)


def batch(ids: list[int] | torch.Tensor) -> KeyedJaggedTensor:
    values = torch.as_tensor(ids, dtype=torch.int64)
    return KeyedJaggedTensor.from_lengths_sync(keys=[FEATURE], values=values,
                                               lengths=torch.ones(values.numel(), dtype=torch.int64))


def train(model: DistributedModelParallel, rank: int, steps: int, seed: int) -> None:
    """``steps`` training steps, each rank on its own draws from the pool."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    dense_opt = torch.optim.SGD(model.module.dense.parameters(), lr=0.1)
    model.train()
    for _ in range(steps):
        ids = torch.tensor(POOL)[torch.randint(0, len(POOL), (8,), generator=g)]
        _, _, loss = model(batch(ids))
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()


def state_dict(model: DistributedModelParallel) -> dict:
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


def mc_module(model: DistributedModelParallel) -> MCHManagedCollisionModule:
    return model.module.sparse._managed_collision_collection._managed_collision_modules[TABLE]


def table_rows(model: DistributedModelParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's embedding rows and exact-Adagrad momentum rows of the table (live tensors)."""
    tbe, index = model.module.sparse._table_to_tbe_and_index[TABLE]
    return tbe.split_embedding_weights()[int(index)], tbe.split_optimizer_states()[int(index)][0]


def local_truth(model: DistributedModelParallel) -> dict[int, dict]:
    """Every id this rank's table holds: its embedding row, optimizer row and metadata (as
    Python values: exact for float32, and they cross process boundaries without shared memory)."""
    mc = mc_module(model)
    weight, state = table_rows(model)
    out = {}
    ids, slots = mc._mch_sorted_raw_ids, mc._mch_remapped_ids_mapping
    for p, i in enumerate(ids.tolist()):
        if i != torch.iinfo(torch.int64).max:
            local = int(slots[p]) - mc._output_global_offset
            out[i] = {"weight": weight[local].tolist(), "momentum": state[local].tolist(),
                      "counts": int(mc._mch_counts[p]), "last_access_iter": int(mc._mch_last_access_iter[p])}
    return out


def lookup(model: DistributedModelParallel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval-mode lookup (no admission, no eviction): embedding rows and remapped slots."""
    model.eval()
    with torch.no_grad():
        rows, slots, _ = model(batch(ids))
    return rows, slots


def local_rows(model: DistributedModelParallel, ids: torch.Tensor) -> list[list[float] | None]:
    """What this rank's table gives for ids routed to it: the row of the remapped slot, or
    None when the slot is outside the rank's range (FBGEMM refuses those in a forward)."""
    mc = mc_module(model)
    weight, _ = table_rows(model)
    slots = mc.remap({FEATURE: JaggedTensor(values=ids, lengths=torch.ones_like(ids))})[FEATURE].values()
    local = (slots - mc._output_global_offset).tolist()
    return [weight[s].tolist() if 0 <= s < weight.shape[0] else None for s in local]


def miss_slot(model: DistributedModelParallel) -> int:
    mc = mc_module(model)
    return mc._output_global_offset + mc.output_size() - 1
