"""megatron-core's ``SequentialMLP.sharded_state_dict``, keeping the replica ids of DTensor
expert weights.

After its experts build their ``ShardedTensor``\\ s, ``SequentialMLP`` overwrites the
data-parallel part of every replica id with the expert-data-parallel rank ("replication
along DP modulo EP"): right for experts that every expert-data-parallel rank holds whole,
wrong for experts that FSDP2 shards over the expert-data-parallel mesh. Then only the
shards of expert-data-parallel rank 0 count as main replicas, the others are never written,
and the save is rejected for missing chunks. Here the overwrite is undone for the
``ShardedTensor``\\ s that :mod:`.helpers` built from a DTensor: their data-parallel part is
the rank's index over the DTensor mesh's ``Replicate`` axes again.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from megatron_ckpt_fixes.integrations.mcore_dtensor.helpers import MESH_REPLICA_ATTR


def restore_mesh_replicas(sharded_state_dict: dict[str, Any]) -> None:
    """Put back the data-parallel part of the replica id of every DTensor-built item."""
    for item in sharded_state_dict.values():
        replica = getattr(item, MESH_REPLICA_ATTR, None)
        if replica is not None and isinstance(item.replica_id, tuple):
            item.replica_id = (*item.replica_id[:2], replica)


def mesh_replicas_kept(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``SequentialMLP.sharded_state_dict`` (see the module docstring)."""

    @functools.wraps(original)
    def sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        restore_mesh_replicas(result)
        return result

    return sharded_state_dict
