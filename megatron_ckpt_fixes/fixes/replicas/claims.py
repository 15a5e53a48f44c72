"""What a rank declares: one claim per chunk it holds, naming the chunk and its replica id.

megatron-core writes one replica of each chunk (the main one, ``replica_id`` 0 in every
dimension) and hands it to every rank that declares the chunk at load. A chunk is the same
chunk on two ranks when its kind, key and global offset agree (megatron-core >= 0.16 refuses
ShardedTensors with a flattened range, so an offset names one chunk). The common state is one chunk that
every rank declares (megatron-core >= 0.19 saves it as a ShardedObject with
``replica_id=rank``; 0.16 writes rank 0's as ``common.pt``), rank 0's being the main one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica

#: ``(kind, key, global offset)``: equal on the ranks sharing it.
ChunkId = tuple[str, str, tuple[int, ...]]

TENSOR, OBJECT, COMMON = "ShardedTensor", "ShardedObject", "common state"
#: The common state's chunk.
COMMON_CHUNK: ChunkId = (COMMON, "common_state", ())


@dataclass(frozen=True)
class Claim:
    """One chunk a rank holds: its replica id and the value that the claim says is shared."""

    replica_id: Any
    value: Any

    @property
    def main(self) -> bool:
        return bool(is_main_replica(self.replica_id))


def chunk_id(item: Any) -> ChunkId | None:
    """The chunk a sharded item declares; None for anything that is neither a tensor nor an
    object (megatron-core saves nothing else)."""
    if isinstance(item, ShardedTensor):
        return (TENSOR, item.key, tuple(item.global_offset))
    if isinstance(item, ShardedObject):
        return (OBJECT, item.key, tuple(item.global_offset))
    return None


def local_claims(sharded_part: Any, common_state: Any, rank: int) -> dict[ChunkId, Claim]:
    """Every chunk this rank declares in the state dict to save, and the common state."""
    claims: dict[ChunkId, Claim] = {}
    for item in nested_values(sharded_part):
        chunk = chunk_id(item)
        if chunk is not None:
            claims[chunk] = Claim(item.replica_id, item.data)
    claims[COMMON_CHUNK] = Claim(rank, common_state)
    return claims


def describe_chunk(chunk: ChunkId) -> str:
    """How an error line names a chunk."""
    kind, key, offset = chunk
    if kind == COMMON:
        return "the common state (after the caller's preprocessing)"
    return f"{kind} {key!r} at offset {offset}"
