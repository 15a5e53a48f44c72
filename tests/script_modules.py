"""Import one of the repository's scripts (``scripts/*.py``, not a package) as a module."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@contextlib.contextmanager
def script_module(name: str) -> Iterator[ModuleType]:
    """``scripts/<name>.py`` imported as module ``name``, registered in ``sys.modules`` while
    it is used (dataclasses look their module up while they are defined)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
