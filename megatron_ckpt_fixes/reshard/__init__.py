"""Value-aware resharding of managed-collision (ZCH) key -> slot tables across world sizes.

A ZCH table maps raw ids to global embedding slots; each rank serves a slot range and looks
up only the ids routed to it by value. When the world size changes, DCP's positional
resharding puts global slots outside the local range, and routing entries by slot (the
upstream fix) puts them where no lookup looks. Here every entry moves to the rank that owns
its id, gets a free slot there, and its embedding and optimizer rows move with it, so every
id that was reachable before is reachable after, with bitwise-identical rows.

Reading order: :mod:`.table` (data model, validation) -> :mod:`.ownership` (who serves an id)
-> :mod:`.exchange` (batched all_to_all) -> :mod:`.errors` (agreed failures) ->
:mod:`.resharder` (the algorithm) -> :mod:`.mch` (TorchRec MCH buffers through DCP).
:mod:`.upstream` only models the upstream approach for the comparison test.
"""

from .errors import ReshardError
from .mch import ZchTable, load_mch, mch_state_dict, saved_ranges, sharded_rows
from .ownership import BlockOwnership, KeyOwnership, ModuloOwnership
from .resharder import ReshardReport, ReshardResult, ReshardSpec, SavedWindow, reshard
from .table import MISS_ID, SlotRanges, TableShard

__all__ = [
    "MISS_ID",
    "BlockOwnership",
    "KeyOwnership",
    "ModuloOwnership",
    "ReshardError",
    "ReshardReport",
    "ReshardResult",
    "ReshardSpec",
    "SavedWindow",
    "SlotRanges",
    "TableShard",
    "ZchTable",
    "load_mch",
    "mch_state_dict",
    "reshard",
    "saved_ranges",
    "sharded_rows",
]
