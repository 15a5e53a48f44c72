"""TorchEasyRec (``tzrec``) from its snapshot, importable on CPU: test harness.

tzrec is not on the package index, its requirements cannot be installed here (pyfg,
graphlearn and common_io come from tzrec's own server), and its ``tzrec/__init__.py`` runs
``auto_import()``, which imports every model, dataset and feature module. Its checkpoint code
(``tzrec.utils.checkpoint_util``) needs only torch, TorchRec and tzrec's generated protobuf
modules. :func:`activate` makes the snapshot importable:

- the snapshot is ``upstream_snapshots.snapshot_tree("torcheasyrec", "head")`` (a missing
  snapshot raises ``SnapshotMissing``; the test modules skip without it, naming it, and fail
  in CI: tests/optional_systems.py);
- the protobuf modules are generated with ``grpc_tools.protoc`` (tzrec's own pin,
  ``grpcio-tools<1.63.0``: ``scripts/install_tzrec_test_deps.sh``) into a folder beside the
  extracted snapshot, never into it; once per snapshot and grpcio-tools release;
- that folder also holds a bare ``tzrec/__init__.py`` whose package path is that folder (for
  the generated ``tzrec.protos``) and then the snapshot's ``tzrec/``: tzrec's own
  ``__init__`` body is not run, every module under it is the snapshot's.

So ``import tzrec`` after :func:`activate` is a real first import of the package ``tzrec``
(what ``install()`` and the zero-code activation wait for), of a stand-in for tzrec's
``__init__``; that stand-in is all this harness replaces.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import upstream_snapshots  # noqa: E402

SNAPSHOT = ("torcheasyrec", "head")

_INIT = '''"""A bare stand-in for tzrec/__init__.py (tests/functional/tzrec_harness.py): tzrec's own
runs auto_import(), which needs packages that cannot be installed here."""
__path__.append({tzrec!r})
'''


def snapshot_tzrec() -> Path:
    """The snapshot's ``tzrec/`` folder."""
    return upstream_snapshots.snapshot_tree(*SNAPSHOT) / "tzrec"


def import_root() -> Path:
    """The folder to put first on ``sys.path``: the bare package and the generated protobuf
    modules (made on the first call; concurrent callers wait on a lock)."""
    tzrec = snapshot_tzrec()
    try:
        tools = version("grpcio-tools")
    except PackageNotFoundError as exc:
        raise RuntimeError("grpcio-tools is not installed (tzrec's protobuf modules are generated "
                           "with it): bash scripts/install_tzrec_test_deps.sh") from exc
    extracted = tzrec.parent.parent  # the cache folder of this snapshot's digest
    root = extracted.with_name(f"{extracted.name}-protos-grpcio-tools-{tools}")
    done = root / ".generated"
    if done.is_file():
        return root
    with open(extracted.with_name(f".{root.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            partial = root.with_name(root.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            protos = sorted(str(p.relative_to(tzrec.parent)) for p in tzrec.glob("protos/**/*.proto"))
            subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", *protos,
                            f"--python_out={partial}"], cwd=tzrec.parent, check=True)
            for package in {p.parent for p in (partial / "tzrec").rglob("*_pb2.py")}:
                (package / "__init__.py").touch()
            (partial / "tzrec" / "__init__.py").write_text(_INIT.format(tzrec=str(tzrec)))
            shutil.rmtree(root, ignore_errors=True)
            partial.rename(root)
            done.write_text(f"{' '.join(protos)}\n")
    return root


def activate() -> Path:
    """Make ``import tzrec`` find the snapshot (this process); returns the import root."""
    root = import_root()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return root
