"""What a training job reports when it cannot go on: the same error on every rank.

Each error is built by the package's agreement (:mod:`megatron_ckpt_fixes.agreement`) from
every failing rank's report, so ``scripts/train.py`` prints it once per job, one line per
failing rank, instead of one traceback per rank.
"""

from __future__ import annotations

from ..agreement import AgreementError
from ..errors import MegatronCkptFixesError


class ConfigError(MegatronCkptFixesError, ValueError):
    """A flag or combination of flags this job cannot run with; raised identically on every
    rank (it depends only on the command line, the world size and the installed packages)."""


class CheckpointSaveError(AgreementError):
    """A checkpoint save failed on some rank; every rank raises it with every cause, and the
    tracker still names the last complete checkpoint."""


class CheckpointReadError(AgreementError):
    """The checkpoint to resume from cannot be read as asked (tracker, directory, contents)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def describe(exc: BaseException) -> str:
    """An error as its causes, one line each: the package's errors are written that way;
    torch DCP's ``CheckpointException`` carries one failure (with its traceback) per rank."""
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
