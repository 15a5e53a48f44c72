"""Every rank-spanning decision of the package goes through this module.

Any choice that sends some ranks into a collective (replan, redistribute, raise) must be made
from the same information on every rank, or the ranks that chose differently hang. Like torch
DCP's ``_DistWrapper``, this is the one place where collectives turn rank-local facts into
shared decisions and rank-local failures into one error:

- :func:`agree`: did any rank set a flag, and did any rank fail? One all_reduce of two
  integers in the common case; the reports are gathered only when some rank failed.
- :func:`check` / :func:`run`: the same for "no decision, only failures" and for a local
  computation that may raise.
- :func:`same`: do all ranks hold the same value (a plan, a layout)? One all_reduce of a
  digest; the values are gathered only when the digests differ.
- :func:`bounds`: per position, the least and greatest value the ranks hold there (are the
  digests of a chunk equal wherever it is held?), and whether any rank failed. One
  all_reduce, whatever the world size.
- :func:`gather`: facts every rank needs in full (local shapes, slot ranges); not a decision.

A failure becomes the same error on every rank, built by ``raise_as(what, {rank: report})``
(default :class:`AgreementError`), so each caller raises its own error class while the
agreement stays here.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from megatron_ckpt_fixes.compat.device import collective_device
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError

T = TypeVar("T")

#: Builds the error every rank raises: ``(what, {failing rank: its report}) -> exception``.
RaiseAs = Callable[[str, dict[int, Any]], BaseException]


def describe_failures(what: str, errors: dict[int, Any]) -> str:
    """``what failed on N rank(s):`` and one line per failing rank."""
    detail = "\n".join(f"  rank {rank}: {msg}" for rank, msg in sorted(errors.items()))
    return f"{what} failed on {len(errors)} rank(s):\n{detail}"


class AgreementError(MegatronCkptFixesError, RuntimeError):
    """Raised identically on every rank when at least one rank reported an error."""

    def __init__(self, what: str, errors: dict[int, Any]) -> None:
        self.what = what
        self.errors = errors
        super().__init__(describe_failures(what, errors))


def rank_and_size(group: Any = None) -> tuple[int, int]:
    """This rank and the group size; ``(0, 1)`` without an initialized process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _max_reduce(values: list[int], group: Any) -> list[int]:
    votes = torch.tensor(values, dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
    return votes.tolist()


#: Values :func:`bounds` takes lie in ``[0, BOUND)`` (so that their negation fits in int64).
BOUND = 1 << 62


def gather(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (one ``all_gather_object``)."""
    rank, world = rank_and_size(group)
    if world == 1:
        return [value]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def _raise_gathered(error: Any, what: str, group: Any, raise_as: RaiseAs) -> None:
    gathered = gather(error, group)
    raise raise_as(what, {r: e for r, e in enumerate(gathered) if e is not None})


def _voted(values: list[int], error: Any | None, what: str, group: Any,
           raise_as: RaiseAs) -> list[int]:
    """``values`` reduced with MAX over the ranks in one all_reduce that also carries whether
    any rank failed (``error``: this rank's report); then the same error on every rank. On
    its own, a rank raises its own error or keeps its values."""
    rank, world = rank_and_size(group)
    if world == 1:
        if error is not None:
            raise raise_as(what, {rank: error})
        return values
    *votes, failed = _max_reduce([*values, int(error is not None)], group)
    if failed:
        _raise_gathered(error, what, group, raise_as)
    return votes


def bounds(values: list[int | None], group: Any = None, error: Any | None = None,
           what: str = "", raise_as: RaiseAs = AgreementError) -> list[tuple[int, int] | None]:
    """Per position, ``(least, greatest)`` of the values the ranks hold there (None: no rank
    holds one); each value in ``[0, BOUND)``. One all_reduce(MAX) of ``[v, -v]`` and, as in
    :func:`agree`, whether any rank failed (``error``: this rank's report; then the same
    error on every rank)."""
    n = len(values)
    votes = _voted([-1 if v is None else v for v in values]
                   + [-BOUND if v is None else -v for v in values], error, what, group, raise_as)
    return [None if votes[i] < 0 else (-votes[n + i], votes[i]) for i in range(n)]


def agree(flag: bool, error: Any | None, what: str, group: Any = None,
          raise_as: RaiseAs = AgreementError) -> bool:
    """Whether ``flag`` is set on any rank; the same error on every rank if any rank failed.

    ``error`` is this rank's failure report (a text, or any picklable report) or None.
    Collective: every rank of ``group`` calls it at the same point.
    """
    any_flag, = _voted([int(flag)], error, what, group, raise_as)
    return bool(any_flag)


def check(error: Any | None, what: str, group: Any = None,
          raise_as: RaiseAs = AgreementError) -> None:
    """Go on together, or raise the same error everywhere if any rank reported one."""
    agree(False, error, what, group, raise_as)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def describe_error(exc: BaseException) -> str:
    """An error as its causes, one line each, for a report to the other ranks: the package's
    errors are written that way already; torch DCP's ``CheckpointException`` carries one
    failure (with its traceback) per rank."""
    if isinstance(exc, MegatronCkptFixesError):
        return str(exc).strip()
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and len(failures) == 1:
        # A rank-local failure (megatron-core >= 0.19 plans loads per rank and keys its own
        # failure as rank 0): the agreement says which rank it was.
        return _first_line(next(iter(failures.values()))[0])
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {rank}: {_first_line(error)}"
                         for rank, (error, _trace) in sorted(failures.items()))
    return _first_line(exc)


def run(compute: Callable[[], T], what: str, group: Any = None,
        raise_as: RaiseAs = AgreementError) -> T:
    """Run a rank-local computation; if it raises on any rank, every rank raises.

    Every failure is agreed, also those that are ``BaseException``-only (torch DCP's
    ``CheckpointException``, this package's errors); only an interrupt or an exit is not.
    """
    result: Any = None
    error: str | None = None
    try:
        result = compute()
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - reported on every rank by check()
        error = describe_error(exc)
    check(error, what, group, raise_as)
    return result


def _digest(value: Any) -> int:
    """A 56-bit digest of the pickled value (56 bits so that its negation fits in int64)."""
    return int.from_bytes(hashlib.blake2b(pickle.dumps(value), digest_size=7).digest(), "big")


def same(value: Any, what: str, group: Any = None, raise_as: RaiseAs = AgreementError,
         error: Any | None = None) -> None:
    """Raise on every rank unless every rank holds an equal ``value`` (and none failed).

    One all_reduce(MAX) of ``[digest, -digest, failed]``: the digests agree iff the max equals
    the min. Only when they differ (or a rank failed) are the values gathered, and then
    compared with ``==``, so a value whose pickle is not canonical costs a gather but is
    never reported falsely. The message names the ranks that differ from rank 0.
    """
    alone = rank_and_size(group)[1] == 1
    digest = _digest(value) if error is None and not alone else 0
    high, neg_low = _voted([digest, -digest], error, what, group, raise_as)
    if high == -neg_low:
        return
    values = gather(value, group)
    differing = {r: f"holds {v!r}, rank 0 holds {values[0]!r}"
                 for r, v in enumerate(values) if v != values[0]}
    if differing:
        raise raise_as(f"agreeing on {what}", differing)
