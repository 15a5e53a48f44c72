"""Detect, without a process group, whether an upstream helper already builds DTensors right.

Whether a system already has a fix is decided from its behaviour (never its version), at
``install()`` time: often at its first import, before any process group exists. The helpers
in question end in ``DTensor.from_local``, which needs a device mesh and so a process group.
A probe therefore calls the upstream helper on stand-in objects with the names the helper
looks up in its module (``DTensor``, ``is_dtensor``, ...) replaced for the duration of the
call by stand-ins that record what upstream asked for, then compares that with what the
package's core would build. The replacement is undone before the probe returns, and the
probe runs under ``install()``'s lock, once per process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class Stub:
    """A stand-in for a mesh, a parameter or a DTensor: the attributes it is given."""

    attrs: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.attrs[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key: Any) -> Any:
        return self.attrs["__getitem__"](key)


@dataclass(frozen=True)
class FromLocal:
    """One ``DTensor.from_local`` call as upstream made it."""

    local: Any
    mesh: Any
    placements: tuple
    shape: Any
    stride: Any


class Recorder:
    """Stands in for the ``DTensor`` class: ``from_local`` records the call and returns a
    stub that answers ``to_local``, ``device_mesh``, ``placements``, ``shape`` and
    ``stride()`` like the DTensor upstream asked for: the shape it passed, or without one its
    local shape (never the global shape of the probes' uneven shards, as torch's own
    inference from the local shape would not be either)."""

    def __init__(self) -> None:
        self.calls: list[FromLocal] = []

    def from_local(self, local: Any, device_mesh: Any = None, placements: Any = None, *,
                   shape: Any = None, stride: Any = None, **_: Any) -> Stub:
        call = FromLocal(local, device_mesh, tuple(placements or ()),
                         None if shape is None else tuple(shape),
                         None if stride is None else tuple(stride))
        self.calls.append(call)
        return Stub({"to_local": lambda: local, "device_mesh": device_mesh,
                     "placements": call.placements, "stride": lambda: call.stride,
                     "shape": call.shape if call.shape is not None else tuple(local.shape)})


@contextlib.contextmanager
def standing_in(module: Any, **names: Any) -> Iterator[None]:
    """Replace module-level ``names`` of ``module`` for the duration of the block."""
    originals = {name: getattr(module, name) for name in names}
    try:
        for name, value in names.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in originals.items():
            setattr(module, name, value)
