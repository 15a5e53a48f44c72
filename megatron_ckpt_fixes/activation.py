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

The hook never imports megatron-core itself: it waits on ``sys.meta_path`` until something
imports ``megatron.core``, lets that import finish, and then calls ``install(features)``. An
interpreter that never touches megatron-core (a launcher such as torchrun, a tool, a
data-loader worker) only pays for importing this module; a training script has every fix in
place before its first line that can reach a checkpoint entry point. A bad value is an error
at that import, where it matters, not a traceback in every interpreter.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Callable

from .errors import MegatronCkptFixesError

logger = logging.getLogger(__name__)

#: The environment switch: unset/empty/``0``/``off`` = off; ``1``/``on``/``default`` = the
#: default features; otherwise a comma-separated list of features (``default`` may be one).
ENV = "MEGATRON_CKPT_FIXES"
#: The module whose import completes the activation.
TRIGGER = "megatron.core"

_ON = frozenset({"1", "true", "yes", "on", "default"})
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
    from . import FEATURES, OPTIONAL_FEATURES

    features: list[str] = []
    for token in filter(None, (t.strip() for t in text.split(","))):
        for name in FEATURES if token in _ON else (token,):
            if name not in features:
                features.append(name)
    unknown = [f for f in features if f not in FEATURES + OPTIONAL_FEATURES]
    if unknown or not features:
        what = f"unknown feature(s) {unknown}" if unknown else "no feature"
        raise ActivationError(
            f"{ENV}={value!r} names {what}; use 1 (the default features) or a "
            f"comma-separated list of {list(FEATURES + OPTIONAL_FEATURES)} (default: all of "
            "FEATURES)")
    return tuple(features)


def _install(value: str) -> None:
    import megatron_ckpt_fixes

    features = parse_features(value)
    if features is None:
        return
    names = megatron_ckpt_fixes.install(features)
    logger.info("megatron_ckpt_fixes activated (%s=%s): %d patches", ENV, value, len(names))


class _RunAfter(importlib.abc.Loader):
    """Runs the real loader, puts it back on the module, then calls ``then()``."""

    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.then()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """One-shot finder: installs the fixes once :data:`TRIGGER` has been imported."""

    def __init__(self, value: str) -> None:
        self.value = value

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> Any:
        if fullname != TRIGGER:
            return None
        disarm()
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RunAfter(spec.loader, lambda: _install(self.value))
        return spec


def disarm() -> None:
    """Remove a pending activation hook (one that has not fired yet)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _InstallAfterImport)]


def arm(value: str) -> None:
    """Install the features ``value`` names (a switch value) once megatron-core is imported;
    right now if it already is."""
    disarm()
    if TRIGGER in sys.modules:
        _install(value)
    else:
        sys.meta_path.insert(0, _InstallAfterImport(value))


def activate_from_environment() -> None:
    """Called at interpreter start-up by the package's ``.pth`` file when :data:`ENV` is set."""
    value = os.environ.get(ENV, "")
    if value.strip().lower() not in _OFF:
        arm(value)
