"""The verdict on the gathered digests: which chunks' replicas differ, and from which rank.

Pure: every rank computes it from the same gathered digests, so every rank reaches the same
verdict and raises the same error without another collective. Each chunk is compared with
its main replica (the one megatron-core writes and hands to every rank at load); a chunk
that no rank declares as main (nothing of it is written, which the sharding validation
reports) is compared with its lowest rank's.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import is_main_replica

from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError
from megatron_ckpt_fixes.fixes.replicas.claims import ChunkId, describe_chunk

#: What one rank reports for the chunks it shares: ``chunk -> (replica_id, digest)``.
Digests = dict[ChunkId, tuple[Any, int]]


class ReplicaMismatchError(MegatronCkptFixesError, CheckpointingException):
    """Ranks that declare one chunk (its replicas) hold different values, or could not tell;
    raised on every rank before the save writes anything."""


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def differing(gathered: list[Digests]) -> list[str]:
    """One line per chunk whose replicas differ, naming the ranks that differ from the
    reference rank; sorted by chunk, so every rank writes the same lines."""
    holders: dict[ChunkId, dict[int, tuple[Any, int]]] = defaultdict(dict)
    for rank, digests in enumerate(gathered):
        for chunk, declared in digests.items():
            holders[chunk][rank] = declared
    lines = []
    for chunk in sorted(holders, key=repr):
        held = holders[chunk]
        mains = [r for r, (replica_id, _) in sorted(held.items()) if is_main_replica(replica_id)]
        reference = mains[0] if mains else min(held)
        expected = held[reference][1]
        odd = [r for r, (_, digest) in sorted(held.items()) if digest != expected]
        if odd:
            role = "the main replica, the one written" if mains else "no rank holds the main one"
            verb = "holds" if len(odd) == 1 else "hold"
            lines.append(f"{describe_chunk(chunk)}: {_ranks(odd)} {verb} values other than "
                         f"rank {reference}'s ({role}; declared by {_ranks(sorted(held))})")
    return lines


def mismatch_error(checkpoint_dir: Any, lines: list[str]) -> ReplicaMismatchError:
    """The error every rank raises for the lines of :func:`differing`."""
    detail = "\n".join(f"  {line}" for line in lines)
    return ReplicaMismatchError(
        f"save to {checkpoint_dir} refused before anything was written: {len(lines)} "
        f"chunk(s) declared by several ranks as replicas hold different values (only one "
        f"replica is written and every rank would load it):\n{detail}")
