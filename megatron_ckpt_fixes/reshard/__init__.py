"""Value-aware resharding of managed-collision (ZCH) key -> slot tables across world sizes.

A ZCH table maps raw ids to global embedding slots; each rank serves a slot range and looks
up only the ids routed to it by value. When the world size changes, DCP's positional
resharding puts global slots outside the local range, and routing entries by slot (the
upstream fix) puts them where no lookup looks. Here every entry moves to the rank that owns
its id, gets a free slot there, and its embedding and optimizer rows move with it, so every
id that was reachable before is reachable after, with bitwise-identical rows.

Reading order: :mod:`.table` (data model, validation) -> :mod:`.ownership` (who serves an id)
-> :mod:`.routing` (where a window's entries go) -> :mod:`.exchange` (all_to_all of entries)
-> :mod:`.saved_rows` (where rows are read) -> :mod:`.records` (where a saved chunk's bytes
lie in a DCP checkpoint) -> :mod:`.saved_chunks` (reading only the rows asked for) ->
:mod:`.errors` (agreed failures) ->
:mod:`.window` (what a rank reads and checks) -> :mod:`.resharder` (the algorithm) ->
:mod:`.checkpoint` (one table through DCP) ->
:mod:`.torchrec_dmp` (every managed-collision table of a TorchRec model; imports TorchRec,
so it is not imported here).
"""

from megatron_ckpt_fixes.reshard.checkpoint import (Column, LocalTable, load_table, saved_ranges,
    sharded_rows, table_state_dict)
from megatron_ckpt_fixes.reshard.errors import ReshardError
from megatron_ckpt_fixes.reshard.ownership import (BlockOwnership, KeyOwnership, ModuloOwnership,
    RangeOwnership)
from megatron_ckpt_fixes.reshard.resharder import ReshardReport, ReshardResult, reshard
from megatron_ckpt_fixes.reshard.records import NotPlainRecord
from megatron_ckpt_fixes.reshard.saved_chunks import CheckpointRows, read_rows
from megatron_ckpt_fixes.reshard.saved_rows import SavedEntries, SavedRows, TensorRows
from megatron_ckpt_fixes.reshard.table import MISS_ID, SlotRanges, TableShard
from megatron_ckpt_fixes.reshard.window import ReshardSpec, SavedWindow, read_windows

__all__ = [
    "MISS_ID",
    "BlockOwnership",
    "CheckpointRows",
    "Column",
    "KeyOwnership",
    "LocalTable",
    "ModuloOwnership",
    "NotPlainRecord",
    "RangeOwnership",
    "ReshardError",
    "ReshardReport",
    "ReshardResult",
    "ReshardSpec",
    "SavedEntries",
    "SavedRows",
    "SavedWindow",
    "SlotRanges",
    "TableShard",
    "TensorRows",
    "load_table",
    "read_rows",
    "read_windows",
    "reshard",
    "saved_ranges",
    "sharded_rows",
    "table_state_dict",
]
