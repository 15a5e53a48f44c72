"""TorchRec ``MCHManagedCollisionModule`` state through DCP, resharded by value on load.

TorchRec 1.9.2 cannot be imported next to torch 2.13 (its FBGEMM CPU build fails to load),
so :class:`ZchTable` reproduces the module's persistent state with the same buffer names and
layout (``_mch_sorted_raw_ids``, ``_mch_remapped_ids_mapping``, ``_mch_<metadata>``,
``_output_segments_tensor``, ``_current_iter_tensor``) and the same lookup (``_mch_remap``).

Checkpoint format: each ``_mch_*`` buffer and each embedding/optimizer row tensor is saved as
a row-wise ``ShardedTensor`` whose chunk on rank r starts at that rank's
``output_global_offset`` (TorchRec's own sharded layout); ``_current_iter_tensor`` is a
``ShardedTensor`` of one element per rank. The saved world size and slot ranges are read from
the chunks in DCP's ``.metadata``, never from file names. The saved ``_output_segments_tensor``
is not used: the segments are rebuilt from the current ranges.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards

from ..agreement import gather
from .errors import ReshardError, check_problems, problem, require_same
from .ownership import BlockOwnership, KeyOwnership
from .resharder import ReshardReport, ReshardSpec, SavedWindow, reshard
from .table import MISS_ID, SlotRanges, TableShard, even_bounds

logger = logging.getLogger(__name__)

IDS, MAPPING, ITER, SEGMENTS = ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping",
                                "_current_iter_tensor", "_output_segments_tensor")
_MAX_SEGMENTS = 1025  # TorchRec pads the segments to 1025 entries (1024 shards)


class ZchTable(torch.nn.Module):
    """The persistent state of one rank's ``MCHManagedCollisionModule``."""

    def __init__(self, ranges: SlotRanges, rank: int, metadata: Sequence[str] = ("counts",)) -> None:
        super().__init__()
        self.ranges, self.rank = ranges, rank
        self.metadata_names = tuple(metadata)
        start, size = ranges.start(rank), ranges.size(rank)
        self.register_buffer(IDS, torch.full((size,), MISS_ID, dtype=torch.int64))
        self.register_buffer(MAPPING, torch.arange(start, start + size, dtype=torch.int64))
        for name in self.metadata_names:
            self.register_buffer(f"_mch_{name}", torch.zeros(size, dtype=torch.int64))
        segments = list(ranges.bounds) + [-1] * (_MAX_SEGMENTS - len(ranges.bounds))
        self.register_buffer(SEGMENTS, torch.tensor(segments, dtype=torch.int64))
        self.register_buffer(ITER, torch.zeros(1, dtype=torch.int64))

    @property
    def output_global_offset(self) -> int:
        return self.ranges.start(self.rank)

    @property
    def zch_size(self) -> int:
        return self.ranges.size(self.rank)

    def table(self) -> TableShard:
        return TableShard(self.output_global_offset, getattr(self, IDS), getattr(self, MAPPING),
                          {m: getattr(self, f"_mch_{m}") for m in self.metadata_names})

    @torch.no_grad()
    def set_table(self, table: TableShard) -> None:
        problems = table.problems("(set_table)", self.rank)
        if table.start != self.output_global_offset or table.size != self.zch_size:
            problems.append(f"table covers [{table.start}, {table.start + table.size}), module "
                            f"serves [{self.output_global_offset}, {self.output_global_offset + self.zch_size})")
        if problems:
            raise ReshardError("; ".join(problems))
        getattr(self, IDS).copy_(table.ids)
        getattr(self, MAPPING).copy_(table.slots)
        for m in self.metadata_names:
            getattr(self, f"_mch_{m}").copy_(table.metadata[m])

    def remap(self, ids: torch.Tensor) -> torch.Tensor:
        """Global slot per raw id; misses go to the last slot of the range (TorchRec's rule)."""
        return self.table().lookup(ids)

    def validate_state(self) -> None:
        """TorchRec's post-load check: the local range must be built from the segments."""
        seg = getattr(self, SEGMENTS).tolist()
        start, end = self.output_global_offset, self.output_global_offset + self.zch_size
        if start not in seg or end not in seg:
            raise ReshardError(f"rank {self.rank}: shard [{start}, {end}) cannot be built out of "
                               f"segments {[s for s in seg if s >= 0]}")


