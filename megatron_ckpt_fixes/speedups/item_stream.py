"""Speed-up, opt-in: torch DCP's stream wrapper of a saved item, one class for every item.

Every item megatron-core's torch_dist writer saves goes through torch's ``_write_item``, which
asks ``_StorageWriterTransforms.transform_save_stream`` for the stream to serialize into.
That method defines its wrapper class (``NoCloseWriter``: ``close`` flushes instead of
closing the file) inside its body, so every item of every save builds a new class, with
``io.IOBase``'s ABC bookkeeping, before ``torch.save`` even starts.

Where two calls of the method build classes that behave alike (the same bases and
attributes, no method closing over the call, and instances that write, flush and "close"
alike: detected from what two calls return) and the save uses no stream extension, the
patched method wraps the stream in the class of its first call; with an extension
(compression, ...) it is upstream's every time. It patches a class torch calls experimental,
so it is applied only when named (``install([..., "item_stream"])``); docs/benchmarks.md
has what it saves.
"""

from __future__ import annotations

import functools
import inspect
import io
import logging
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Patch

logger = logging.getLogger(__name__)

_TRANSFORMS = "torch.distributed.checkpoint.filesystem:_StorageWriterTransforms"


def _shape(cls: type) -> tuple:
    """What can be seen of a class built by the method: its name, bases and attribute names,
    and whether any of its functions closes over the call that built it."""
    closes = any(getattr(value, "__closure__", None) for value in vars(cls).values())
    return cls.__qualname__, cls.__bases__, sorted(vars(cls)), closes


def _behaviour(cls: type) -> tuple:
    """What an instance on a fresh stream does: its state, what it wrote, and whether closing
    it closed the stream."""
    raw = io.BytesIO()
    stream = cls(raw)
    state = sorted(vars(stream))
    stream.write(b"item")
    stream.flush()
    stream.close()
    return state, raw.closed, raw.getvalue() if not raw.closed else None


def _two_calls() -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """What torch's own ``transform_save_stream`` (unpatched) returns for two items of a save
    without stream extensions."""
    from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

    method = inspect.unwrap(_StorageWriterTransforms.transform_save_stream)
    transforms = _StorageWriterTransforms([])
    return method(transforms, None, io.BytesIO()), method(transforms, None, io.BytesIO())


def _one_class_per_call() -> str | None:
    """Not needed where torch already hands out one class (detected from two calls)."""
    (first, _), (second, _) = _two_calls()
    return "torch builds its item stream wrapper once" if type(first) is type(second) else None


def _equal_classes_problems() -> list[str]:
    (wrapper, descriptors), (other, _) = _two_calls()
    first, second = type(wrapper), type(other)
    raw = io.BytesIO()
    again = first(raw)
    if descriptors != [] or vars(again) != {**vars(wrapper), "raw": raw}:
        return ["torch's item stream without extensions is not its wrapper class called on "
                "the raw stream alone"]
    if _shape(first)[3]:
        return ["torch's item stream wrapper closes over the call that builds it: one class "
                "cannot serve every item"]
    if _shape(first) != _shape(second) or _behaviour(first) != _behaviour(second):
        return ["torch's item stream wrapper differs between two calls"]
    return []


def one_wrapper_class(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replace ``_StorageWriterTransforms.transform_save_stream`` (see the module)."""
    built: list[type] = []

    @functools.wraps(original)
    def transform_save_stream(self: Any, write_item: Any, raw_stream: Any) -> Any:
        if self.extensions or not built:
            transformed = original(self, write_item, raw_stream)
            if not self.extensions:
                built.append(type(transformed[0]))
            return transformed
        return built[0](raw_stream), []

    return transform_save_stream


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="item_stream.one_class",
        target=_TRANSFORMS,
        attr="transform_save_stream",
        build=one_wrapper_class,
        not_needed=_one_class_per_call,
        probes=(_equal_classes_problems,),
        optional=True,  # a speed-up: where it cannot be applied, the writer is upstream's
        why="each saved item's stream wrapper is an instance of one class, not a class "
            "built per item",
    ),
)
