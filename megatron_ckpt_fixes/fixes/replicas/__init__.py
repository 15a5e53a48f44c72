"""Replicas checked before anything is written: a replica is a claim, not a fact.

megatron-core writes one replica of each chunk (the main one) and gives it to every rank that
declares the chunk at load; nothing checks that the ranks declaring a chunk hold its values.
Ranks that hold different values under one chunk (a per-rank RNG state under one key, tensor
halves declared as one chunk with the TP rank folded into the replica id, a common state that
differs) save "successfully" and load another rank's values. With this feature every rank
compares digests of the chunks it shares before the save writes anything, and a difference
fails the save on every rank, one line per chunk naming the ranks that differ.

Reading order: :mod:`.claims` (what a rank declares) -> :mod:`.digest` (equal digests iff
equal values) -> :mod:`.verdict` (which ranks differ; the error) -> :mod:`.exchange` (the
collective check, and when tensors are digested) -> :mod:`.save` (where it enters
megatron-core).
"""

from megatron_ckpt_fixes.fixes.replicas.save import PATCHES
from megatron_ckpt_fixes.fixes.replicas.verdict import ReplicaMismatchError

__all__ = ["PATCHES", "ReplicaMismatchError"]
