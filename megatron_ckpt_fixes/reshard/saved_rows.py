"""Where the saved rows come from: rank-local reads of any rows of the saved columns.

The resharder sends ids and metadata between ranks only where a rank cannot read them itself,
and rows never. A row column (embedding weights, an optimizer's per-row state) is the bulk of
a table's bytes, and it is already stored where every rank can read it: each rank reads the
rows of the ids it now serves, and only those (:meth:`SavedRows.gather`), straight into its
own tensors. So rows cross no network and are copied once. With routing by blocks of ids
(TorchRec's) a rank also reads its entries (ids, saved slots, metadata) itself
(:class:`SavedEntries`): they are one run of positions of each saved rank.

:class:`~.saved_chunks.CheckpointRows` reads from a DCP checkpoint by byte range;
:class:`TensorRows` serves columns that every rank holds in memory (the generic API, tests).
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

    def gather(self, name: str, start: int, index: torch.Tensor, out: torch.Tensor) -> None:
        """``out[j]`` = saved row ``start + index[j]`` of ``name``, for ``index`` increasing
        (int64). Not collective."""
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

    def gather(self, name: str, start: int, index: torch.Tensor, out: torch.Tensor) -> None:
        source = self.columns[name][start:]
        if out.is_contiguous():
            torch.index_select(source, 0, index, out=out)
        else:
            out.copy_(source.index_select(0, index))


@dataclass(frozen=True)
class SavedEntries:
    """Where any rank reads any saved positions of a table's buffers: the columns of
    ``source`` that hold the ids, their saved slots and each metadata column (by its name).
    Positions share the saved slot space with the rows (TorchRec's layout)."""

    source: SavedRows
    ids: str
    slots: str
    metadata: Mapping[str, str]
