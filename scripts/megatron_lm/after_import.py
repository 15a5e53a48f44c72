"""Run a function on a module right after it is imported (or now, if it already is).

The CPU platform and the loss record patch functions of Megatron-LM's training tree, which is
not importable yet when a rank's ``sitecustomize`` runs (the script's directory joins
``sys.path`` later) and which the harness must not import ahead of upstream's own order.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any, Callable


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """One-shot finder: runs ``then(module)`` right after ``name`` has been executed."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then
        self.loader: Any = None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.then(module)


def after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call ``then(module)`` once ``name`` is imported; at once if it already is."""
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))
