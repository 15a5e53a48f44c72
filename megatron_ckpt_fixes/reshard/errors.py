"""The one error type of the resharder, and how ranks agree on it.

A failure that only one rank sees (a bad slot in its window, a duplicate id that landed on
it) must not leave the other ranks waiting in the next all_to_all. Every phase therefore
ends with :func:`check_problems` or :func:`require_same` (through
:mod:`megatron_ckpt_fixes.core.agreement`: one small all_reduce, and a gather of the problems only
when some rank found one), after which either every rank goes on or every rank raises the
same :class:`ReshardError`. Each such point is a barrier, so a phase has one, not several.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from megatron_ckpt_fixes.core import agreement
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError

_SHOWN = 20
T = TypeVar("T")


class ReshardError(MegatronCkptFixesError, ValueError):
    """A table cannot be resharded as asked; the message names the table, the rank(s), the cause."""


def problem(key: str, rank: int, cause: str) -> str:
    """One problem line, in the form every error of this package uses."""
    return f"table {key!r}, rank {rank}: {cause}"


def problems_error(key: str, reports: Mapping[int, Sequence[str]]) -> ReshardError:
    """The error of problems reported by some ranks (``{rank: lines}``), in rank order."""
    merged = [line for _rank, lines in sorted(reports.items()) for line in lines]
    shown = merged[:_SHOWN] + ([f"... and {len(merged) - _SHOWN} more"] if len(merged) > _SHOWN else [])
    return ReshardError(f"cannot reshard table {key!r}:\n  " + "\n  ".join(shown))


def check_problems(key: str, problems: Sequence[str], group: Any = None) -> None:
    """Raise the same :class:`ReshardError` on every rank if any rank reported a problem.

    Collective: every rank of ``group`` must call it at the same point, problems or not.
    """
    agreement.check(list(problems) or None, f"resharding table {key!r}", group,
                    raise_as=lambda _what, reports: problems_error(key, reports))


def require_same(key: str, what: str, value: Any, group: Any = None, problems: Sequence[str] = ()) -> None:
    """Raise the same :class:`ReshardError` on every rank if any rank reported a problem, or
    unless all ranks hold the same ``value`` (e.g. a plan). One small all_reduce."""

    def raise_as(_what: str, reports: dict[int, Any]) -> ReshardError:
        if all(isinstance(lines, list) for lines in reports.values()):
            return problems_error(key, reports)
        first = min(reports)
        return ReshardError(f"cannot reshard table {key!r}: ranks {sorted(reports)} disagree "
                            f"with rank 0 on {what}: rank {first} {reports[first]}")

    agreement.same(value, what, group, raise_as=raise_as, error=list(problems) or None)


def run_agreed(what: str, compute: Callable[[], T], group: Any = None) -> T:
    """Run a rank-local step that may fail on some ranks only (a read, TorchRec's own code);
    if it failed anywhere, the same :class:`ReshardError` on every rank. Collective."""

    def raise_as(failed: str, errors: dict[int, Any]) -> ReshardError:
        return ReshardError(agreement.describe_failures(failed, errors))

    return agreement.run(compute, what, group, raise_as=raise_as)
