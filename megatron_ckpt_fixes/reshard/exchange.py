"""The one data movement primitive: send each row of a table to a chosen rank.

All columns that travel together (ids, slots, every metadata column, embedding and
optimizer rows) are packed into one byte matrix, so a phase costs one ``all_to_all_single``
of counts and one of payload, whatever the number of columns. Only ``all_to_all_single``
with uneven splits is needed; gloo implements it on torch 2.13 (checked by the tests).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..compat.device import collective_device


def _width(column: torch.Tensor) -> int:
    return math.prod(column.shape[1:])


def pack(columns: Sequence[torch.Tensor]) -> torch.Tensor:
    """Columns with a common first dimension -> one ``uint8`` matrix ``[n, total_bytes]``."""
    n = columns[0].shape[0]
    parts = [c.contiguous().reshape(n, _width(c)).view(torch.uint8) for c in columns]
    return torch.cat(parts, dim=1)


def unpack(packed: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`pack`; ``like`` gives each column's dtype and trailing shape."""
    n = packed.shape[0]
    out, offset = [], 0
    for ref in like:
        width = _width(ref) * ref.element_size()
        chunk = torch.empty((n, width), dtype=torch.uint8, device=packed.device)
        chunk.copy_(packed[:, offset:offset + width])  # fresh strides, also when n == 0
        out.append(chunk.view(ref.dtype).reshape((n,) + tuple(ref.shape[1:])))
        offset += width
    return out


@dataclass(frozen=True)
class Received:
    """Rows that arrived, grouped by sending rank in rank order; ``sources[i]`` sent row i."""

    payload: torch.Tensor
    sources: torch.Tensor


def send_rows(payload: torch.Tensor, dest: torch.Tensor, group: Any = None) -> Received:
    """Send ``payload[i]`` to rank ``dest[i]``. Collective over ``group``.

    Memory is the local rows plus the received rows; nothing global is built.
    """
    world = dist.get_world_size(group)
    device = collective_device(group)
    order = torch.argsort(dest, stable=True)
    outgoing = payload[order].to(device)
    send_counts = torch.bincount(dest, minlength=world).to(device=device, dtype=torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    incoming = torch.empty((int(recv_counts.sum()),) + tuple(payload.shape[1:]),
                           dtype=payload.dtype, device=device)
    dist.all_to_all_single(incoming, outgoing, output_split_sizes=recv_counts.tolist(),
                           input_split_sizes=send_counts.tolist(), group=group)
    sources = torch.repeat_interleave(torch.arange(world), recv_counts.cpu())
    return Received(incoming.to(payload.device), sources)
