"""Reversible monkey patches, described as data.

A fix that has to live inside megatron-core (or torch) is declared as a :class:`Patch`
next to the code it fixes; ``install()`` only applies the declared patches. Keeping the
original object (taken from the owner's ``__dict__``, so staticmethods, classmethods and
inherited attributes are restored exactly) is what makes ``uninstall()`` exact.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger(__name__)

_MISSING = object()


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Patch:
    """One attribute to replace.

    Attributes:
        name: stable, human readable id shown by ``installed()``.
        target: ``"package.module"`` or ``"package.module:Class"``.
        attr: attribute of the target to replace.
        build: ``original -> replacement``; the replacement usually wraps the original
            (``original`` is None for a patch that adds an attribute the owner lacks).
        needed: whether the installed versions still lack this fix (version awareness).
        aliases: other modules that imported the same object by name
            (``from x import f``); they are patched too when they still hold the original.
        why: one line for logs and ``installed()``.
    """

    name: str
    target: str
    attr: str
    build: Callable[[Any], Any]
    needed: Callable[[], bool] = _always
    aliases: tuple[str, ...] = ()
    why: str = ""


def resolve(target: str) -> Any:
    """Import ``module`` or ``module:Class.Inner`` and return the object."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _raw(owner: Any, attr: str) -> Any:
    """The attribute as stored on ``owner`` itself (``_MISSING`` when inherited)."""
    return vars(owner).get(attr, _MISSING)


@dataclass
class _Applied:
    patch: Patch
    originals: list[tuple[Any, Any]] = field(default_factory=list)  # (owner, raw original)


class PatchSet:
    """Applies and restores a list of patches; idempotent in both directions."""

    def __init__(self) -> None:
        self._applied: dict[str, _Applied] = {}

    def names(self) -> list[str]:
        return list(self._applied)

    def describe(self) -> dict[str, str]:
        return {name: a.patch.why for name, a in self._applied.items()}

    def apply(self, patch: Patch) -> bool:
        """Apply ``patch`` unless it is applied already or not needed. Returns True if applied."""
        if patch.name in self._applied or not patch.needed():
            return False
        owner = resolve(patch.target)
        raw = _raw(owner, patch.attr)
        original = getattr(owner, patch.attr, None)
        replacement = patch.build(original)
        applied = _Applied(patch, [(owner, raw)])
        setattr(owner, patch.attr, replacement)
        for alias in patch.aliases:
            alias_owner = resolve(alias)
            if _raw(alias_owner, patch.attr) is original:
                applied.originals.append((alias_owner, original))
                setattr(alias_owner, patch.attr, replacement)
        self._applied[patch.name] = applied
        logger.debug("patched %s.%s (%s)", patch.target, patch.attr, patch.name)
        return True

    def restore_all(self) -> None:
        """Restore every original, newest patch first (patches may stack on one attribute)."""
        for name in reversed(list(self._applied)):
            applied = self._applied.pop(name)
            for owner, raw in reversed(applied.originals):
                if raw is _MISSING:
                    delattr(owner, applied.patch.attr)
                else:
                    setattr(owner, applied.patch.attr, raw)
            logger.debug("restored %s", name)
