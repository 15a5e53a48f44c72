"""The one error type of the resharder, and how ranks agree on it.

A failure that only one rank sees (a bad slot in its window, a duplicate id that landed on
it) must not leave the other ranks waiting in the next all_to_all. Every phase therefore
ends with :func:`agree`: one small ``all_gather_object`` of the local problems, after which
either every rank goes on or every rank raises the same :class:`ReshardError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist


class ReshardError(ValueError):
    """A table cannot be resharded as asked; the message names the table, the rank(s), the cause."""


def problem(key: str, rank: int, cause: str) -> str:
    """One problem line, in the form every error of this package uses."""
    return f"table {key!r}, rank {rank}: {cause}"


def agree(key: str, problems: Sequence[str], group: Any = None) -> None:
    """Raise the same :class:`ReshardError` on every rank if any rank reported a problem.

    Collective: every rank of ``group`` must call it at the same point, problems or not.
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(problems), group=group)
    merged = [line for lines in gathered for line in lines]
    if merged:
        shown = merged[:20] + ([f"... and {len(merged) - 20} more"] if len(merged) > 20 else [])
        raise ReshardError(f"cannot reshard table {key!r}:\n  " + "\n  ".join(shown))


def agree_equal(key: str, what: str, value: Any, group: Any = None) -> None:
    """Raise on every rank unless all ranks hold the same ``value`` (e.g. a plan)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    differing = [r for r, v in enumerate(gathered) if v != gathered[0]]
    if differing:
        raise ReshardError(
            f"cannot reshard table {key!r}: ranks {differing} disagree with rank 0 on {what}: "
            f"{gathered[differing[0]]!r} vs {gathered[0]!r}")
