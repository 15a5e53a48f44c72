"""megatron-ckpt-fixes: distributed checkpoints that cannot save "successfully" and then fail.

``install()`` puts every fix into the megatron-core entry points users already call
(``dist_checkpointing.save`` / ``load``, the rerun state machine). Each fix is declared as
data (:class:`~megatron_ckpt_fixes._patching.Patch`) in the module that implements it; a
feature's name is that module's path inside the package (``"structure"``,
``"rerun.sentinel"``), and its module exposes ``PATCHES``. ``install()`` checks everything
the chosen patches need from upstream before touching anything, then applies them all or
none; patches whose fix upstream already has (detected from its behaviour) are not applied.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterable

from ._patching import Patch, PatchSet
from .compat.versions import check_supported
from .errors import MegatronCkptFixesError, UnsupportedVersionError

__version__ = "0.1.0"
__all__ = ["FEATURES", "OPTIONAL_FEATURES", "MegatronCkptFixesError", "UnsupportedVersionError",
           "__version__", "install", "installed", "installed_features", "uninstall"]

logger = logging.getLogger(__name__)

#: Features applied by ``install()``, in this order; each is the module path (inside this
#: package) of the module declaring its ``PATCHES``. ``install(["compat.cpu"])`` gives plain
#: upstream behaviour that runs on CPU/gloo, which the "upstream still fails" tests use.
FEATURES: tuple[str, ...] = (
    "compat.cpu",
    "structure",
    "rerun.sentinel",
    "rerun.stats_report",
    "rerun.transient_fault",
    "load_errors",
    "async_worker",
    "compat.rerun_device",
    "dtensor.mcore",
    "checksums",
    "writer_failures",  # after checksums: its metadata-write hold wraps the record's write
)

#: Features applied only when named: not checkpoint fixes. ``training.cpu_support`` replaces
#: ``torch`` inside megatron-core's forward/backward/optimizer modules so that GPTModel and
#: its optimizer train on gloo (scripts/train.py); GPU users do not need it.
OPTIONAL_FEATURES: tuple[str, ...] = (
    "training.cpu_support",
)

_lock = threading.Lock()
_patches = PatchSet()
_features: list[str] = []  # chosen by install() calls since the last uninstall()


def feature_patches(feature: str) -> tuple[Patch, ...]:
    """The patches a feature declares; each patch's name starts with the feature's name."""
    patches = importlib.import_module(f"{__name__}.{feature}").PATCHES
    strays = [p.name for p in patches if not p.name.startswith(f"{feature}.")]
    if strays:
        raise ValueError(f"feature {feature!r} declares patches named outside it: {strays}")
    return patches


def _declared(features: Iterable[str]) -> list[Patch]:
    chosen = list(features)
    known = FEATURES + OPTIONAL_FEATURES
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise ValueError(f"unknown features {unknown}; known: {list(known)}")
    return [patch for name in known if name in chosen for patch in feature_patches(name)]


def install(features: Iterable[str] | None = None) -> list[str]:
    """Apply every feature in ``FEATURES`` (or only ``features``, which may also name
    ``OPTIONAL_FEATURES``). Idempotent; calls add up; all or nothing.

    Raises :class:`UnsupportedVersionError` before touching anything when megatron-core is
    outside the supported range or lacks a symbol a chosen patch needs (each one named).
    Returns the names of all installed patches.
    """
    chosen = list(FEATURES if features is None else features)
    with _lock:
        check_supported()
        for name in _patches.install(_declared(chosen)):
            logger.info("megatron_ckpt_fixes: installed %s", name)
        _features.extend(f for f in chosen if f not in _features)
        return _patches.names()


def uninstall() -> None:
    """Restore every patched attribute to the exact original object."""
    with _lock:
        _patches.restore_all()
        _features.clear()


def installed_features() -> tuple[str, ...]:
    """The features chosen by ``install()`` calls so far (what a process that megatron-core
    spawns must install to behave like this one)."""
    return tuple(_features)


def installed() -> dict[str, str]:
    """Each applied patch with why it is needed, then each chosen patch that was not applied
    (``"not applied: ..."``: upstream already has the fix here, or an optional one's upstream
    symbol is missing)."""
    return _patches.describe()
