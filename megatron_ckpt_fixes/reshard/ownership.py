"""Key ownership: which rank serves a raw id at lookup time.

This, not the slot an id happened to get, decides where an entry must live after
resharding: a lookup only ever searches the table of the rank the id is routed to. The
slot-routed upstream fix ignores that, which is why it loses ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KeyOwnership(Protocol):
    """Maps raw ids to the rank that serves them in a world of ``world_size`` ranks."""

    def owner(self, ids: torch.Tensor, world_size: int) -> torch.Tensor:
        """Owning rank per id, int64, same shape as ``ids``."""
        ...


@runtime_checkable
class RangeOwnership(KeyOwnership, Protocol):
    """An ownership that routes ids by contiguous ranges (blocks), so that the ids of a
    sorted run that go to one rank are found by a binary search per rank, with nothing
    computed per id (``cuts``); ``owner`` still routes every id."""

    def cuts(self, world_size: int) -> tuple[int, ...] | None:
        """``b_0 <= ... <= b_W``: rank r serves the ids in ``[b_r, b_{r+1})``; ids outside
        ``[b_0, b_W)`` go by ``owner``. ``None``: not by ranges at this world size."""
        ...


#: The largest id routed by range: int64 max is the miss id, never a real one.
_ID_END = (1 << 63) - 1


@dataclass(frozen=True)
class BlockOwnership:
    """TorchRec's row-wise input bucketization (the default).

    ``RwSparseFeaturesDist`` cuts the input id space ``[0, input_hash_size)`` into
    ``world_size`` blocks of ``ceil(input_hash_size / world_size)`` ids; FBGEMM's
    ``block_bucketize_sparse_features`` sends an id beyond the last block to
    ``id % world_size``. Both rules are reproduced here.
    """

    input_hash_size: int = (1 << 63) - 1

    def owner(self, ids: torch.Tensor, world_size: int) -> torch.Tensor:
        block = -(-self.input_hash_size // world_size)
        if block * world_size >= 1 << 63:  # every int64 id lies inside the blocks
            return torch.div(ids, block, rounding_mode="floor")
        inside = ids < block * world_size
        return torch.where(inside, torch.div(ids, block, rounding_mode="floor"),
                           torch.remainder(ids, world_size))

    def cuts(self, world_size: int) -> tuple[int, ...]:
        block = -(-self.input_hash_size // world_size)
        return tuple(min(r * block, _ID_END) for r in range(world_size + 1))


@dataclass(frozen=True)
class ModuloOwnership:
    """``id % world_size``: hash-style routing, for tables sharded that way."""

    def owner(self, ids: torch.Tensor, world_size: int) -> torch.Tensor:
        return torch.remainder(ids, world_size)
