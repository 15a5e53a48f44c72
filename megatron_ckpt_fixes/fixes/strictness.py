"""A load that leaves requested keys unloaded under a logging strictness says so, once, alike
on every rank.

``dist_checkpointing.load(..., strict=LOG_UNEXPECTED or LOG_ALL)`` (Megatron-LM's
``--dist-ckpt-strictness``; Megatron-Bridge recipes set ``log_all``) drops every requested key
the checkpoint does not hold from the load and goes on: those tensors keep the values they had
before the load (a fresh initialization, on a resume). Each rank logs its own keys, in its
own words, and only the ranks that asked for such a key say anything; a caller that then
retries its module load non-strictly (Megatron-Bridge PR 6032) resumes "successfully" with
those weights freshly initialized, and one warning on some rank is all that is left of it.

The patched load keeps the load as asked (a logging strictness is a choice: the same keys
are dropped, the same values loaded) but asks upstream to return the mismatches instead of
logging them (``RETURN_UNEXPECTED`` / ``RETURN_ALL``, the same checks), gathers them, and
every rank logs the same one line naming the keys left unloaded and the ranks that asked for
each, in upstream's words ("Unexpected keys", "Missing keys": what logs are searched for,
and what megatron-core's own tests read). Where loading every requested key was asked for,
the same keys are refused before any tensor data is read: the pre-flight (:mod:`.preflight`)
and scripts/train.py's ``--ckpt-verify-checksums``, which runs it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from megatron_ckpt_fixes.core.agreement import gather

logger = logging.getLogger(__name__)

#: Keys a line names (then a count): lines stay readable (messages.LIMIT).
SHOWN = 8


def _counterparts() -> dict[Any, Any]:
    from megatron.core.dist_checkpointing.validation import StrictHandling

    return {StrictHandling.LOG_UNEXPECTED: StrictHandling.RETURN_UNEXPECTED,
            StrictHandling.LOG_ALL: StrictHandling.RETURN_ALL}


def as_returning(original: Callable[..., Any], args: tuple, kwargs: dict
                 ) -> tuple[tuple, dict, Any | None]:
    """The arguments of a call of ``dist_checkpointing.load`` with a logging strictness
    replaced by the one that returns the same mismatches, and that logging strictness (None:
    the call is left as it is)."""
    from megatron.core.dist_checkpointing.validation import parse_strict_flag

    try:
        bound = inspect.signature(original).bind(*args, **kwargs)
    except TypeError:
        return args, kwargs, None  # the load itself says what is wrong with the call
    bound.apply_defaults()
    try:
        strict = parse_strict_flag(bound.arguments.get("strict"))
    except Exception:  # noqa: BLE001 - an unknown value: upstream's load refuses it
        return args, kwargs, None
    returning = _counterparts().get(strict)
    if returning is None:
        return args, kwargs, None
    bound.arguments["strict"] = returning
    return bound.args, bound.kwargs, strict


@dataclass(frozen=True)
class Unloaded:
    """Every rank's view: requested keys the checkpoint does not hold (with the ranks that
    asked for each), and the checkpoint's keys no rank requested (``LOG_ALL`` only)."""

    requested: dict[str, tuple[int, ...]]
    not_requested: tuple[str, ...]


def agreed(unexpected: Iterable[str], missing: Iterable[str], group: Any = None) -> Unloaded:
    """What every rank left unloaded (collective: one gather)."""
    views = gather((sorted(unexpected), sorted(missing)), group)
    ranks: dict[str, list[int]] = {}
    for rank, (keys, _missing) in enumerate(views):
        for key in keys:
            ranks.setdefault(key, []).append(rank)
    missing_keys = sorted({key for _keys, missing in views for key in missing})
    return Unloaded({key: tuple(r) for key, r in sorted(ranks.items())}, tuple(missing_keys))


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _named(items: list[str]) -> str:
    more = len(items) - SHOWN
    return ", ".join(items[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def line(checkpoint_dir: Any, strict: Any, unloaded: Unloaded) -> str | None:
    """The line every rank logs (None: nothing was left out)."""
    parts = []
    if unloaded.requested:
        keys = [f"{key!r} ({_ranks(ranks)})" for key, ranks in unloaded.requested.items()]
        parts.append(f"Unexpected keys (requested, not in the checkpoint: left unloaded, they keep "
                     f"the values they had before the load): {len(keys)}: {_named(keys)}")
    if unloaded.not_requested:
        keys = [repr(key) for key in unloaded.not_requested]
        parts.append(f"Missing keys (in the checkpoint, not requested): {len(keys)}: "
                     f"{_named(keys)}")
    if not parts:
        return None
    return (f"megatron_ckpt_fixes: loading {checkpoint_dir} with strict={strict.value}: "
            + "; ".join(parts))


def report(checkpoint_dir: Any, strict: Any, result: tuple) -> Any:
    """Log the agreed line of a load called with the returning strictness (collective) and
    return what the logging strictness returns: the state dict alone."""
    state, missing, unexpected = result
    text = line(checkpoint_dir, strict, agreed(unexpected, missing))
    if text is not None:
        logger.warning("%s", text)
    return state
