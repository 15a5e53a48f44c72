"""The one data movement primitive: send rows of several columns to chosen ranks.

All columns that travel together (ids, slots, every metadata column, embedding and
optimizer rows) are packed into one matrix of machine words, so a phase costs one
``all_to_all_single`` of counts and one of payload, whatever the number of columns. Rows are
gathered straight into the send buffer in destination order, and the received columns are
views into the receive buffer: one copy out, one copy in. Only ``all_to_all_single`` with
uneven splits is needed; gloo implements it on torch 2.13 (the tests run it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..compat.device import collective_device

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _row_bytes(column: torch.Tensor) -> int:
    return math.prod(column.shape[1:]) * column.element_size()


def _word(columns: Sequence[torch.Tensor]) -> torch.dtype:
    """The widest word that every column's row is a whole number of (int64 for the usual
    int64 ids and float32 rows of even width), so packing moves words, not bytes."""
    widths = [_row_bytes(c) for c in columns]
    return next(w for w in _WORDS if all(b % w.itemsize == 0 for b in widths))


def _as_words(column: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    n = column.shape[0]
    return column.contiguous().reshape(n, math.prod(column.shape[1:])).view(torch.uint8).view(word)


def pack(columns: Sequence[torch.Tensor], index: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``index`` (default: all) of each column -> one word matrix ``[len(index), words]``."""
    word = _word(columns)
    parts = [_as_words(c, word) for c in columns]
    n = parts[0].shape[0] if index is None else int(index.numel())
    out = torch.empty((n, sum(p.shape[1] for p in parts)), dtype=word)
    offset = 0
    for part in parts:
        width = part.shape[1]
        out[:, offset:offset + width] = part if index is None else part.index_select(0, index)
        offset += width
    return out


def unpack(packed: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`pack`; ``like`` gives each column's dtype and trailing shape.

    Returns views into ``packed`` where the dtypes allow it, copies otherwise.
    """
    n, word_size = packed.shape[0], packed.element_size()
    out, offset = [], 0
    for ref in like:
        width = _row_bytes(ref) // word_size
        part = packed[:, offset:offset + width]
        if ref.element_size() > word_size:  # a wider dtype cannot view a strided narrow slice
            part = torch.empty((n, width), dtype=packed.dtype).copy_(part)
        out.append(part.view(ref.dtype).reshape((n,) + tuple(ref.shape[1:])))
        offset += width
    return out


@dataclass(frozen=True)
class Received:
    """Rows that arrived, grouped by sending rank in rank order; ``sources[i]`` sent row i."""

    columns: list[torch.Tensor]
    sources: torch.Tensor


def send_rows(columns: Sequence[torch.Tensor], dest: torch.Tensor, index: torch.Tensor | None = None,
              group: Any = None) -> Received:
    """Send row ``index[i]`` (default ``i``) of every column to rank ``dest[i]``. Collective.

    Memory is one send and one receive buffer; nothing global is built.
    """
    world = dist.get_world_size(group)
    device = collective_device(group)
    if bool((dest[1:] >= dest[:-1]).all()):  # already grouped (e.g. ids sorted, block owners)
        order = index
    else:
        order = torch.argsort(dest, stable=True)
        order = order if index is None else index.index_select(0, order)
    outgoing = pack(columns, order).to(device)
    send_counts = torch.bincount(dest, minlength=world).to(device=device, dtype=torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    incoming = torch.empty((int(recv_counts.sum()), outgoing.shape[1]), dtype=outgoing.dtype,
                           device=device)
    dist.all_to_all_single(incoming, outgoing, output_split_sizes=recv_counts.tolist(),
                           input_split_sizes=send_counts.tolist(), group=group)
    del outgoing
    sources = torch.repeat_interleave(torch.arange(world), recv_counts.cpu())
    return Received(unpack(incoming.cpu(), columns), sources)
