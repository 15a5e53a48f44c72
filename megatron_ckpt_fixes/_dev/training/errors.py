"""What a training job reports when it cannot go on: the same error on every rank.

Each error is built by the package's agreement (:mod:`megatron_ckpt_fixes.core.agreement`) from
every failing rank's report, so ``scripts/train.py`` prints it once per job, one line per
failing rank, instead of one traceback per rank.
"""

from __future__ import annotations

from megatron_ckpt_fixes.core.agreement import AgreementError
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError


class ConfigError(MegatronCkptFixesError, ValueError):
    """A flag or combination of flags this job cannot run with; raised identically on every
    rank (it depends only on the command line, the world size and the installed packages)."""


class CheckpointSaveError(AgreementError):
    """A checkpoint save failed on some rank; every rank raises it with every cause, and the
    tracker still names the last complete checkpoint."""


class CheckpointReadError(AgreementError):
    """The checkpoint to resume from cannot be read as asked (tracker, directory, contents)."""
