"""Digests of the values ranks declare as replicas: equal digests iff equal bytes.

A replica is compared by digest so that no rank ever receives another rank's values: the
exchange is a few integers per shared chunk, whatever the size of the chunk. A tensor's digest
covers its dtype, shape and raw bytes (the bytes a save would write: -0.0 and 0.0 differ, as
do two NaN payloads), hashed with the checksum algorithm of the saved items
(:data:`~megatron_ckpt_fixes.fixes.checksums.algorithms.DEFAULT`, xxh3, which releases the GIL). A
tensor on an accelerator is copied to the host first.

Any other value (a ShardedObject's payload, the common state) is digested as its pickle, with
two changes that make equal values give equal bytes on every rank: each tensor inside is
replaced by its own digest (so its storage's pickle, which is not canonical, never counts),
and the pickler runs without its memo (``fast``), so two ranks whose equal values share
sub-objects differently (one list referenced twice, or two equal lists) still agree. A value
that refers to itself cannot be pickled without the memo and is then pickled with it.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from megatron_ckpt_fixes.fixes.checksums.algorithms import DEFAULT


def tensor_digest(tensor: torch.Tensor) -> int:
    """The digest of a tensor's dtype, shape and bytes (wherever it lives)."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    flat = data.contiguous().reshape(-1)
    hasher = DEFAULT.new()
    hasher.update(f"{flat.dtype}{tuple(tensor.shape)}".encode())
    if flat.numel():
        hasher.update(memoryview(flat.view(torch.uint8).numpy()))
    return hasher.value()


class _CanonicalPickler(pickle.Pickler):
    """Pickles tensors as their digests (by persistent id: nothing of the tensor is kept)."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return ("tensor", tensor_digest(obj))
        return None


def _pickled(value: Any, memo: bool) -> bytes:
    buffer = io.BytesIO()
    pickler = _CanonicalPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.fast = not memo
    pickler.dump(value)
    return buffer.getvalue()


def value_digest(value: Any) -> int:
    """The digest of any value a checkpoint holds (see the module docstring)."""
    if isinstance(value, torch.Tensor):
        return tensor_digest(value)
    try:
        data = _pickled(value, memo=False)
    except ValueError:  # "fast mode: can't pickle cyclic objects"
        data = _pickled(value, memo=True)
    hasher = DEFAULT.new()
    hasher.update(data)
    return hasher.value()
