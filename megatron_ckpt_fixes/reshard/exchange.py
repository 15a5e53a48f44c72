"""Data movement: send rows of small columns to chosen ranks with ``all_to_all_single``.

The entries of a table (ids, saved slots, metadata) go to the ranks that serve them: one
``all_to_all_single`` of counts, then one per column, received straight into the new column
(no unpacking copy). On the way out a column is sent as it is when its rows are already
grouped by destination (sorted ids under block routing), else gathered into one send buffer
that every column reuses. Fresh memory, not arithmetic, is what such a step costs (the
first touch of a page costs more than a copy into it), so nothing is allocated twice. Bytes
move as machine words that every backend can exchange (int64, int32 or uint8: gloo and NCCL
have no int16, so a bf16 row of odd width travels as bytes, never as int16). Row columns
(embedding weights, optimizer state) do not travel: each rank reads its own from the
checkpoint (:mod:`.saved_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_ckpt_fixes.compat.device import collective_device

#: Word types every backend can move (gloo and NCCL have no int16).
_WORDS = (torch.int64, torch.int32, torch.uint8)
_COUNTING_SORT_MAX_WORLD = 16


def _row_bytes(column: torch.Tensor) -> int:
    return math.prod(column.shape[1:]) * column.element_size()


def word_for(columns: Sequence[torch.Tensor]) -> torch.dtype:
    """The widest word that every column's row is a whole number of (int64 for int64 ids and
    float32 rows of even width, uint8 for a bf16 row of odd width)."""
    return next(w for w in _WORDS if all(_row_bytes(c) % w.itemsize == 0 for c in columns))


def as_words(column: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """A contiguous column as ``[rows, words]`` of ``word`` (a view when it is contiguous)."""
    n = column.shape[0]
    return column.contiguous().reshape(n, math.prod(column.shape[1:])).view(torch.uint8).view(word)


@dataclass(frozen=True)
class Received:
    """Rows that arrived, grouped by sending rank in rank order; ``counts[s]`` came from rank s."""

    columns: list[torch.Tensor]
    counts: list[int]


def grouping(dest: torch.Tensor, world: int, index: torch.Tensor | None = None) -> torch.Tensor | None:
    """Rows ``index`` (default all) reordered so that destinations are grouped in rank order,
    keeping the given order inside each group; ``None`` when the rows are in that order
    already (no index, destinations non-decreasing: sorted ids under block routing). A
    counting sort (one pass per rank) for the usual small worlds: faster than a stable sort
    of the int64 destinations."""
    if bool((dest[1:] >= dest[:-1]).all()):
        return index
    if world <= _COUNTING_SORT_MAX_WORLD:
        order = torch.cat([(dest == r).nonzero().squeeze(1) for r in range(world)])
    else:
        order = torch.sort(dest, stable=True).indices
    return order if index is None else index.index_select(0, order)


def _all_to_all(incoming: torch.Tensor, outgoing: torch.Tensor, recv: Sequence[int], sent: Sequence[int],
                device: torch.device, group: Any) -> Callable[[], None]:
    """Start an ``all_to_all_single`` of flat CPU word buffers, through the backend's device;
    returns what waits for it (the outgoing buffer is in use until then)."""
    splits = {"output_split_sizes": list(recv), "input_split_sizes": list(sent), "group": group, "async_op": True}
    if device.type == "cpu":
        return dist.all_to_all_single(incoming, outgoing, **splits).wait
    staged = torch.empty(incoming.shape, dtype=incoming.dtype, device=device)
    work = dist.all_to_all_single(staged, outgoing.to(device), **splits)

    def finish() -> None:
        work.wait()
        incoming.copy_(staged.cpu())

    return finish


def carve(into: torch.Tensor | None, shapes: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """New tensors of the given dtypes and shapes: 64-byte aligned views, front to back, of
    the byte buffer ``into`` when they all fit (pages touched before cost less than fresh
    ones: a first touch costs more than a copy), else fresh."""
    sizes = [-(-math.prod(shape) * dtype.itemsize // 64) * 64 for dtype, shape in shapes]
    if into is None or into.numel() < sum(sizes) or into.data_ptr() % 64:
        return [torch.empty(shape, dtype=dtype) for dtype, shape in shapes]
    out, offset = [], 0
    for (dtype, shape), size in zip(shapes, sizes):
        out.append(into[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
        offset += size
    return out


def send_rows(columns: Sequence[torch.Tensor], dest: torch.Tensor, index: torch.Tensor | None = None,
              group: Any = None, into: torch.Tensor | None = None) -> Received:
    """Send row ``index[i]`` (default ``i``) of every column to rank ``dest[i]``. Collective.
    Rows keep their relative order per destination (stable); see :func:`send_grouped`."""
    world = dist.get_world_size(group)
    counts = torch.bincount(dest, minlength=world).tolist()
    return send_grouped(columns, counts, grouping(dest, world, index), group, into)


def send_grouped(columns: Sequence[torch.Tensor], counts: Sequence[int], index: torch.Tensor | None = None,
                 group: Any = None, into: torch.Tensor | None = None) -> Received:
    """Send rows ``index`` (default all) of every column, grouped by destination already:
    the first ``counts[0]`` to rank 0, the next ``counts[1]`` to rank 1, ... Collective.

    The columns' exchanges run back to back and are waited for together (one wait, not one
    per column), except that a column gathered into the shared send buffer waits for the
    previous one. The new columns are carved out of the byte buffer ``into`` when they fit.
    Memory: the new columns and at most one send buffer (the largest column's share).
    """
    device = collective_device(group)
    sent = torch.tensor(list(counts), dtype=torch.int64)
    recv_counts = torch.empty_like(sent, device=device)
    dist.all_to_all_single(recv_counts, sent.to(device), group=group)
    recv, sent_list = recv_counts.tolist(), sent.tolist()
    arriving = sum(recv)
    leaving = sum(sent_list)
    staging = torch.empty(leaving * max((_row_bytes(c) for c in columns), default=0) if index is not None else 0,
                          dtype=torch.uint8)
    out = carve(into, [(c.dtype, (arriving, *c.shape[1:])) for c in columns])
    pending = []
    for column, incoming in zip(columns, out):
        word = word_for([column])
        words = as_words(column, word)
        width = words.shape[1]
        if index is None:
            outgoing = words[:leaving]
        else:
            while pending:  # the send buffer is about to be overwritten
                pending.pop()()
            outgoing = staging[:leaving * width * word.itemsize].view(word).view(leaving, width)
            torch.index_select(words, 0, index, out=outgoing)
        pending.append(_all_to_all(as_words(incoming, word).reshape(-1), outgoing.reshape(-1),
                                   [n * width for n in recv], [n * width for n in sent_list], device, group))
    for finish in pending:
        finish()
    return Received(out, recv)
