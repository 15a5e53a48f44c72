"""What one rank asks of a checkpoint, compared with what its ``.metadata`` says was saved.

Pure logic over plain data (no process group, no megatron-core, no file I/O), so each rule is
a unit test: a :class:`Request` is one entry of a load template as megatron-core's load would
look it up (a ``ShardedTensor`` by key, a ``ShardedObject`` by its unique key), and
:func:`findings` says, per request, why the load would fail: the key is not in the checkpoint,
it was saved as the other kind, with another global shape, or the requested chunk does not
lie inside what was saved. The dtype rule is :mod:`megatron_ckpt_fixes.fixes.load_casts`'s (the same
rules the load itself enforces), and the checksum record's rules are :mod:`.records`'.

A load with megatron-core 0.16 and 0.19 reports each of these failures itself, but late: after
the common state is read, and, under ``--ckpt-verify-checksums``, after every byte of the
checkpoint was read and hashed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, TensorStorageMetadata

from megatron_ckpt_fixes.fixes import load_casts

#: What a finding is about, which decides the error class every rank raises (:mod:`.check`).
LOAD, CAST, RECORD = "load", "cast", "record"


@dataclass(frozen=True)
class Request:
    """One entry a load template asks for. ``shape`` is None for an object; for a tensor,
    ``offset``/``size`` bound the chunk this rank reads (global coordinates)."""

    key: str
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    offset: tuple[int, ...] = ()
    size: tuple[int, ...] = ()
    flexible_shape: bool = False  # ShardedTensor.allow_shape_mismatch: any saved shape loads

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None


@dataclass(frozen=True)
class Finding:
    """Why one requested key would not load as asked."""

    key: str
    cause: str
    kind: str = LOAD

    def __str__(self) -> str:
        """A key's finding names the key; a lossy cast and a record's finding name what they
        are about themselves."""
        return f"{self.key!r}: {self.cause}" if self.kind == LOAD else self.cause


def _covered(offset: Sequence[int], size: Sequence[int], saved: TensorStorageMetadata) -> int:
    """How many elements of the requested chunk the saved chunks hold (they do not overlap:
    ``verify`` checks that)."""
    total = 0
    for chunk in saved.chunks:
        sides = [min(o + s, co + cs) - max(o, co)
                 for o, s, co, cs in zip(offset, size, chunk.offsets, chunk.sizes)]
        total += math.prod(max(side, 0) for side in sides)
    return total


def _tensor_finding(request: Request, saved: TensorStorageMetadata) -> Finding | None:
    shape = tuple(saved.size)
    assert request.shape is not None
    if len(shape) != len(request.shape):
        return Finding(request.key, f"saved with {len(shape)} dimension(s) {shape}, the "
                                    f"template has {len(request.shape)} {request.shape}")
    if request.flexible_shape:
        return None  # upstream's contract: allow_shape_mismatch loads any saved shape
    if shape != request.shape:
        return Finding(request.key, f"saved with global shape {shape}, the template has "
                                    f"{request.shape}")
    end = tuple(o + s for o, s in zip(request.offset, request.size))
    if any(o < 0 or e > g for o, e, g in zip(request.offset, end, shape)):
        return Finding(request.key, f"the requested chunk {request.offset}..{end} lies outside "
                                    f"the saved shape {shape}")
    wanted = math.prod(request.size)
    held = _covered(request.offset, request.size, saved)
    if held != wanted:
        return Finding(request.key, f"the saved chunks hold {held} of the {wanted} element(s) "
                                    f"of the requested chunk {request.offset}..{end}")
    return None


def findings(requests: Iterable[Request],
             saved: dict[str, STORAGE_TYPES]) -> list[Finding]:
    """Every reason this rank's ``requests`` would not load from a checkpoint whose
    ``.metadata`` holds ``saved`` (its ``state_dict_metadata``), in request order, one per
    key; a lossy cast last, as one finding in the load's own words (:mod:`.load_casts`)."""
    found: list[Finding] = []
    seen: set[str] = set()
    tensors = []
    for request in requests:
        if request.key in seen:
            continue
        seen.add(request.key)
        entry = saved.get(request.key)
        if entry is None:
            found.append(Finding(request.key, "not in the checkpoint (it was saved without "
                                              "this key)"))
        elif isinstance(entry, TensorStorageMetadata) != request.is_tensor:
            saved_as, asked = ("an object", "a tensor") if request.is_tensor else \
                ("a tensor", "an object")
            found.append(Finding(request.key, f"saved as {saved_as}, the template asks for "
                                              f"{asked}"))
        elif request.is_tensor:
            finding = _tensor_finding(request, entry)
            if finding is not None:
                found.append(finding)
            else:
                tensors.append(request)
    casts = load_casts.casts(tensors, load_casts.dtypes_of(saved))
    lossy = load_casts.lossy_cast_error(casts)
    if lossy is not None:
        first = next(c for c in casts if c.lossy)
        found.append(Finding(first.key, lossy, CAST))
    return found


def summary(found: Sequence[Finding], shown: int = 3) -> str:
    """One line for a rank's findings: the first ``shown``, and how many more."""
    text = "; ".join(str(f) for f in found[:shown])
    more = len(found) - shown
    return text + (f" (and {more} more key(s))" if more > 0 else "")