def sharded_rows(local: torch.Tensor, offset: int, total: int, group: Any = None) -> ShardedTensor:
    """A row-wise ``ShardedTensor``: this rank holds rows ``[offset, offset + len(local))`` of
    ``total``. A rank holding no rows passes an empty ``local``. Collective."""
    rank = dist.get_rank(group)
    shards = []
    if local.shape[0]:
        meta = ShardMetadata(shard_offsets=[offset] + [0] * (local.dim() - 1),
                             shard_sizes=list(local.shape), placement=f"rank:{rank}/{local.device}")
        shards = [Shard(local, meta)]
    return init_from_local_shards(shards, total, *local.shape[1:], process_group=group)


def mch_state_dict(prefix: str, module: ZchTable, rows: Mapping[str, torch.Tensor],
                   group: Any = None) -> dict[str, ShardedTensor]:
    """What to pass to ``dcp.save``: the MCH buffers under ``prefix.<buffer>`` and the row
    tensors (keys are checkpoint keys, values this rank's ``[zch_size, ...]`` rows)."""
    off, total = module.output_global_offset, module.ranges.total
    state = {f"{prefix}.{name}": sharded_rows(getattr(module, name), off, total, group)
             for name in (IDS, MAPPING, *(f"_mch_{m}" for m in module.metadata_names))}
    state[f"{prefix}.{ITER}"] = sharded_rows(getattr(module, ITER), module.rank,
                                             module.ranges.world_size, group)
    state.update({key: sharded_rows(t, off, total, group) for key, t in rows.items()})
    return state


def saved_ranges(checkpoint_id: str, prefix: str, metadata: Sequence[str],
                 row_keys: Sequence[str]) -> SlotRanges:
    """Saved slot ranges from the checkpoint's own chunk metadata; every MCH buffer must agree
    and every row tensor must have one row per saved slot."""
    md = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    key = f"{prefix}.{IDS}"
    if key not in md:
        raise ReshardError(f"table {prefix!r}: {key!r} not in checkpoint {checkpoint_id}")
    chunks = sorted((int(c.offsets[0]), int(c.sizes[0])) for c in md[key].chunks)
    ranges = SlotRanges.from_chunks(prefix, chunks, "saved layout")
    for name in (MAPPING, *(f"_mch_{m}" for m in metadata)):
        other = md.get(f"{prefix}.{name}")
        if other is None or sorted((int(c.offsets[0]), int(c.sizes[0])) for c in other.chunks) != chunks:
            raise ReshardError(f"table {prefix!r}: buffer {name!r} is missing or chunked unlike {IDS}")
    iters = md.get(f"{prefix}.{ITER}")
    if iters is None or int(iters.size[0]) != ranges.world_size:
        raise ReshardError(f"table {prefix!r}: {ITER} is missing or does not have one entry per "
                           f"saved rank ({ranges.world_size})")
    for row_key in row_keys:
        if row_key not in md or int(md[row_key].size[0]) != ranges.total:
            raise ReshardError(f"table {prefix!r}: rows {row_key!r} missing or not "
                               f"{ranges.total} rows long")
    return ranges


def _agreed(prefix: str, what: str, compute: Any, group: Any) -> Any:
    """Run a local computation on every rank; agree on failure and on the result."""
    rank = dist.get_rank(group)
    try:
        value, problems = compute(), []
    except Exception as exc:  # noqa: BLE001 - raised on every rank by check_problems()
        value, problems = None, [problem(prefix, rank, f"{what}: {exc}")]
    check_problems(prefix, problems, group)
    require_same(prefix, what, value, group)
    return value


