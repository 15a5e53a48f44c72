"""megatron-ckpt-fixes: distributed checkpoints that cannot save "successfully" and then fail.

``install()`` puts every fix into the megatron-core entry points users already call
(``dist_checkpointing.save`` / ``load``, the rerun state machine). Each feature is named in
:mod:`.core.features` (a fix, a speed-up or CPU support, and whether it is on by default); its
module declares what it replaces as data (``PATCHES``: :class:`~.core.patching.Patch`, or a
:class:`~.core.patching.Layer` of an attribute several features wrap, :mod:`.core.entry_points`).
``install()`` checks everything the chosen patches need from upstream before touching
anything, then applies them all or none; patches whose fix upstream already has (detected
from its behaviour) are not applied.

Most features patch megatron-core. A feature for another system (``SYSTEMS``: MLite, NeMo
Automodel, TorchEasyRec, Megatron-LM's training package) is applied when that system is
imported: at once if it already is, right after its first import if it is installed, never
where it is not installed (``installed()`` says which). Such a feature needs no megatron-core
version check.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
import threading
from collections.abc import Iterable

from megatron_ckpt_fixes.core import after_import as _after_import
from megatron_ckpt_fixes.core import save_call
from megatron_ckpt_fixes.core.patching import Declared, PatchSet
from megatron_ckpt_fixes.compat.versions import check_supported
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError, UnsupportedVersionError
from megatron_ckpt_fixes.core.features import (BY_NAME, MEGATRON_CORE, REGISTRY, SPEEDUP, canonical,
    named)

__version__ = "0.1.0"
__all__ = ["FEATURES", "FIXES", "OPTIONAL_FEATURES", "SPEEDUPS", "SYSTEMS", "MegatronCkptFixesError",
           "UnsupportedVersionError", "__version__", "feature_system", "install", "installed",
           "installed_features", "uninstall"]

logger = logging.getLogger(__name__)

#: Features applied by ``install()`` without arguments, in this order (:mod:`.core.features` says
#: what each is). ``install(["compat.cpu"])`` gives plain upstream behaviour that runs on
#: CPU/gloo, which the "upstream still fails" tests use.
FEATURES: tuple[str, ...] = tuple(f.name for f in REGISTRY if f.default)

#: Features applied only when named: speed-ups that read private internals, and
#: ``training.cpu_support`` (replaces ``torch`` inside megatron-core's forward/backward/
#: optimizer modules so that GPTModel and its optimizer train on gloo; GPU users do not
#: need it).
OPTIONAL_FEATURES: tuple[str, ...] = tuple(f.name for f in REGISTRY if not f.default)

#: The default fixes alone, without the speed-ups (``MEGATRON_CKPT_FIXES=fixes``).
FIXES: tuple[str, ...] = tuple(f.name for f in REGISTRY if f.default and f.kind != SPEEDUP)

#: Every speed-up, default or not.
SPEEDUPS: tuple[str, ...] = named(SPEEDUP)

#: The package (import name) that a feature patches, for every feature that does not patch
#: megatron-core, so that the zero-code activation can wait for the right import without
#: importing any feature module (they import torch).
SYSTEMS: dict[str, str] = {f.name: f.system for f in REGISTRY if f.system != MEGATRON_CORE}

# Reentrant: applying a feature imports upstream modules, and such an import may fire the
# zero-code activation's own install() in this thread.
_lock = threading.RLock()
_patches = PatchSet()
_features: list[str] = []  # chosen by install() calls since the last uninstall()
_waiting: dict[str, list[str]] = {}  # system -> features applied when it is first imported
_not_applied: dict[str, str] = {}  # patch name -> why it waits or is not applied


def feature_patches(feature: str) -> tuple[Declared, ...]:
    """The patches and layers a feature declares; each one's name starts with the feature's
    name, but for the shared patch of the save in progress (:mod:`.core.save_call`)."""
    feature = canonical(feature)
    patches = importlib.import_module(f"{__name__}.{BY_NAME[feature].module}").PATCHES
    strays = [p.name for p in patches
              if not p.name.startswith(f"{feature}.") and p is not save_call.PATCH]
    if strays:
        raise ValueError(f"feature {feature!r} declares patches named outside it: {strays}")
    return patches


def feature_system(feature: str) -> str:
    """The import name of the package ``feature`` patches (``"megatron.core"`` for most)."""
    return SYSTEMS.get(canonical(feature) if feature in BY_NAME else feature, MEGATRON_CORE)


def _known(features: Iterable[str]) -> list[str]:
    """``features`` by their names (an old name gives the feature's), each once; ValueError
    naming the unknown ones."""
    chosen = list(features)
    unknown = sorted(set(chosen) - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown features {unknown}; known: {[f.name for f in REGISTRY]}")
    return list(dict.fromkeys(canonical(f) for f in chosen))


def _declared(features: Iterable[str]) -> list[Declared]:
    chosen = _known(features)
    return [patch for feature in REGISTRY if feature.name in chosen
            for patch in feature_patches(feature.name)]


def _installable(system: str) -> bool:
    """Whether ``system`` can be imported here (finding it imports only its parents)."""
    try:
        return importlib.util.find_spec(system) is not None
    except (ImportError, ValueError):
        return False


def _wait_for(system: str, features: list[str]) -> None:
    """Apply ``features`` right after ``system``'s first import."""
    first = system not in _waiting
    waiting = _waiting.setdefault(system, [])
    waiting += [f for f in features if f not in waiting]
    for patch in _declared(features):
        if patch.name not in _patches.names():
            _not_applied[patch.name] = f"waiting: applied when {system} is first imported"
    if first:
        _after_import.after_import(system, functools.partial(_apply_waiting, system))


def _apply_waiting(system: str) -> None:
    """Right after ``system``'s first import: its waiting features, all or nothing (an
    :class:`UnsupportedVersionError` makes that import fail, nothing of them patched)."""
    with _lock:
        features = _waiting.pop(system, [])
        try:
            applied = _patches.install(_declared(features))
        except UnsupportedVersionError:
            for patch in _declared(features):
                _not_applied[patch.name] = (f"not applied: refused when {system} was imported "
                                            "(UnsupportedVersionError)")
            raise
        for name in applied:
            _not_applied.pop(name, None)
            logger.info("megatron_ckpt_fixes: installed %s (after importing %s)", name, system)


def _is_waiting_callback(callback: object) -> bool:
    return isinstance(callback, functools.partial) and callback.func is _apply_waiting


def install(features: Iterable[str] | None = None) -> list[str]:
    """Apply every feature in ``FEATURES`` (or only ``features``, which may also name
    ``OPTIONAL_FEATURES``). Idempotent; calls add up; all or nothing.

    Raises :class:`UnsupportedVersionError` before touching anything when megatron-core is
    outside the supported range (checked only when a megatron-core feature is chosen) or
    lacks a symbol a chosen patch needs (each one named). A feature of another system
    (``SYSTEMS``) is applied with the rest if that system is imported, waits for its first
    import if it is installed (then all of that system's features or none, and a missing
    symbol fails that import), and is skipped where it is not installed.
    Returns the names of all installed patches.
    """
    chosen = _known(FEATURES if features is None else features)
    with _lock:
        now = [f for f in chosen if feature_system(f) == MEGATRON_CORE]
        if now:
            check_supported()
        later: dict[str, list[str]] = {}
        absent: dict[str, str] = {}  # recorded once the rest is applied: all or nothing
        for feature in chosen:
            system = feature_system(feature)
            if system == MEGATRON_CORE:
                continue
            if sys.modules.get(system) is not None:  # None: its import is blocked
                now.append(feature)
            elif _installable(system):
                later.setdefault(system, []).append(feature)
            else:
                for patch in _declared([feature]):
                    absent[patch.name] = f"not applied: {system} is not installed"
        for name in _patches.install(_declared(now)):
            _not_applied.pop(name, None)
            logger.info("megatron_ckpt_fixes: installed %s", name)
        _not_applied.update(absent)
        for system, waiting in later.items():
            _wait_for(system, waiting)
        _features.extend(f for f in chosen if f not in _features)
        return _patches.names()


def uninstall() -> None:
    """Restore every patched attribute to the exact original object, and forget the
    features still waiting for their system's import."""
    with _lock:
        _after_import.cancel(_is_waiting_callback)
        _waiting.clear()
        _not_applied.clear()
        _patches.restore_all()
        _features.clear()


def installed_features() -> tuple[str, ...]:
    """The features chosen by ``install()`` calls so far (what a process that megatron-core
    spawns must install to behave like this one)."""
    return tuple(_features)


def installed() -> dict[str, str]:
    """Each applied patch with why it is needed, then each chosen patch that was not applied
    (``"not applied: ..."``: upstream already has the fix here, an optional one's upstream
    symbol is missing, or its system is not installed; ``"waiting: ..."``: its system is
    installed but not imported yet). For a person: :func:`megatron_ckpt_fixes.tools.status.report`,
    ``megatron-ckpt-fixes status``."""
    with _lock:
        return {**_patches.describe(), **_not_applied}
