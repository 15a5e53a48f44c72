"""The saved columns of a DCP checkpoint, read by byte range: only the rows a rank asks for.

A plain DCP read of rows ``[a, b)`` loads every saved chunk that overlaps them whole
(``torch.load`` of the chunk's record into fresh memory, then a copy of the part it wants).
On a reshard most of those bytes are thrown away, and the fresh memory's first touch is what
the load mostly costs. :class:`CheckpointRows` reads each chunk's rows where its record keeps
them (:mod:`.records`): a range of rows with one positioned read straight into the
destination, a gather of scattered rows through a memory map of the file, piece by piece
(``piece_bytes``), each piece mapped only over the rows it serves and unmapped before the
next, so the extra memory is one piece whatever the chunk's size.

A chunk that is not a plain record (compressed, transformed, another format, another dtype
or shape than the metadata says) is read through DCP as before, whole, with the reason
logged once and kept in :attr:`CheckpointRows.fallbacks`. Bytes that are damaged inside a
plain record are not detected here, as ``torch.load`` does not detect them either: that is
what the checksums feature verifies.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_ckpt_fixes.reshard.records import NotPlainRecord, RecordLayout, locate
from megatron_ckpt_fixes.reshard.saved_rows import RowFormat

logger = logging.getLogger(__name__)

#: Bytes of a saved chunk mapped at once by a gather, at most and at least.
PIECE_BYTES, MIN_PIECE_BYTES = 16 << 20, 1 << 20


def piece_bytes_for(shard_bytes: int) -> int:
    """The mapped piece for a rank whose local table is ``shard_bytes``: a sixteenth of it,
    within [1, 16] MiB. The piece is the reader's extra memory, so it follows the shard;
    smaller pieces cost more maps, hence CPU."""
    return min(PIECE_BYTES, max(MIN_PIECE_BYTES, shard_bytes // 16))


class _RowRanges(DefaultLoadPlanner):
    """DCP's load planner for saved rows ``[start, start + len(t))`` of each key into a plain
    tensor ``t``: any range, on any rank, planned by this rank alone (DCP's resharding reads
    the saved chunks that overlap it)."""

    def __init__(self, starts: Mapping[str, int]) -> None:
        super().__init__()
        self._starts = starts

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        items = []
        for key, tensor in self.state_dict.items():
            offsets = torch.Size([self._starts[key]] + [0] * (tensor.dim() - 1))
            items += create_read_items_for_chunk_list(key, md[key], [ChunkStorageMetadata(offsets, tensor.shape)])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        # The default looks a non-zero offset up in a ShardedTensor; here it is a plain tensor.
        return self.state_dict[index.fqn]


def read_rows(checkpoint_id: str, columns: Mapping[str, tuple[int, torch.Tensor]]) -> None:
    """Saved rows ``[start, start + len(t))`` of each key into ``t``, for ``key: (start, t)``,
    through DCP (every overlapping chunk loaded whole). One DCP load of this rank's alone:
    not collective, so ranks read different amounts."""
    with warnings.catch_warnings():  # DCP warns that no_dist means "a single process": intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({k: t for k, (_, t) in columns.items()}, checkpoint_id=checkpoint_id,
                 planner=_RowRanges({k: start for k, (start, _) in columns.items()}), no_dist=True)


def _as_row_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[n, ...]`` tensor as ``[n, row bytes]`` of uint8 (a view, detached:
    the bytes of a parameter are written as DCP's load writes them)."""
    return tensor.detach().view(tensor.shape[0], -1).view(torch.uint8)


