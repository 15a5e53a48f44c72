"""Where the saved rows come from: rank-local reads of any range of the saved row columns.

The resharder sends ids and metadata between ranks, never rows. A row column (embedding
weights, an optimizer's per-row state) is the bulk of a table's bytes, and it is already
stored where every rank can read it: each rank reads the saved chunks that hold the rows of
the ids it now serves and gathers those rows straight into its own tensors. So rows cross
no network and are copied once after the read, and a rank reads no more than a plain
positional DCP load reads when routing is by blocks of ids (TorchRec's): the saved chunks
that overlap its range. With routing by hash, every rank reads every saved chunk that holds
one of its ids (docs/reshard.md, "Known limits").

:class:`~.checkpoint.CheckpointRows` reads from a DCP checkpoint; :class:`TensorRows` serves
columns that every rank holds in memory (the generic API, tests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

#: dtype and trailing shape of one row of a column.
RowFormat = tuple[torch.dtype, tuple[int, ...]]


@runtime_checkable
class SavedRows(Protocol):
    """Rank-local random access to the saved row columns, addressed by saved global slot."""

    def row_format(self, name: str) -> RowFormat:
        """dtype and trailing shape of the saved rows of ``name`` (``KeyError`` if absent)."""
        ...

    def read(self, name: str, start: int, out: torch.Tensor) -> None:
        """Saved rows ``[start, start + len(out))`` of ``name`` into ``out``. Not collective."""
        ...


@dataclass(frozen=True)
class TensorRows:
    """Saved row columns held whole by every rank (``[saved slots, ...]`` each)."""

    columns: Mapping[str, torch.Tensor]

    def row_format(self, name: str) -> RowFormat:
        col = self.columns[name]
        return col.dtype, tuple(col.shape[1:])

    def read(self, name: str, start: int, out: torch.Tensor) -> None:
        out.copy_(self.columns[name][start:start + out.shape[0]])
