"""Test-only: THE UPSTREAM APPROACH to resharding MCH state, reproduced for comparison.

TorchEasyRec PR 467 (see UPSTREAM.md, section 4): load the MCH buffers by position at the new
world size, send each entry to ``dest = slot // local_zch_size`` (the rank whose embedding rows
hold its slot), pad with the unused local slots and re-sort. Slots, and so embedding rows, stay
where they were, which avoids the out-of-range crash. But lookups route a raw id to the rank
that owns its *value*; after a non-divisible world-size change that is often another rank, so
the id is no longer found. It also lets a real id keep the slot that is now a rank's miss slot.

Single-process, over all saved shards at once: this is a model of what the ranks end up with,
written only to count what it loses (test_reshard_mch.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_ckpt_fixes.reshard import MISS_ID, TableShard


def slot_routed_tables(saved: Sequence[TableShard], world_size: int) -> list[TableShard]:
    """The tables each of ``world_size`` ranks holds after the upstream slot-routed reshard.

    Like upstream, assumes equal local sizes (``total // world_size``).
    """
    ids = torch.cat([t.ids for t in saved])
    slots = torch.cat([t.slots for t in saved])
    real = ids != MISS_ID
    ids, slots = ids[real], slots[real]
    cps = sum(t.size for t in saved) // world_size
    dest = torch.div(slots, cps, rounding_mode="floor")
    tables = []
    for rank in range(world_size):
        mine = dest == rank
        start = rank * cps
        used = torch.zeros(cps, dtype=torch.bool)
        used[slots[mine] - start] = True
        free = torch.arange(start, start + cps)[~used]
        all_ids = torch.cat([ids[mine], torch.full((free.numel(),), MISS_ID, dtype=torch.int64)])
        all_slots = torch.cat([slots[mine], free])
        order = torch.argsort(all_ids, stable=True)
        tables.append(TableShard(start, all_ids[order], all_slots[order]))
    return tables
