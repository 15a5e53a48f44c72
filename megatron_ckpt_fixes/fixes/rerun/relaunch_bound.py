"""A checkpoint that brings the same fault back is relaunched a bounded number of times.

With ``--rerun-mode validate_results`` a fatal check that fails twice in place asks for a
checkpoint and exit 16 (resume to disambiguate: rerun this step on another GPU), and a
relaunch that lands on the same GPU exits 16 again without a checkpoint. Neither answer
knows how often it was given before: a job whose checkpoint reproduces its fault (a corrupt
replica-retrieved local checkpoint that NaNs three steps after the load, Megatron-LM issue
5281), or whose launcher returns the same GPUs by construction (an in-job restart), loads
the same checkpoint, reaches the same fault and exits 16, forever.

The count lives beside the checkpoint the job resumed from (the last one
``dist_checkpointing.load`` read: :func:`note_loaded`), in :data:`RECORD` in its parent
directory (the save directory), keyed by that checkpoint, the iteration (the machine's own
count, ``#N`` as in its log lines) and the fault (the failed check's message): the same on
every relaunch, whatever the rerun state the checkpoint holds. Rank 0 counts; every rank
gets its count (one collective, only when the machine asks for exit 16, on every rank
alike). Past :data:`LIMIT_ENV` (default :data:`DEFAULT_LIMIT`) relaunches of one fault from
one checkpoint the answer becomes exit 17, upstream's "failed result validation", without a
checkpoint, and rank 0 logs one line naming the iteration, the fault, the checkpoint and the
count.

Why 17 and not a new code: schedulers and Megatron-LM's launch scripts already read 16 as
"relaunch" and 17 as "stop, a person has to look"; a code of our own would be an unknown
failure to them, which many relaunch. The diagnosis is 17's too: the result is reproducible
from this checkpoint, and the checkpoint the job resumed from still reproduces it. A job
that never loaded a checkpoint, or whose save directory cannot be written, is not counted
(upstream's answers, with one warning for the latter).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from megatron_ckpt_fixes.core.agreement import bounds, gather, rank_and_size

logger = logging.getLogger(__name__)

#: The record of relaunches, in the directory that holds the checkpoint resumed from.
RECORD = "rerun_fault_relaunches.json"
#: How many relaunches one fault may ask for from one checkpoint.
LIMIT_ENV = "MEGATRON_CKPT_FIXES_MAX_FAULT_RELAUNCHES"
DEFAULT_LIMIT = 3
#: megatron-core's exit codes (rerun_state_machine.EXIT_CODE_*).
RESUME_TO_DISAMBIGUATE, FAILED_ON_RESULT_VALIDATION = 16, 17

_resumed: str | None = None  # the checkpoint this process last loaded


def note_loaded(checkpoint_dir: Any) -> None:
    """``dist_checkpointing.load`` read ``checkpoint_dir`` (every rank, after the load)."""
    global _resumed
    _resumed = os.path.abspath(os.fspath(checkpoint_dir))


def limit() -> int:
    """:data:`LIMIT_ENV`, else :data:`DEFAULT_LIMIT` (a value that is not a count: the
    default, with a warning)."""
    text = os.environ.get(LIMIT_ENV, "").strip()
    if not text:
        return DEFAULT_LIMIT
    try:
        value = int(text)
        if value >= 0:
            return value
    except ValueError:
        pass
    logger.warning("%s=%r is not a count of relaunches: %d is used", LIMIT_ENV, text,
                   DEFAULT_LIMIT)
    return DEFAULT_LIMIT


def _fault(machine: Any) -> str | None:
    """This rank's failed check (only the ranks whose check failed know it)."""
    call = getattr(machine, "failed_validation_call", None)
    caller = getattr(call, "caller", None)
    return None if caller is None else f"{caller.message} (check #{call.sequence})"


def bump(record: Path, key: str) -> int:
    """Count one more relaunch of ``key`` in ``record`` (written atomically); the new count."""
    counts: dict[str, int] = {}
    if record.exists():
        counts = json.loads(record.read_text())
    counts[key] = counts.get(key, 0) + 1
    partial = record.with_name(record.name + ".partial")
    partial.write_text(json.dumps(counts, indent=1, sort_keys=True))
    os.replace(partial, record)
    return counts[key]


def _count(checkpoint: str, iteration: int, fault: str) -> int | None:
    """Rank 0: this relaunch of the fault from ``checkpoint``, counted (None: not counted)."""
    record = Path(checkpoint).parent / RECORD
    key = f"{Path(checkpoint).name} | iteration {iteration} | {fault}"
    try:
        return bump(record, key)
    except (OSError, ValueError) as exc:
        logger.warning("megatron_ckpt_fixes: cannot count this relaunch in %s (%s: %s): the "
                       "rerun state machine's answer is kept", record, type(exc).__name__, exc)
        return None


def bounded(machine: Any, checkpoint: bool, exits: bool, code: int) -> tuple[bool, bool, int]:
    """``should_checkpoint_and_exit``'s answer, with exit 16 turned into 17 once the same
    fault came back from the same checkpoint more than :func:`limit` times. Collective when
    the answer is exit 16 (then the same on every rank: the machine's state is agreed)."""
    if not (exits and code == RESUME_TO_DISAMBIGUATE):
        return checkpoint, exits, code
    faults = [f for f in gather(_fault(machine)) if f is not None]
    fault = faults[0] if faults else "unknown check"
    iteration = machine.current_iteration
    resumed = _resumed
    mine = None
    if rank_and_size()[0] == 0 and resumed is not None:
        mine = _count(resumed, iteration, fault)
    agreed = bounds([mine])[0]
    if agreed is None:
        return checkpoint, exits, code
    count, allowed = agreed[1], limit()
    if count <= allowed:
        if rank_and_size()[0] == 0:
            logger.warning("megatron_ckpt_fixes: relaunch %d of at most %d for the fault at "
                           "iteration #%d (%s) from %s", count, allowed, iteration, fault,
                           resumed)
        return checkpoint, exits, code
    if rank_and_size()[0] == 0:
        logger.error(
            "megatron_ckpt_fixes: iteration #%d: the fault '%s' came back %d times from %s "
            "(the rerun state machine asked for a relaunch, exit 16, each time; at most %d "
            "allowed, %s): exit 17, failed result validation, no checkpoint. The checkpoint "
            "reproduces the fault: resume from an earlier one or skip the iteration", iteration,
            fault, count, resumed, allowed, LIMIT_ENV)
    return False, True, FAILED_ON_RESULT_VALIDATION
