"""megatron-ckpt-fixes: distributed checkpoints that cannot save "successfully" and then fail.

``install()`` puts every fix into the megatron-core entry points users already call
(``dist_checkpointing.save`` / ``load``, the rerun state machine). Each fix is declared as
data (:class:`~megatron_ckpt_fixes._patching.Patch`) in the module that implements it; the
feature modules listed in ``_FEATURES`` are applied in order, each only where the installed
megatron-core still lacks it.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterable

from ._patching import Patch, PatchSet
from .compat.versions import UnsupportedVersionError, check_supported

__version__ = "0.1.0"
__all__ = ["FEATURES", "OPTIONAL_FEATURES", "install", "uninstall", "installed", "UnsupportedVersionError", "__version__"]

logger = logging.getLogger(__name__)

#: Feature name -> module exposing ``PATCHES: tuple[Patch, ...]``; applied in this order.
#: ``install(features=("cpu",))`` gives plain upstream behaviour that runs on CPU/gloo, which
#: is what the "upstream still fails" tests use.
FEATURES: dict[str, str] = {
    "cpu": "megatron_ckpt_fixes.compat.cpu",
    "structure": "megatron_ckpt_fixes.structure",
    "rerun-sentinel": "megatron_ckpt_fixes.rerun",
    "rerun-stats": "megatron_ckpt_fixes.rerun.stats_report",
    "load-errors": "megatron_ckpt_fixes.load_errors",
    "rerun-cpu": "megatron_ckpt_fixes.compat.rerun_device",
}

#: Features applied only when named: not checkpoint fixes, and they replace ``torch`` inside
#: megatron-core's forward/backward/optimizer modules, which GPU users do not need patched.
#: ``training-cpu`` lets megatron-core's GPTModel and optimizer train on gloo (scripts/train.py).
OPTIONAL_FEATURES: dict[str, str] = {
    "training-cpu": "megatron_ckpt_fixes.training.cpu_support",
}

_lock = threading.Lock()
_patches = PatchSet()


def _declared(features: Iterable[str]) -> list[Patch]:
    known = {**FEATURES, **OPTIONAL_FEATURES}
    unknown = sorted(set(features) - set(known))
    if unknown:
        raise ValueError(f"unknown features {unknown}; known: {list(known)}")
    chosen = set(features)
    return [
        patch
        for name, module in known.items()
        if name in chosen
        for patch in importlib.import_module(module).PATCHES
    ]


def install(features: Iterable[str] | None = None) -> list[str]:
    """Apply every fix in ``FEATURES`` the installed megatron-core lacks (or only ``features``,
    which may also name ``OPTIONAL_FEATURES``). Idempotent; calls add up.

    Returns the names of all installed patches. Raises :class:`UnsupportedVersionError`
    for a megatron-core outside the supported range, before touching anything.
    """
    with _lock:
        check_supported()
        for patch in _declared(FEATURES if features is None else features):
            if _patches.apply(patch):
                logger.info("megatron_ckpt_fixes: installed %s", patch.name)
        return _patches.names()


def uninstall() -> None:
    """Restore every patched attribute to the exact original object."""
    with _lock:
        _patches.restore_all()


def installed() -> dict[str, str]:
    """Installed patches: name -> why it is needed."""
    return _patches.describe()
