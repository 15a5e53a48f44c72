"""Small collectives that turn rank-local facts into decisions every rank shares.

Any choice that sends some ranks into a collective (replan, redistribute, raise) must be
made from the same information on every rank, or the ranks that chose differently hang.
These helpers are the one place that agreement happens: a single tiny all_reduce in the
common case, plus an object gather only when some rank reported an error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .compat.device import collective_device


class CollectiveError(RuntimeError):
    """Raised identically on every rank when at least one rank reported an error."""

    def __init__(self, what: str, errors: dict[int, Any]) -> None:
        self.what = what
        self.errors = errors
        detail = "\n".join(f"  rank {rank}: {msg}" for rank, msg in sorted(errors.items()))
        super().__init__(f"{what} failed on {len(errors)} rank(s):\n{detail}")


def _world(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def agree(flag: bool, error: Any | None, what: str, group: Any = None) -> bool:
    """Return whether ``flag`` is set on any rank; raise the same error everywhere on failure.

    One all_reduce(MAX) of ``[flag, failed]``; only if some rank failed, one
    ``all_gather_object`` of the errors (a text, or any picklable report) so every rank
    raises the same :class:`CollectiveError` naming each failing rank and its cause.
    """
    rank, world = _world(group)
    if world == 1:
        if error is not None:
            raise CollectiveError(what, {rank: error})
        return flag
    votes = torch.tensor([int(flag), int(error is not None)], dtype=torch.int32,
                         device=collective_device(group))
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
    if votes[1].item():
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, error, group=group)
        raise CollectiveError(what, {r: e for r, e in enumerate(gathered) if e is not None})
    return bool(votes[0].item())
