"""Import TorchRec, and name a mismatched FBGEMM instead of passing on a linker error.

FBGEMM's compiled operators load only into the torch minor release they were built for. With
another torch, ``import torchrec`` ends in ``OSError: ... fbgemm_gpu_tbe_index_select.so:
undefined symbol: _ZN5torch8autograd...`` after one multi-line warning per library, which
names neither package's version nor the fix. FBGEMM keeps the pairing itself, as
``_fbgemm_torch_compat_table`` (FBGEMM minor -> torch minor) in ``fbgemm_gpu/__init__.py``;
:func:`compat_table` reads it from the source without importing it (the import is what
fails), and ``scripts/install_torchrec_cpu.sh`` picks its pair from the same table.

Decided from behaviour first: only an import that failed is explained, and only when the
table says the installed FBGEMM is built for another torch; any other failure is re-raised
unchanged.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import logging
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.version import Version

from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError

TABLE = "_fbgemm_torch_compat_table"
#: The distributions that provide the ``fbgemm_gpu`` package (CPU build first).
FBGEMM_DISTRIBUTIONS = ("fbgemm-gpu-cpu", "fbgemm-gpu")


class FbgemmMismatchError(MegatronCkptFixesError, OSError):
    """The installed FBGEMM is built for another torch release (an ``OSError``, as the failed
    library load it replaces)."""


def minor(text: str) -> str:
    """``"2.14.1+cpu"`` -> ``"2.14"``."""
    release = Version(text).release
    return f"{release[0]}.{release[1]}"


def compat_table(init_source: str) -> dict[str, str]:
    """FBGEMM's own FBGEMM-minor -> torch-minor table from ``fbgemm_gpu/__init__.py``'s source
    (empty when that release has none)."""
    for node in ast.walk(ast.parse(init_source)):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == TABLE for t in targets):
            return ast.literal_eval(node.value)
    return {}


def _installed_fbgemm() -> tuple[str, str] | None:
    for name in FBGEMM_DISTRIBUTIONS:
        try:
            return name, version(name)
        except PackageNotFoundError:
            continue
    return None


def mismatch(cause: BaseException) -> FbgemmMismatchError | None:
    """The error naming both versions if the installed FBGEMM is built for another torch
    minor than the installed one (from FBGEMM's table); None if not (or it cannot be told)."""
    spec = importlib.util.find_spec("fbgemm_gpu")
    installed = _installed_fbgemm()
    if spec is None or spec.origin is None or installed is None:
        return None
    table = compat_table(Path(spec.origin).read_text())
    name, fbgemm = installed
    built_for = table.get(minor(fbgemm))
    torch = version("torch")
    if built_for is None or built_for == minor(torch):
        return None
    wanted = [fb for fb, t in table.items() if t == minor(torch)]
    fix = (f"install fbgemm-gpu-cpu {wanted[0]}.x with torchrec {wanted[0]}.x" if wanted else
           f"install the torchrec / fbgemm-gpu-cpu pair built for torch {minor(torch)}, or "
           f"torch {built_for}")
    library = Path(str(cause).split()[-1]).name if str(cause).split() else "a library"
    return FbgemmMismatchError(
        f"cannot import torchrec: {name} {fbgemm} is built for torch {built_for} (FBGEMM's "
        f"compatibility table) and this is torch {torch}: {fix} "
        f"(scripts/install_torchrec_cpu.sh picks the pair); {library} did not load")


@contextlib.contextmanager
def _held_root_records() -> Iterator[list[logging.LogRecord]]:
    """Hold what FBGEMM logs on the root logger while it loads (a multi-line warning per
    library on a mismatch); the caller replays the records if the import succeeded."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    root = logging.getLogger()
    root.addFilter(hold)
    try:
        yield held
    finally:
        root.removeFilter(hold)


def import_torchrec() -> None:
    """``import torchrec``; a mismatched FBGEMM raises :class:`FbgemmMismatchError`."""
    with _held_root_records() as held:
        try:
            importlib.import_module("torchrec")
        except OSError as exc:
            error = mismatch(exc)
            if error is not None:
                raise error from exc
            _replay(held)
            raise
    _replay(held)


def _replay(records: list[logging.LogRecord]) -> None:
    for record in records:
        logging.getLogger(record.name).handle(record)
