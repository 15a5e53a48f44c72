"""Zero-code activation: the fixes in a process whose code never calls ``install()``.

Megatron-LM users launch an unchanged ``pretrain_gpt.py``. Two switches, one mechanism:

- ``MEGATRON_CKPT_FIXES=1`` (or a comma-separated list of features) in the environment, for
  launchers whose command cannot change. The package puts a ``.pth`` file into site-packages
  (a plain ``pip install`` and an editable install alike; see setup.py) whose one line runs
  at every interpreter start-up: with the variable unset or ``0`` it costs one dictionary
  lookup; set, it calls :func:`activate_from_environment`.
- ``megatron-ckpt-fixes run -- SCRIPT ARGS`` / ``python -m megatron_ckpt_fixes.run``
  (:mod:`megatron_ckpt_fixes.run`): sets the same variable, so every process the job starts
  (megatron-core's spawned async checkpoint worker, say) gets the same fixes, and arms the
  same hook in its own process before running the script.

The hook never imports megatron-core itself: it waits (:mod:`megatron_ckpt_fixes.core.after_import`) until something
imports ``megatron.core``, lets that import finish, and then calls ``install(features)``.
Features of other systems (MLite, NeMo Automodel, TorchEasyRec, Megatron-LM's training
package: ``SYSTEMS``) wait the same way for their own package, so a job that never imports
megatron-core gets them too and pays nothing for megatron-core. An interpreter that imports
none of them (a launcher such as torchrun, a tool, a data-loader worker) only pays for
importing this module; a training script has every fix in place before its first line that can reach a checkpoint entry
point. A bad value is an error at the megatron-core import, where it matters, not a
traceback in every interpreter; left uncaught there it is one line, not a traceback
(:data:`~megatron_ckpt_fixes.core.verbosity.VERBOSE_ENV` for the traceback).

Once the fixes are in, rank 0's interpreter prints one line to stderr, where a user of
``pretrain_gpt.py`` sees it: the release patched, how many patches, and what was not applied
(:func:`megatron_ckpt_fixes.tools.status.activation_line`; ``megatron-ckpt-fixes status`` gives the
details). Other ranks, and the processes rank 0 starts through ``multiprocessing``
(megatron-core's spawned checkpoint workers, a forkserver importing the main script), stay
quiet. Nothing is written to the environment, so a process's later, unrelated children
report for themselves.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Sequence
from types import TracebackType

from megatron_ckpt_fixes.core import after_import as _after_import
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError

logger = logging.getLogger(__name__)

#: The environment switch: unset/empty/``0``/``off`` = off; ``1``/``on``/``default`` = the
#: default features; ``fixes`` = the default fixes without the speed-ups; otherwise a
#: comma-separated list of features (``default`` and ``fixes`` may be ones).
ENV = "MEGATRON_CKPT_FIXES"
#: The module whose import installs the megatron-core features (and reports a bad value);
#: a feature of another system (``megatron_ckpt_fixes.SYSTEMS``) waits for that system.
TRIGGER = "megatron.core"

_ON = frozenset({"1", "true", "yes", "on", "default"})
_FIXES = "fixes"
_OFF = frozenset({"", "0", "false", "no", "off"})


class ActivationError(MegatronCkptFixesError, ValueError):
    """The activation switch names something that is not a feature."""


def parse_features(value: str | None) -> tuple[str, ...] | None:
    """The features a switch value asks for; None when it asks for nothing.

    Raises :class:`ActivationError` for a name that is not a feature.
    """
    text = (value or "").strip().lower()
    if text in _OFF:
        return None
    from megatron_ckpt_fixes import FEATURES, FIXES, OPTIONAL_FEATURES
    from megatron_ckpt_fixes.core.features import BY_NAME

    features: list[str] = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        group = FEATURES if token in _ON else FIXES if token == _FIXES else (token,)
        features += [name for name in group if name not in features]
    unknown = [f for f in features if f not in BY_NAME]
    if unknown or not features:
        what = f"unknown feature(s) {unknown}" if unknown else "no feature"
        raise ActivationError(
            f"{ENV}={value!r} names {what}; use 1 (the default features), {_FIXES} (the "
            f"default fixes without the speed-ups) or a comma-separated list of "
            f"{list(FEATURES + OPTIONAL_FEATURES)} (default: all of FEATURES), or unset it")
    return tuple(features)


def switched_on(value: str | None) -> bool:
    """Whether a switch value asks for anything (unset, empty, ``0``, ``off``: no)."""
    return (value or "").strip().lower() not in _OFF


def _reports_here() -> bool:
    """Rank 0 (``RANK``, else ``LOCAL_RANK``, unset or 0), in a process that ``multiprocessing``
    did not start: neither its child (spawn, forkserver) nor a process importing the parent's
    main script for one (``_inheriting``: the forkserver's preload of ``__main__``)."""
    import multiprocessing

    rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "0"
    helper = multiprocessing.parent_process() is not None or getattr(
        multiprocessing.current_process(), "_inheriting", False)
    return rank.strip() == "0" and not helper


def _install(system: str, features: tuple[str, ...], value: str) -> None:
    import megatron_ckpt_fixes

    from megatron_ckpt_fixes.tools.status import activation_line

    megatron_ckpt_fixes.install(features)
    line = activation_line(megatron_ckpt_fixes.installed(), system, f"{ENV}={value}")
    if _reports_here():
        print(line, file=sys.stderr, flush=True)
    else:
        logger.debug("%s", line)


def _refuse(error: ActivationError) -> None:
    raise error


def _one_line_excepthook(previous: object) -> object:
    """``sys.excepthook`` that prints an uncaught :class:`ActivationError` as one line (the
    switch's value and what to set instead) rather than the import's traceback."""

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        from megatron_ckpt_fixes.core.verbosity import verbose_requested

        if isinstance(exc, ActivationError) and not verbose_requested():
            print(f"megatron_ckpt_fixes: error: {exc}", file=sys.stderr, flush=True)
            return
        previous(kind, exc, tb)  # type: ignore[operator]

    hook.one_line_activation_errors = True  # type: ignore[attr-defined]
    return hook


def _is_activation(callback: object) -> bool:
    return isinstance(callback, functools.partial) and callback.func in (_install, _refuse)


def by_system(features: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The features grouped by the package whose import installs them (megatron-core's
    first), each group in ``features``' order."""
    from megatron_ckpt_fixes import MEGATRON_CORE, feature_system

    groups: dict[str, list[str]] = {MEGATRON_CORE: []}
    for feature in features:
        groups.setdefault(feature_system(feature), []).append(feature)
    return {system: tuple(group) for system, group in groups.items() if group}


def disarm() -> None:
    """Remove the pending activation hooks (those that have not fired yet)."""
    _after_import.cancel(_is_activation)


def arm(value: str) -> None:
    """Install the features ``value`` names (a switch value) once their system is imported
    (megatron-core for most: :data:`TRIGGER`); at once for a system already imported. A bad
    value fails the megatron-core import."""
    disarm()
    try:
        features = parse_features(value)
    except ActivationError as error:
        if not getattr(sys.excepthook, "one_line_activation_errors", False):
            sys.excepthook = _one_line_excepthook(sys.excepthook)
        _after_import.after_import(TRIGGER, functools.partial(_refuse, error))
        return
    if features is None:
        return
    for system, group in by_system(features).items():
        _after_import.after_import(system, functools.partial(_install, system, group, value))


def activate_from_environment() -> None:
    """Called at interpreter start-up by the package's ``.pth`` file when :data:`ENV` is set."""
    value = os.environ.get(ENV, "")
    if switched_on(value):
        arm(value)
