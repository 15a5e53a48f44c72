"""No silent lossy cast at load: a saved tensor goes only into a template that holds it exactly.

megatron-core (and torch DCP under it) copies each saved tensor into the template's tensor,
casting to the template's dtype without a word: an fp32 checkpoint loaded into a bf16 model
resumes with every value rounded (max error 3.5e-3 on a small model), where a shape mismatch
would have raised. The load (:mod:`.load_errors`, which agrees on every failure) checks, before
any tensor data is read, each ``ShardedTensor`` of the template against the dtype its key was
saved with (the checkpoint's ``.metadata``):

- a cast that loses nothing (bf16 into fp32, int32 into int64) loads, with one INFO line;
- a cast that can change values (fp32 into bf16 or fp16, fp64 into fp32, int64 into int32,
  floats into integers) fails on every rank, one line per rank naming the first key, both
  dtypes and how many keys; :data:`ALLOW_ENV` ``=1`` allows it on purpose, and the load then
  logs one WARNING line saying what it rounded.

Only the template's own ``ShardedTensor`` entries are checked (not the tensors a
``ShardedTensorFactory`` builds during the load), and only for checkpoints with a torch DCP
``.metadata`` (megatron-core's ``torch_dist`` format).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: ``1`` allows a lossy cast at load (an intended change of precision).
ALLOW_ENV = "MEGATRON_CKPT_FIXES_ALLOW_LOSSY_CAST"


def _range(dtype: torch.dtype) -> tuple[float, float, float]:
    """(lowest, highest, step at 1) of the values a dtype holds exactly."""
    if dtype == torch.bool:
        return 0.0, 1.0, 1.0
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        return float(info.min), float(info.max), float(info.eps)
    info = torch.iinfo(dtype)
    return float(info.min), float(info.max), 1.0


def lossless(saved: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of ``saved`` is a value of ``target`` (complex: only itself)."""
    if saved == target:
        return True
    if saved.is_complex or target.is_complex:
        return False
    if saved.is_floating_point and not target.is_floating_point:
        return False
    low, high, step = _range(saved)
    t_low, t_high, t_step = _range(target)
    if not saved.is_floating_point and target.is_floating_point:
        # an integer fits a float exactly while the float's step at the integer's largest
        # magnitude is still 1: 2 ** mantissa bits
        largest = max(abs(low), abs(high))
        return largest <= 2.0 / t_step and t_high >= high
    if saved.is_floating_point:
        return t_step <= step and t_high >= high and \
            torch.finfo(target).tiny <= torch.finfo(saved).tiny
    return t_low <= low and t_high >= high


@dataclass(frozen=True)
class Cast:
    key: str
    saved: torch.dtype
    target: torch.dtype

    @property
    def lossy(self) -> bool:
        return not lossless(self.saved, self.target)

    def __str__(self) -> str:
        return f"{self.key!r} saved as {self.saved}, the template is {self.target}"


def saved_dtypes(checkpoint_dir: Any) -> dict[str, torch.dtype]:
    """Each tensor key's dtype from the checkpoint's torch DCP ``.metadata`` (empty when the
    checkpoint has none)."""
    if not (Path(checkpoint_dir) / ".metadata").exists():
        return {}
    from torch.distributed.checkpoint import FileSystemReader

    return dtypes_of(FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata)


def dtypes_of(saved: dict[str, Any]) -> dict[str, torch.dtype]:
    """Each tensor key's dtype from a ``.metadata``'s ``state_dict_metadata``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {key: entry.properties.dtype for key, entry in saved.items()
            if isinstance(entry, TensorStorageMetadata)}


def casts(tensors: list[Any], saved: dict[str, torch.dtype]) -> list[Cast]:
    """The casts loading ``tensors`` (``ShardedTensor``s) would make, one per key."""
    found: dict[str, Cast] = {}
    for tensor in tensors:
        dtype = saved.get(tensor.key)
        if dtype is not None and dtype != tensor.dtype and tensor.key not in found:
            found[tensor.key] = Cast(tensor.key, dtype, tensor.dtype)
    return list(found.values())


def allowed() -> bool:
    return os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _kinds(found: list[Cast]) -> str:
    kinds = Counter(f"{c.saved} -> {c.target}" for c in found)
    return ", ".join(f"{kind}: {n} key(s)" for kind, n in sorted(kinds.items()))


def lossy_cast_error(found: list[Cast]) -> str | None:
    """This rank's cause for refusing the load, or None (logging what it lets through)."""
    lossy = [c for c in found if c.lossy]
    widened = [c for c in found if not c.lossy]
    if widened:
        logger.info("loading %d tensor(s) into a wider dtype, exactly (%s)", len(widened),
                    _kinds(widened))
    if not lossy:
        return None
    if allowed():
        logger.warning("%s=1: loading %d tensor(s) into a dtype that rounds them (%s; e.g. "
                       "%s)", ALLOW_ENV, len(lossy), _kinds(lossy), lossy[0])
        return None
    more = f" (and {len(lossy) - 1} more key(s): {_kinds(lossy)})" if len(lossy) > 1 else ""
    return (f"LossyCastError: {lossy[0]}: loading would round its values{more}; load into a "
            f"template of the saved dtype, or set {ALLOW_ENV}=1 to cast on purpose")
