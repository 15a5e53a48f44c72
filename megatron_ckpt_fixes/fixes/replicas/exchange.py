"""The collective replica check: chunk names and digests cross the ranks, never values.

1. Every rank announces the chunks it declares as a non-main replica (a chunk that more than
   one rank declares has such a claim on every rank but at most one), its structure
   signature and whether its strategy reuses a cached plan. The union of the claims is the
   set of shared chunks; the common state is always shared. A rank whose announcement is the
   one of the last save whose replicas agreed says only that (one agreed flag): when no rank
   changed, every rank reuses that save's shared set, so the steady state gathers nothing.
2. Every rank digests the shared chunks it holds, main or not, and one all_reduce gives each
   chunk's least and greatest digest over the ranks holding it, and whether any rank failed
   to digest. Only where they differ are the digests of those chunks gathered, so that every
   rank names the same ranks in the same error (:mod:`.verdict`).

Tensors are digested when a save plan is made: on every save, except where every rank's
strategy reuses a cached plan (``--ckpt-assume-constant-structure``: the caller promises that
the structure stays) and every rank's structure signature is the one of a save whose tensors
agreed. A plan reused on a changed structure is replanned by the ``structure`` feature, and
checked here again. ShardedObjects and the common state are small and digested on every save.
A rank that fails to describe or digest its claims makes every rank raise the same error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from megatron_ckpt_fixes.core.agreement import (BOUND, agree, bounds, describe_failures, gather,
    rank_and_size)
from megatron_ckpt_fixes.fixes.structure.signature import compute_signature
from megatron_ckpt_fixes.fixes.replicas.claims import COMMON_CHUNK, TENSOR, ChunkId, local_claims
from megatron_ckpt_fixes.fixes.replicas.digest import value_digest
from megatron_ckpt_fixes.fixes.replicas.verdict import (ReplicaMismatchError, differing,
    mismatch_error)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Announcement:
    """What one rank tells the others before anything is digested."""

    claims: tuple[ChunkId, ...]  # the chunks it declares as a non-main replica
    signature: bytes
    plan_cached: bool


@dataclass(frozen=True)
class Layout:
    """The shared chunks of the last save whose replicas agreed (tensors included)."""

    announcement: int  # this rank's announcement's digest
    shared: tuple[ChunkId, ...]
    signatures: tuple[bytes, ...]
    all_cached: bool


@dataclass
class _Last:
    layout: Layout | None = None


_last = _Last()


def _raise_as(what: str, errors: dict[int, Any]) -> ReplicaMismatchError:
    return ReplicaMismatchError(describe_failures(what, errors))


def _gathered_layout(announced: list[Announcement], mine: int) -> tuple[Layout, bool]:
    """The layout every rank computes from the gathered announcements, and whether its
    tensors are due (see the module docstring)."""
    shared = {COMMON_CHUNK} | {chunk for a in announced for chunk in a.claims}
    layout = Layout(mine, tuple(sorted(shared, key=repr)), tuple(a.signature for a in announced),
                    all(a.plan_cached for a in announced))
    last = _last.layout
    checked_before = last is not None and last.signatures == layout.signatures
    return layout, not (layout.all_cached and checked_before)


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
    what = f"the replica check of the save to {checkpoint_dir}"
    error: str | None = None
    announcement, mine, claims = None, 0, {}
    try:
        claims = local_claims(sharded_part, common_state(), rank)
        announcement = Announcement(
            tuple(sorted((c for c, claim in claims.items() if not claim.main), key=repr)),
            compute_signature(sharded_part).digest, plan_cached)
        mine = value_digest(announcement)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree()
        error = f"cannot describe the chunks to save: {type(exc).__name__}: {exc}"
    last = _last.layout
    changed = last is None or mine != last.announcement
    if agree(changed, error, what, group, raise_as=_raise_as):
        layout, tensors_due = _gathered_layout(gather(announcement, group), mine)
    else:
        assert last is not None
        layout, tensors_due = last, not last.all_cached
    due = [chunk for chunk in layout.shared if tensors_due or chunk[0] != TENSOR]
    digests: dict[ChunkId, tuple[Any, int]] = {}
    try:
        digests = {chunk: (claims[chunk].replica_id, value_digest(claims[chunk].value) % BOUND)
                   for chunk in due if chunk in claims}
    except Exception as exc:  # noqa: BLE001 - raised on every rank by bounds()
        error = f"cannot digest the chunks it shares: {type(exc).__name__}: {exc}"
    spans = bounds([digests[c][1] if c in digests else None for c in due], group, error, what,
                   _raise_as)
    odd = [chunk for chunk, span in zip(due, spans) if span is not None and span[0] != span[1]]
    if odd:  # the same on every rank: gather the digests of those chunks to name the ranks
        held = gather({chunk: digests[chunk] for chunk in odd if chunk in digests}, group)
        raise mismatch_error(checkpoint_dir, differing(held))
    _last.layout = layout
    logger.debug("replicas of %d shared chunk(s) agree (tensors %s) in %.3f s", len(due),
                 "digested" if tensors_due else "agreed before, structure unchanged",
                 time.perf_counter() - started)
