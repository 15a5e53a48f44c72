"""Errors of the DTensor checkpoint helpers.

Every error names the state-dict key, the rank that found it and the mismatch, because a
layout error seen as "size mismatch" deep inside DCP planning (or, worse, not seen at all)
is what users got upstream.
"""

from __future__ import annotations

from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError


class PlacementError(MegatronCkptFixesError, ValueError):
    """A local shard, its placements, its mesh and its global shape do not fit together."""

    def __init__(self, key: str, rank: int | None, problem: str) -> None:
        self.key = key
        self.rank = rank
        self.problem = problem
        where = "" if rank is None else f" on rank {rank}"
        super().__init__(f"{key!r}{where}: {problem}")


class LayoutAgreementError(PlacementError):
    """Layout validation failed on at least one rank; every rank raises this same error.

    It is raised before any DCP collective, so a bad layout on one rank never leaves the
    other ranks waiting in a collective. ``errors`` lists every (key, rank, problem) found.
    """

    def __init__(self, errors: list[tuple[str, int | None, str]]) -> None:
        self.errors = tuple(errors)
        self.key, self.rank, self.problem = errors[0]
        details = "; ".join(str(PlacementError(k, r, p)) for k, r, p in errors)
        ValueError.__init__(self, f"checkpoint layout rejected on every rank: {details}")