class CheckpointRows:
    """The columns of a DCP checkpoint, by key, addressed by global row (slot):
    :class:`~.saved_rows.SavedRows`. Holds open files until :meth:`close` (or the end of a
    ``with`` block)."""

    def __init__(self, checkpoint_id: str, metadata: Any, piece_bytes: int = PIECE_BYTES) -> None:
        self.checkpoint_id = os.fspath(checkpoint_id)
        self.metadata = metadata
        self.piece_bytes = piece_bytes
        #: ``(key, first row of the chunk) -> reason`` for every chunk read through DCP.
        self.fallbacks: dict[tuple[str, int], str] = {}
        self._fds: dict[str, int] = {}
        self._chunks: dict[str, tuple[list[int], list[ChunkStorageMetadata]]] = {}
        self._layouts: dict[tuple[str, int], RecordLayout | None] = {}

    def __enter__(self) -> "CheckpointRows":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def row_format(self, name: str) -> RowFormat:
        entry = self.metadata.state_dict_metadata[name]
        return entry.properties.dtype, tuple(entry.size[1:])

    def _chunk_list(self, name: str) -> tuple[list[int], list[ChunkStorageMetadata]]:
        if name not in self._chunks:
            chunks = sorted(self.metadata.state_dict_metadata[name].chunks, key=lambda c: int(c.offsets[0]))
            self._chunks[name] = ([int(c.offsets[0]) for c in chunks], chunks)
        return self._chunks[name]

    def _spans(self, name: str, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """``(chunk index, lo, hi)`` for the saved chunks that hold rows ``[start, stop)``."""
        firsts, chunks = self._chunk_list(name)
        at = start
        while at < stop:
            i = bisect.bisect_right(firsts, at) - 1
            end = firsts[i] + int(chunks[i].sizes[0]) if i >= 0 else at
            if end <= at:
                raise ValueError(f"{name!r}: no saved chunk holds row {at}")
            yield i, at, min(end, stop)
            at = min(end, stop)

    def _layout(self, name: str, i: int) -> RecordLayout | None:
        """Where chunk ``i`` of ``name`` keeps its rows; ``None`` (reason logged once): through DCP."""
        first = self._chunk_list(name)[0][i]
        if (name, first) not in self._layouts:
            chunk = self._chunk_list(name)[1][i]
            entry = self.metadata.state_dict_metadata[name]
            try:
                if any(int(o) for o in chunk.offsets[1:]) or tuple(chunk.sizes[1:]) != tuple(entry.size[1:]):
                    raise NotPlainRecord(f"chunk {tuple(chunk.offsets)} +{tuple(chunk.sizes)} is not whole rows")
                info = self.metadata.storage_data[MetadataIndex(name, chunk.offsets)]
                path = os.path.join(self.checkpoint_id, info.relative_path)
                layout = locate(path, self._fd(path), info, entry.properties.dtype, chunk.sizes, first)
            except (NotPlainRecord, OSError, KeyError, AttributeError) as exc:
                reason = str(exc) if isinstance(exc, NotPlainRecord) else f"{type(exc).__name__}: {exc}"
                logger.warning("%s: saved rows [%d, %d) are read through DCP (the whole chunk): %s",
                               name, first, first + int(chunk.sizes[0]), reason)
                self.fallbacks[(name, first)] = reason
                layout = None
            self._layouts[(name, first)] = layout
        return self._layouts[(name, first)]

    def _fd(self, path: str) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def _landing(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Where saved bytes of ``name`` land for ``out``: ``out`` itself when they fit as they
        are, else a contiguous tensor of the saved dtype, copied into ``out`` after (a cast,
        as DCP's load casts)."""
        dtype, shape = self.row_format(name)
        if tuple(out.shape[1:]) != shape:
            raise ValueError(f"{name!r}: the saved rows are {shape}, asked for {tuple(out.shape[1:])}")
        return out if out.dtype == dtype and out.is_contiguous() else torch.empty(out.shape, dtype=dtype)

    def read(self, name: str, start: int, out: torch.Tensor) -> None:
        """Saved rows ``[start, start + len(out))`` of ``name`` into ``out``: a positioned read
        of exactly their bytes per chunk (DCP for a chunk that is not a plain record)."""
        into = self._landing(name, out)
        for i, lo, hi in self._spans(name, start, start + out.shape[0]):
            part = into[lo - start:hi - start]
            layout = self._layout(name, i)
            if layout is None:
                read_rows(self.checkpoint_id, {name: (lo, part)})
            else:
                self._pread(layout, lo, _as_row_bytes(part).reshape(-1))
        if into is not out:
            out.copy_(into)

    def _pread(self, layout: RecordLayout, lo: int, into: torch.Tensor) -> None:
        view, offset = memoryview(into.numpy()), layout.data_offset + (lo - layout.first) * layout.row_bytes
        fd = self._fd(layout.path)
        while len(view):
            got = os.preadv(fd, [view], offset)
            if got <= 0:
                raise OSError(f"{layout.path}: {len(view)} bytes missing at offset {offset} (file cut short?)")
            view, offset = view[got:], offset + got

    def gather(self, name: str, start: int, index: torch.Tensor, out: torch.Tensor) -> None:
        """``out[j]`` = saved row ``start + index[j]`` of ``name``, for ``index`` increasing.
        Through a memory map of each plain chunk, piece by piece; a chunk read through DCP is
        loaded whole once and gathered from."""
        into = self._landing(name, out)
        if index.numel() == 0:
            return
        for i, lo, hi in self._spans(name, start + int(index[0]), start + int(index[-1]) + 1):
            a, b = (int(p) for p in torch.searchsorted(index, torch.tensor([lo - start, hi - start])))
            if a == b:
                continue
            layout = self._layout(name, i)
            first = int(self._chunk_list(name)[1][i].offsets[0])
            if layout is None:
                whole = torch.empty(tuple(self._chunk_list(name)[1][i].sizes), dtype=into.dtype)
                read_rows(self.checkpoint_id, {name: (first, whole)})
                torch.index_select(whole, 0, index[a:b] + (start - first), out=into.detach()[a:b])
            else:
                self._gather_mapped(layout, index[a:b], start - first, _as_row_bytes(into[a:b]))
        if into is not out:
            out.copy_(into)

    def _gather_mapped(self, layout: RecordLayout, index: torch.Tensor, shift: int, out: torch.Tensor) -> None:
        """``out[j]`` = row ``index[j] + shift`` of the record (increasing), as bytes, mapping
        at most ``piece_bytes`` of the file at a time (over the rows each piece serves only)."""
        per_piece = max(1, self.piece_bytes // layout.row_bytes)
        bounds = torch.searchsorted(index, torch.arange(-shift, layout.rows - shift + per_piece, per_piece)).tolist()
        fd = self._fd(layout.path)
        for a, b in zip(bounds, bounds[1:]):
            if a == b:
                continue
            first, last = int(index[a]) + shift, int(index[b - 1]) + shift
            begin = layout.data_offset + first * layout.row_bytes
            aligned = begin - begin % mmap.ALLOCATIONGRANULARITY
            nbytes = (last + 1 - first) * layout.row_bytes
            # Copy-on-write: a stray write could never reach the file. The tensor keeps the
            # map alive; the map is unmapped when the tensor is dropped at the end of the piece.
            mapped = torch.frombuffer(mmap.mmap(fd, begin - aligned + nbytes, offset=aligned, access=mmap.ACCESS_COPY),
                                      dtype=torch.uint8)
            piece = mapped[begin - aligned:].view(-1, layout.row_bytes)
            torch.index_select(piece, 0, index[a:b] - (first - shift), out=out[a:b])
            del piece, mapped
