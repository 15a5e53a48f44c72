"""megatron-ckpt-fixes: distributed checkpoints that cannot save "successfully" and then fail.

``install()`` puts every fix into the megatron-core entry points users already call
(``dist_checkpointing.save`` / ``load``, the rerun state machine). Each fix is declared as
data (:class:`~megatron_ckpt_fixes._patching.Patch`) in the module that implements it; a
feature's name is that module's path inside the package (``"structure"``,
``"rerun.sentinel"``), and its module exposes ``PATCHES``. ``install()`` checks everything
the chosen patches need from upstream before touching anything, then applies them all or
none; patches whose fix upstream already has (detected from its behaviour) are not applied.

Most features patch megatron-core. A feature for another system (``SYSTEMS``: MLite, NeMo
Automodel, TorchEasyRec, Megatron-LM's training package) is applied when that system is imported: at once if it already is,
right after its first import if it is installed, never where it is not installed
(``installed()`` says which). Such a feature needs no megatron-core version check.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
import threading
from collections.abc import Iterable

from . import _after_import
from ._patching import Patch, PatchSet
from .compat.versions import check_supported
from .errors import MegatronCkptFixesError, UnsupportedVersionError

__version__ = "0.1.0"
__all__ = ["FEATURES", "OPTIONAL_FEATURES", "SYSTEMS", "MegatronCkptFixesError",
           "UnsupportedVersionError", "__version__", "feature_system", "install", "installed",
           "installed_features", "uninstall"]

logger = logging.getLogger(__name__)

#: Features applied by ``install()``, in this order; each is the module path (inside this
#: package) of the module declaring its ``PATCHES``. ``install(["compat.cpu"])`` gives plain
#: upstream behaviour that runs on CPU/gloo, which the "upstream still fails" tests use.
FEATURES: tuple[str, ...] = (
    "compat.cpu",
    "compat.tensor_metadata",
    "structure",
    "replicas",
    "rerun.sentinel",
    "rerun.stats_report",
    "rerun.transient_fault",
    "load_errors",
    "async_worker",
    "compat.rerun_device",
    "dtensor.mcore",
    "dtensor.mlite",
    "dtensor.nemo_automodel",
    "snapshot",
    "snapshot.nvrx",
    "checksums",
    "item_stream",
    "writeback",  # after checksums: its stream is the file itself, not the checksum's tap
    "reshard.tzrec",
    "write_results",
    "writer_threads",  # before writer_failures: its watch of forked writers wraps this
    "writer_failures",  # after checksums: its metadata-write hold wraps the record's write
    "megatron_lm.rng_state",
)

#: Features applied only when named: not checkpoint fixes. ``training.cpu_support`` replaces
#: ``torch`` inside megatron-core's forward/backward/optimizer modules so that GPTModel and
#: its optimizer train on gloo (scripts/train.py); GPU users do not need it.
OPTIONAL_FEATURES: tuple[str, ...] = (
    "training.cpu_support",
)

#: The package (import name) that a feature patches, for every feature that does not patch
#: megatron-core. Declared here rather than in the feature's module so that the zero-code
#: activation can wait for the right import without importing any feature module (they
#: import torch).
SYSTEMS: dict[str, str] = {
    "dtensor.mlite": "megatron.lite",
    "dtensor.nemo_automodel": "nemo_automodel",
    "megatron_lm.rng_state": "megatron.training",
    "reshard.tzrec": "tzrec",
    "snapshot.nvrx": "nvidia_resiliency_ext",
}

#: The system of every feature not in ``SYSTEMS``.
MEGATRON_CORE = "megatron.core"

# Reentrant: applying a feature imports upstream modules, and such an import may fire the
# zero-code activation's own install() in this thread.
_lock = threading.RLock()
_patches = PatchSet()
_features: list[str] = []  # chosen by install() calls since the last uninstall()
_waiting: dict[str, list[str]] = {}  # system -> features applied when it is first imported
_not_applied: dict[str, str] = {}  # patch name -> why it waits or is not applied


def feature_patches(feature: str) -> tuple[Patch, ...]:
    """The patches a feature declares; each patch's name starts with the feature's name."""
    patches = importlib.import_module(f"{__name__}.{feature}").PATCHES
    strays = [p.name for p in patches if not p.name.startswith(f"{feature}.")]
    if strays:
        raise ValueError(f"feature {feature!r} declares patches named outside it: {strays}")
    return patches


def feature_system(feature: str) -> str:
    """The import name of the package ``feature`` patches (``"megatron.core"`` for most)."""
    return SYSTEMS.get(feature, MEGATRON_CORE)


def _check_known(features: Iterable[str]) -> None:
    known = FEATURES + OPTIONAL_FEATURES
    unknown = sorted(set(features) - set(known))
    if unknown:
        raise ValueError(f"unknown features {unknown}; known: {list(known)}")


def _declared(features: Iterable[str]) -> list[Patch]:
    chosen = list(features)
    _check_known(chosen)
    return [patch for name in FEATURES + OPTIONAL_FEATURES if name in chosen
            for patch in feature_patches(name)]


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
    chosen = list(FEATURES if features is None else features)
    _check_known(chosen)
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
    installed but not imported yet). For a person: :func:`megatron_ckpt_fixes.status.report`,
    ``megatron-ckpt-fixes status``."""
    with _lock:
        return {**_patches.describe(), **_not_applied}
