"""Load a TorchRec model's DCP checkpoint at another world size, managed-collision tables by value.

TorchRec shards a ``ManagedCollisionEmbeddingCollection`` row-wise: rank r serves the global
slots ``[offset_r, offset_r + zch_size_r)`` and its ``MCHManagedCollisionModule`` keeps the
sorted ids, their slots and the eviction metadata of that range; the input dist routes an id
to a rank by its value (FBGEMM's ``block_bucketize_sparse_features``). A plain ``dcp.load`` at
another world size reshards all of that by position: TorchRec's ``validate_state`` then
refuses the output segments, and with that check out of the way the ids land on ranks that
do not serve them or point at rows outside the local range (TorchRec issue 2534: resharding
MCH state is left to the user).

:func:`load` is a drop-in for ``dcp.load(state_dict, checkpoint_id)`` on such a model. It
finds every managed-collision table of ``model`` and the entries of ``state_dict`` that hold
its state -- by identity of memory, whatever the nesting: the MC buffers, the embedding
weight rows and the fused optimizer's per-row state -- and loads each table with
:func:`~megatron_ckpt_fixes.reshard.checkpoint.load_table`, which moves every entry and its rows to the rank that serves
its id now. Everything else (dense layers, other tables, the iteration counter) loads
through plain DCP. The saved ``_output_segments_tensor`` describes the saved layout and is
not loaded, so the usual ``model.load_state_dict(state_dict["model"])`` afterwards passes
TorchRec's ``validate_state``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from megatron_ckpt_fixes.compat.torchrec import import_torchrec

import_torchrec()  # a mismatched FBGEMM: one error naming both versions, not a linker error

from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection  # noqa: E402
from torchrec.modules.mc_modules import MCHManagedCollisionModule  # noqa: E402

from megatron_ckpt_fixes.reshard.checkpoint import Column, LocalTable, load_table
from megatron_ckpt_fixes.reshard.errors import ReshardError, require_same
from megatron_ckpt_fixes.reshard.resharder import ReshardReport

logger = logging.getLogger(__name__)

_SEGMENTS = "_output_segments_tensor"


@dataclass(frozen=True)
class TorchRecRouting:
    """The rank TorchRec's row-wise input dist sends an id to, computed by the same FBGEMM op
    with the parameters ``ShardedManagedCollisionCollection`` gives it: blocks of
    ``ceil(input_hash_size / buckets)`` ids, ``buckets`` spread evenly over the ranks, ids
    beyond the blocks by modulo. Using the op itself means ownership cannot drift from the
    routing of the installed FBGEMM."""

    input_hash_size: int
    buckets: int

    def owner(self, ids: torch.Tensor, world_size: int) -> torch.Tensor:
        if ids.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        block = -(-self.input_hash_size // self.buckets)
        lengths, _, _, _, position = torch.ops.fbgemm.block_bucketize_sparse_features(
            torch.tensor([ids.numel()]), ids, False, True, torch.tensor([block]), world_size,
            None, None, -1, None, True, torch.tensor([self.buckets]))
        # ``position[i]``: where id i lands in the bucketized values, which are grouped by rank.
        return torch.searchsorted(torch.cumsum(lengths, 0), position, right=True)

    def cuts(self, world_size: int) -> tuple[int, ...] | None:
        """The ids of one bucket (a block of ``ceil(input_hash_size / buckets)`` ids) go to
        one rank, the one the FBGEMM op gives the bucket's first id; by ranges when those
        ranks do not decrease."""
        block = -(-self.input_hash_size // self.buckets)
        end = min(block * self.buckets, (1 << 63) - 1)
        ranks = self.owner(torch.arange(self.buckets) * block, world_size).tolist()
        if ranks != sorted(ranks):
            return None
        return tuple(min(next((b for b, r in enumerate(ranks) if r >= rank), self.buckets) * block, end)
                     for rank in range(world_size)) + (end,)


@dataclass(frozen=True)
class _Table:
    """One managed-collision table of the model on this rank: the live tensors to load."""

    name: str
    module: MCHManagedCollisionModule
    start: int
    rows: tuple[torch.Tensor, ...]  # the embedding weight, then the optimizer's per-row states
    segments: torch.Tensor


def _tables(model: torch.nn.Module) -> Iterator[_Table]:
    for fqn, mod in model.named_modules():
        if not isinstance(mod, BaseShardedManagedCollisionEmbeddingCollection):
            continue
        mcc = mod._managed_collision_collection
        for table, mc in mcc._managed_collision_modules.items():
            name = f"{fqn}.{table}" if fqn else table
            if not isinstance(mc, MCHManagedCollisionModule):
                raise ReshardError(f"table {name!r}: {type(mc).__name__} is not supported, only "
                                   "MCHManagedCollisionModule")
            offset, size, _total = mcc._mc_module_name_shard_metadata[table]
            if offset != mc._output_global_offset or size != mc.output_size():
                raise ReshardError(f"table {name!r}: MC buffers are chunked at {offset} (+{size}) but "
                                   f"the module serves slots from {mc._output_global_offset} "
                                   f"(+{mc.output_size()})")
            tbe, index = mod._table_to_tbe_and_index[table]
            weight = tbe.split_embedding_weights()[int(index)]
            states = tbe.split_optimizer_states()[int(index)] if tbe.split_optimizer_states() else []
            per_row = tuple(s for s in states if s.dim() >= 1 and s.shape[0] == weight.shape[0])
            yield _Table(name, mc, offset, (weight, *per_row), mc._output_segments_tensor)


def _memory_key(tensor: torch.Tensor) -> tuple[int, int, torch.dtype]:
    return tensor.data_ptr(), tensor.numel(), tensor.dtype


def _state_keys(flat: dict[str, Any]) -> dict[tuple[int, int, torch.dtype], str]:
    """Flat state-dict key of every tensor (or ShardedTensor's local shard) by its memory."""
    out: dict[tuple[int, int, torch.dtype], str] = {}
    for key, value in flat.items():
        local = value.local_shards() if isinstance(value, ShardedTensor) else None
        tensor = local[0].tensor if local and len(local) == 1 else value
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            out.setdefault(_memory_key(tensor), key)
    return out


def _local_table(t: _Table, keys: dict[tuple[int, int, torch.dtype], str]) -> LocalTable:
    def column(what: str, tensor: torch.Tensor) -> Column:
        key = keys.get(_memory_key(tensor))
        if key is None:
            raise ReshardError(f"table {t.name!r}: no entry of the state dict holds its {what}; pass "
                               "the model's own state_dict() (and the fused optimizer's), not a copy")
        return Column(key, tensor)

    mc = t.module
    rows = [column("embedding weight", t.rows[0])]
    for state in t.rows[1:]:
        key = keys.get(_memory_key(state))
        if key is None:
            logger.warning("table %s: an optimizer state is not in the state dict; it is not loaded",
                           t.name)
        else:
            rows.append(Column(key, state))
    return LocalTable(t.name, t.start, column("_mch_sorted_raw_ids", mc._mch_sorted_raw_ids),
                      column("_mch_remapped_ids_mapping", mc._mch_remapped_ids_mapping),
                      {m: column(f"_mch_{m}", buf) for m, buf in sorted(mc._mch_metadata.items())},
                      rows)


class _WithoutKeys(DefaultLoadPlanner):
    """DCP's default load, minus the keys this module loads itself."""

    def __init__(self, skip: set[str]) -> None:
        super().__init__()
        self._skip = skip

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        return dataclasses.replace(plan, items=[i for i in plan.items if i.dest_index.fqn not in self._skip])


def load(state_dict: dict[str, Any], checkpoint_id: str, model: torch.nn.Module, *,
         score: str | None = "counts", process_group: Any = None) -> dict[str, ReshardReport]:
    """``dcp.load(state_dict, checkpoint_id)`` for a DMP-sharded TorchRec model saved at any
    world size: every managed-collision table of ``model`` moves by value. Collective.

    ``state_dict`` is what the caller would pass to ``dcp.load`` (e.g. ``{"model":
    model.state_dict(), "optim": model.fused_optimizer.state_dict()}``); its tensors are
    loaded in place. ``score``: the metadata column that decides eviction (lowest first) when
    a rank receives more ids than it has slots (tables without it evict the highest ids).
    Returns a report per table. Raises :class:`~megatron_ckpt_fixes.reshard.errors.ReshardError` on every rank when a
    table cannot be loaded (it is then left untouched). The buffers are written sorted and
    within the model's own segments, so the caller's ``model.load_state_dict`` afterwards
    passes TorchRec's ``validate_state`` (which re-sorts them; not repeated here, it costs a
    sort of every table).
    """
    group = process_group
    flat, _ = flatten_state_dict(state_dict)
    keys = _state_keys(flat)
    try:
        found, problems = [(t, _local_table(t, keys)) for t in _tables(model)], []
    except Exception as exc:  # noqa: BLE001 - raised on every rank by require_same()
        found, problems = [], [f"finding the managed-collision tables of the model and their state-dict "
                               f"entries failed on rank {dist.get_rank(group)}: {exc}"]
    plan = [(lt.name, lt.ids.key, lt.slots.key, {m: c.key for m, c in lt.metadata.items()},
             [c.key for c in lt.rows]) for _, lt in found]
    require_same("(all tables)", "the managed-collision tables and their checkpoint keys", plan, group, problems)
    reports: dict[str, ReshardReport] = {}
    with torch.no_grad():
        for table, local in found:
            routing = TorchRecRouting(table.module.input_size(), table.module.buckets())
            by = score if score in local.metadata else None  # e.g. LRU tables keep no counts
            reports[local.name] = load_table(checkpoint_id, local, ownership=routing, score=by, group=group)
    skip = {c.key for _, lt in found for c in (*lt.buffers(), *lt.rows)}
    skip |= {keys[_memory_key(t.segments)] for t, _ in found if _memory_key(t.segments) in keys}
    dcp.load(state_dict, checkpoint_id=checkpoint_id, planner=_WithoutKeys(skip), process_group=group)
    return reports


__all__ = ["TorchRecRouting", "load"]