def load_mch(checkpoint_id: str, prefix: str, module: ZchTable, rows: Mapping[str, torch.Tensor], *,
             ownership: KeyOwnership = BlockOwnership(), score: str | None = "counts",
             group: Any = None) -> ReshardReport:
    """Load a table saved by :func:`mch_state_dict` at any world size into ``module`` and
    ``rows`` (this rank's row tensors, overwritten in place), moving entries by value.

    Collective. When the saved and current slot ranges are identical the buffers are loaded
    by position (no exchange); otherwise :func:`~.resharder.reshard` runs. Both choices and
    every failure are agreed by all ranks.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    meta = module.metadata_names
    saved, _, _ = _agreed(prefix, "the saved layout and the columns to load",
                          lambda: (saved_ranges(checkpoint_id, prefix, meta, list(rows)), meta,
                                   sorted(rows)), group)
    target = _agreed(prefix, "the current layout", lambda: _current_ranges(prefix, module, group), group)
    names = (IDS, MAPPING, *(f"_mch_{m}" for m in meta))
    if saved == target:
        buffers = {b: getattr(module, b) for b in names}
        iters = _read(checkpoint_id, prefix, buffers, rows, target.start(rank), saved, group)
        check_problems(prefix, module.table().problems(prefix, rank), group)
        report = _positional_report(prefix, module, rank, group)
    else:
        windows = even_bounds(saved.total, world)
        lo, n = windows[rank], windows[rank + 1] - windows[rank]
        buffers = {b: torch.empty(n, dtype=torch.int64) for b in names}
        win_rows = {k: torch.empty((n,) + tuple(t.shape[1:]), dtype=t.dtype) for k, t in rows.items()}
        iters = _read(checkpoint_id, prefix, buffers, win_rows, lo, saved, group)
        window = SavedWindow(lo, buffers[IDS], buffers[MAPPING],
                             {m: buffers[f"_mch_{m}"] for m in meta}, win_rows)
        del buffers, win_rows
        with torch.no_grad():
            result = reshard(window, ReshardSpec(prefix, saved, target, windows, ownership, score),
                             out_rows=rows, group=group)
        del window
        module.set_table(result.table)
        report = result.report
    _set_iter(module, iters)
    logger.info("load %s: %d -> %d ranks (%s), rank %d holds %d ids, evicted %d (all ranks: %d)",
                prefix, saved.world_size, world, "by position" if saved == target else "by value",
                rank, report.kept, report.evicted, report.evicted_total)
    return report


def _read(checkpoint_id: str, prefix: str, buffers: Mapping[str, torch.Tensor],
          rows: Mapping[str, torch.Tensor], offset: int, saved: SlotRanges, group: Any) -> torch.Tensor:
    """One DCP load: saved positions/slots ``[offset, offset + n)`` of every buffer and row
    tensor into the given tensors; returns the saved per-rank counters."""
    state: dict[str, Any] = {f"{prefix}.{b}": sharded_rows(t, offset, saved.total, group)
                             for b, t in buffers.items()}
    state.update({k: sharded_rows(t, offset, saved.total, group) for k, t in rows.items()})
    iters = torch.zeros(saved.world_size, dtype=torch.int64)
    state[f"{prefix}.{ITER}"] = iters
    dcp.load(state, checkpoint_id=checkpoint_id, process_group=group)
    return iters


def _positional_report(prefix: str, module: ZchTable, rank: int, group: Any) -> ReshardReport:
    kept = int((getattr(module, IDS) != MISS_ID).sum())
    kept_total = torch.tensor([kept])
    dist.all_reduce(kept_total, group=group)
    return ReshardReport(prefix, rank, kept, kept, 0, 0, int(kept_total[0]))


def _current_ranges(prefix: str, module: ZchTable, group: Any) -> SlotRanges:
    chunks = gather((module.output_global_offset, module.zch_size), group)
    return SlotRanges.from_chunks(prefix, chunks, "current layout")


@torch.no_grad()
def _set_iter(module: ZchTable, saved_iters: torch.Tensor) -> None:
    """The counter drives eviction; ranks step it together, so the newest saved value wins."""
    getattr(module, ITER).fill_(int(saved_iters.max()))
