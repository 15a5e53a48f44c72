"""The one error type of the resharder, and how ranks agree on it.

A failure that only one rank sees (a bad slot in its window, a duplicate id that landed on
it) must not leave the other ranks waiting in the next all_to_all. Every phase therefore
ends with :func:`check_problems` (through :mod:`megatron_ckpt_fixes.agreement`: one small
all_reduce, and a gather of the problems only when some rank found one), after which either
every rank goes on or every rank raises the same :class:`ReshardError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import agreement
from ..errors import MegatronCkptFixesError

_SHOWN = 20


class ReshardError(MegatronCkptFixesError, ValueError):
    """A table cannot be resharded as asked; the message names the table, the rank(s), the cause."""


def problem(key: str, rank: int, cause: str) -> str:
    """One problem line, in the form every error of this package uses."""
    return f"table {key!r}, rank {rank}: {cause}"


def _problems_error(key: str) -> agreement.RaiseAs:
    def raise_as(_what: str, reports: dict[int, list[str]]) -> ReshardError:
        merged = [line for _rank, lines in sorted(reports.items()) for line in lines]
        shown = merged[:_SHOWN] + ([f"... and {len(merged) - _SHOWN} more"]
                                   if len(merged) > _SHOWN else [])
        return ReshardError(f"cannot reshard table {key!r}:\n  " + "\n  ".join(shown))

    return raise_as


def check_problems(key: str, problems: Sequence[str], group: Any = None) -> None:
    """Raise the same :class:`ReshardError` on every rank if any rank reported a problem.

    Collective: every rank of ``group`` must call it at the same point, problems or not.
    """
    agreement.check(list(problems) or None, f"resharding table {key!r}", group,
                    raise_as=_problems_error(key))


def require_same(key: str, what: str, value: Any, group: Any = None) -> None:
    """Raise on every rank unless all ranks hold the same ``value`` (e.g. a plan)."""

    def raise_as(_what: str, differing: dict[int, str]) -> ReshardError:
        first = min(differing)
        return ReshardError(f"cannot reshard table {key!r}: ranks {sorted(differing)} disagree "
                            f"with rank 0 on {what}: rank {first} {differing[first]}")

    agreement.same(value, what, group, raise_as=raise_as)
