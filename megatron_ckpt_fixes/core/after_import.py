"""Run code right after a module's first import, without importing it ourselves.

Two things wait for an import: the zero-code activation (install the fixes once the training
code imports megatron-core, never earlier: an interpreter that never touches megatron-core
must not pay for it) and ``install()`` for a feature whose system (MLite, NeMo Automodel,
TorchEasyRec) is installed but not imported yet (patch it when it is, so the names its
importers bind are already the fixed ones). Both need the same mechanism: a finder on
``sys.meta_path`` that lets the real import happen, then runs the callbacks before control
returns to the importer. One finder serves every pending module; it leaves ``sys.meta_path``
when nothing is pending, and the module keeps its real loader (``__loader__`` and
``__spec__.loader``), so nothing of this stays visible after the import.

A callback that raises makes that import raise (the import machinery then drops the half-done
module from ``sys.modules``): a fix that cannot be applied is loud where it matters.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Callable

Callback = Callable[[], None]


class _RunAfter(importlib.abc.Loader):
    """Runs the real loader, puts it back on the module, then runs the module's callbacks
    (taken from the finder only now: a spec that is never executed takes nothing)."""

    def __init__(self, loader: Any, finder: AfterImportFinder, fullname: str) -> None:
        self.loader = loader
        self.finder = finder
        self.fullname = fullname

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        for callback in self.finder.take(self.fullname):
            callback()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the loader that the other finders return for a module
    with pending callbacks (each module's callbacks run once, when the module is executed: a
    probe such as ``importlib.util.find_spec``, which many libraries use to ask whether a
    package is installed, imports nothing and leaves them waiting)."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callback]] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> Any:
        if fullname not in self.pending:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RunAfter(spec.loader, self, fullname)
                return spec
        return None

    def take(self, fullname: str) -> list[Callback]:
        """The callbacks of ``fullname``, no longer pending (the finder leaves
        ``sys.meta_path`` once nothing is)."""
        callbacks = self.pending.pop(fullname, [])
        if not self.pending:
            _leave()
        return callbacks


def _finder() -> AfterImportFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, AfterImportFinder)), None)


def _leave() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AfterImportFinder)]


def after_import(module: str, callback: Callback) -> None:
    """Run ``callback`` right after ``module`` is first imported; at once if it already is."""
    if sys.modules.get(module) is not None:
        callback()
        return
    finder = _finder()
    if finder is None:
        finder = AfterImportFinder()
        sys.meta_path.insert(0, finder)
    finder.pending.setdefault(module, []).append(callback)


def cancel(callback_owner: Callable[[Callback], bool]) -> None:
    """Drop every pending callback for which ``callback_owner(callback)`` is true."""
    finder = _finder()
    if finder is None:
        return
    for module in list(finder.pending):
        kept = [c for c in finder.pending[module] if not callback_owner(c)]
        if kept:
            finder.pending[module] = kept
        else:
            del finder.pending[module]
    if not finder.pending:
        _leave()


def pending() -> dict[str, int]:
    """Modules still waited for, with how many callbacks each (for tests and logs)."""
    finder = _finder()
    return {m: len(c) for m, c in finder.pending.items()} if finder else {}
