"""What a sharded state dict's structure is: everything that determines a save plan.

A DCP save plan (and megatron-core's cached global metadata) is a function of, per rank:
for every ShardedTensor its key, dtype, local and global shape, global offset, axis
fragmentation, flattened range and replica id; for every ShardedObject its unique key and
replica id. Values do not matter. :func:`compute_signature` reduces those to a digest that is
cheap to compare, and keeps one text per key so a change can be reported by key. The kept
entries are a dict of strings on purpose: it holds no container objects, so the garbage
collector does not track it, and a signature of 50,000 keys kept between saves adds nothing
to the collections that run during the next save.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

Entry = tuple[Any, ...]


def _range(flattened_range: slice | None) -> tuple[int, int] | None:
    return None if flattened_range is None else (flattened_range.start, flattened_range.stop)


def describe(item: Any) -> tuple[str, Entry]:
    """The plan-relevant description of one sharded item, as (key, entry)."""
    if isinstance(item, ShardedTensor):
        return item.key, (
            "tensor",
            str(item.dtype),
            tuple(item.local_shape),
            tuple(item.global_shape),
            tuple(item.global_offset),
            None if item.axis_fragmentations is None else tuple(item.axis_fragmentations),
            _range(item.flattened_range),
            item.replica_id,
            item.prepend_axis_num,
        )
    if isinstance(item, ShardedObject):
        return item.unique_key, ("object", item.replica_id)
    # Anything else the strategy would see (factories are applied before it) is described
    # by type and key, so a new kind of item still counts as a change.
    return str(getattr(item, "key", type(item).__name__)), (type(item).__qualname__,)


@dataclass(frozen=True)
class StructureDiff:
    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def summary(self, limit: int = 10) -> str:
        parts = []
        for name, keys in (("added", self.added), ("removed", self.removed),
                           ("changed", self.changed)):
            if keys:
                shown = ", ".join(keys[:limit]) + (f", ... (+{len(keys) - limit})"
                                                   if len(keys) > limit else "")
                parts.append(f"{name} {len(keys)}: [{shown}]")
        return "; ".join(parts) or "no change"


@dataclass(frozen=True)
class StructureSignature:
    """Per-rank structure: a digest plus, per key, the text of its entries."""

    digest: bytes
    entries: dict[str, str] = field(compare=False, repr=False)

    def diff(self, newer: "StructureSignature") -> StructureDiff:
        """Keys added, removed or changed from ``self`` to ``newer``."""
        old, new = self.entries, newer.entries
        return StructureDiff(
            added=tuple(sorted(k for k in new if k not in old)),
            removed=tuple(sorted(k for k in old if k not in new)),
            changed=tuple(sorted(k for k in new if k in old and new[k] != old[k])),
        )


def compute_signature(sharded_state_dict: Any) -> StructureSignature:
    """Signature of a (nested) megatron-core sharded state dict.

    The digest ignores dict order (a reordered dict yields the same plan) but not the
    multiplicity of shards of one key on a rank.
    """
    entries: dict[str, str] = {}
    repeated: set[str] = set()
    for item in nested_values(sharded_state_dict):
        key, entry = describe(item)
        text = repr(entry)
        if key in entries:
            entries[key] += "\n" + text
            repeated.add(key)
        else:
            entries[key] = text
    for key in repeated:  # several shards of one key on this rank: order-independent
        entries[key] = "\n".join(sorted(entries[key].split("\n")))
    hasher = hashlib.blake2b(digest_size=16)
    for key in sorted(entries):
        hasher.update(f"{key}\0{entries[key]}\0".encode())
    return StructureSignature(hasher.digest(), entries)
