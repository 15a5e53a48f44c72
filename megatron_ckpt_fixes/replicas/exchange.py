"""The collective replica check: two small gathers of chunk names and digests, never values.

1. Every rank announces the chunks it declares as a non-main replica (a chunk that more than
   one rank declares has such a claim on every rank but at most one) and its structure
   signature. The union is the set of shared chunks; the common state is always shared.
2. Every rank digests the shared chunks it holds (main or not) and the digests are gathered;
   every rank then computes the same verdict (:mod:`.verdict`) and raises the same error.

Tensors are digested when a save plan is made: on every save, except where every rank's
strategy reuses a cached plan (``--ckpt-assume-constant-structure``: the caller promises that
the structure stays) and every rank's structure signature is the one of the last save whose
tensors were checked. A plan reused on a changed structure is replanned by the ``structure``
feature, and checked here again. ShardedObjects and the common state are small and digested on
every save. A rank that fails to describe or digest its claims makes every rank raise the same
error: both steps are gathers that every rank enters, whatever happened before.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..agreement import describe_failures, gather, rank_and_size
from ..structure.signature import compute_signature
from .claims import COMMON_CHUNK, TENSOR, ChunkId, local_claims
from .digest import value_digest
from .verdict import ReplicaMismatchError, differing, mismatch_error

logger = logging.getLogger(__name__)


@dataclass
class CheckedLayout:
    """The structure signatures (one per rank) of the last save whose tensors were checked."""

    signatures: tuple[bytes, ...] | None = None


_checked = CheckedLayout()


def _failed(what: str, reports: list[tuple[str | None, Any]]) -> None:
    errors = {rank: error for rank, (error, _) in enumerate(reports) if error is not None}
    if errors:
        raise ReplicaMismatchError(describe_failures(what, errors))


def check_replicas(sharded_part: Any, common_state: Callable[[], Any], checkpoint_dir: Any,
                   plan_cached: bool, group: Any = None) -> None:
    """Collective: raise :class:`~.verdict.ReplicaMismatchError` on every rank unless every
    chunk that several ranks declare holds equal values on all of them (see the module
    docstring for what is digested when). ``common_state`` computes the common state to
    compare (the caller's preprocessing may fail, which then fails the save on every rank)."""
    rank, world = rank_and_size(group)
    if world == 1:
        return
    started = time.perf_counter()
    announcement: tuple[list[ChunkId], bytes, bool] | None = None
    error: str | None = None
    try:
        claims = local_claims(sharded_part, common_state(), rank)
        announcement = ([chunk for chunk, claim in claims.items() if not claim.main],
                        compute_signature(sharded_part).digest, plan_cached)
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = f"cannot describe the chunks to save: {type(exc).__name__}: {exc}"
    announced = gather((error, announcement), group)
    _failed(f"announcing the replicas of the save to {checkpoint_dir}", announced)
    signatures = tuple(a[1] for _, a in announced)
    tensors_due = not all(a[2] for _, a in announced) or signatures != _checked.signatures
    shared = {COMMON_CHUNK} | {chunk for _, a in announced for chunk in a[0]
                               if tensors_due or chunk[0] != TENSOR}
    digests: dict[ChunkId, tuple[Any, int]] = {}
    try:
        digests = {chunk: (claims[chunk].replica_id, value_digest(claims[chunk].value))
                   for chunk in sorted(shared & claims.keys(), key=repr)}
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        error = f"cannot digest the chunks it shares: {type(exc).__name__}: {exc}"
    reports = gather((error, digests), group)
    _failed(f"digesting the replicas of the save to {checkpoint_dir}", reports)
    lines = differing([d for _, d in reports])
    if lines:
        raise mismatch_error(checkpoint_dir, lines)
    if tensors_due:
        _checked.signatures = signatures
    logger.debug("replicas of %d shared chunk(s) agree (tensors %s) in %.3f s", len(shared),
                 "checked" if tensors_due else "unchanged since checked",
                 time.perf_counter() - started)
