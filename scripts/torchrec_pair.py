#!/usr/bin/env python
"""Which torchrec / fbgemm-gpu-cpu pair loads next to the installed torch.

    python scripts/torchrec_pair.py     # prints "TORCHREC FBGEMM" (versions), or one error line

FBGEMM's compiled operators load only into the torch minor release they were built against
(another one fails at import with ``OSError: ... undefined symbol``). FBGEMM keeps the
mapping itself, as ``_fbgemm_torch_compat_table`` in ``fbgemm_gpu/__init__.py`` (FBGEMM minor
-> torch minor: "1.9": "2.14", "1.8": "2.13", ...), and each newer release's table extends the
older ones'. So the table is read from the newest fbgemm-gpu-cpu wheel on the registry
(downloaded, not installed: about 6 MB), the FBGEMM minor whose entry names the installed
torch's minor is chosen, and with it the newest fbgemm-gpu-cpu and torchrec releases of that
minor (torchrec and FBGEMM release in lockstep: torchrec 1.9.x runs on FBGEMM 1.9.x). A torch
that no table names (newer than FBGEMM's newest release, or older than its oldest) is one
error line naming the torch and the minors the table knows. Used by
``scripts/install_torchrec_cpu.sh``; the versions come from this Python's pip, so only
releases with a wheel for this interpreter count.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_ckpt_fixes.compat.torchrec import TABLE, compat_table, minor  # noqa: E402

FBGEMM = "fbgemm-gpu-cpu"
TORCHREC = "torchrec"


class NoPair(Exception):
    """No torchrec / fbgemm-gpu-cpu pair fits the installed torch (one line says why)."""


@dataclass(frozen=True)
class Pair:
    torchrec: str
    fbgemm: str


def choose(torch_version: str, table: dict[str, str], fbgemm_versions: list[str],
           torchrec_versions: list[str]) -> Pair:
    """The newest fbgemm-gpu-cpu and torchrec releases of the FBGEMM minor that the table
    pairs with ``torch_version``'s minor."""
    wanted = minor(torch_version)
    minors = [fb for fb, torch in table.items() if torch == wanted]
    if not minors:
        known = ", ".join(f"torch {t} -> {fb}" for fb, t in
                          sorted(table.items(), key=lambda kv: Version(kv[1]), reverse=True)[:4])
        raise NoPair(f"torch {torch_version}: no fbgemm-gpu-cpu release is built for torch "
                     f"{wanted} (FBGEMM's compatibility table, newest entries: {known}); "
                     "install a torch the table names")
    fb_minor = max(minors, key=Version)

    def newest(name: str, versions: list[str]) -> str:
        fitting = [v for v in versions if minor(v) == fb_minor and not Version(v).is_prerelease]
        if not fitting:
            raise NoPair(f"torch {torch_version} needs {name} {fb_minor}.x (FBGEMM's "
                         f"compatibility table), which has no release for Python "
                         f"{sys.version_info.major}.{sys.version_info.minor} on the registry")
        return str(max(fitting, key=Version))

    return Pair(newest(TORCHREC, torchrec_versions), newest(FBGEMM, fbgemm_versions))


def _pip(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NoPair(f"pip {' '.join(args)} failed: " + " ".join(done.stderr.split())[-300:])
    return done.stdout


def available(name: str) -> list[str]:
    """Every release of ``name`` with a wheel for this interpreter (pip's own view)."""
    found = re.search(r"Available versions: (.*)", _pip("index", "versions", name))
    if not found:
        raise NoPair(f"the registry lists no release of {name} for this Python")
    return [v.strip() for v in found.group(1).split(",")]


def newest_table(fbgemm_versions: list[str]) -> dict[str, str]:
    """The compatibility table of the newest fbgemm-gpu-cpu release."""
    newest = str(max(fbgemm_versions, key=Version))
    with tempfile.TemporaryDirectory() as tmp:
        _pip("download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", tmp,
             f"{FBGEMM}=={newest}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            table = compat_table(zf.read("fbgemm_gpu/__init__.py").decode())
    if not table:
        raise NoPair(f"{FBGEMM} {newest} has no {TABLE}: cannot tell which torch it needs")
    return table


def main() -> int:
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        print("torchrec_pair.py: error: torch is not installed in this environment "
              f"({sys.executable}); install torch first", file=sys.stderr)
        return 1
    try:
        fbgemm_versions = available(FBGEMM)
        pair = choose(torch_version, newest_table(fbgemm_versions), fbgemm_versions,
                      available(TORCHREC))
    except NoPair as exc:
        print(f"torchrec_pair.py: error: {exc}", file=sys.stderr)
        return 1
    print(pair.torchrec, pair.fbgemm)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
