"""The optional systems some test modules need, and what a module does when one is missing.

TorchRec, NeMo Automodel, TorchEasyRec's test dependencies, nvidia-resiliency-ext and the
upstream source snapshots (Megatron-LM's, MLite's, TorchEasyRec's) are not dependencies of
the package: ``pip install -e ".[test]"`` does not bring them. A module that needs one calls
:func:`require` at its top, before importing it:

- a user who has not installed it gets one skip line for the whole module, naming what is
  missing and the command that brings it (``pytest -ra`` lists them at the end);
- CI sets :data:`REQUIRE_ENV` (``.ci/run``), which turns each such skip into a collection
  error, so nothing silently stops running there.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_ckpt_fixes.activation import switched_on

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import upstream_snapshots  # noqa: E402 - scripts/ is not a package

#: Switched on (``1``) where every optional system must be present: CI.
REQUIRE_ENV = "MCF_REQUIRE_OPTIONAL"


@dataclass(frozen=True)
class System:
    """An optional system: the modules that must import, the snapshot sets
    (``upstream_snapshots.SETS`` names, or ``megatron-lm``) that must be there, and the
    command that brings what is missing."""

    modules: tuple[str, ...] = ()
    snapshots: tuple[str, ...] = ()
    install: str = ""


SNAPSHOT_HINT = ("python scripts/fetch_upstream_snapshots.py (the pinned upstream commits, from "
                 "GitHub), or ../shared/upstream beside the checkout, or "
                 f"{upstream_snapshots.SNAPSHOTS_ENV}=FOLDER (docs/development.md)")

SYSTEMS: dict[str, System] = {
    "torchrec": System(("torchrec", "fbgemm_gpu"), install="bash scripts/install_torchrec_cpu.sh"),
    "nemo_automodel": System(("nemo_automodel", "transformers"),
                             install="bash scripts/install_nemo_automodel.sh"),
    "mlite": System(("safetensors",), ("megatron-lite",),
                    install="bash scripts/install_nemo_automodel.sh (safetensors)"),
    "tzrec": System(("torchrec", "fbgemm_gpu", "grpc_tools"), ("torcheasyrec",),
                    install="bash scripts/install_torchrec_cpu.sh && "
                            "bash scripts/install_tzrec_test_deps.sh"),
    "nvrx": System(install="bash scripts/install_nvrx_cpu.sh"),
    "megatron-lm": System(snapshots=("megatron-lm",)),
}

#: Where scripts/install_nvrx_cpu.sh unpacks nvidia-resiliency-ext for this Python.
NVRX = REPO / ".venv-nvrx-cpu" / f"py{sys.version_info[0]}.{sys.version_info[1]}"


def _snapshot_missing(name: str) -> str | None:
    try:
        if name == "megatron-lm":
            upstream_snapshots.snapshots_dir()
        else:
            folder = upstream_snapshots.snapshots_dir().parent / name
            if not (folder / "SHA256SUMS").is_file():
                return f"no {name} snapshots at {folder}"
    except upstream_snapshots.SnapshotMissing as error:
        return str(error).split(":", 1)[0]
    return None


def missing(name: str) -> list[str]:
    """What of system ``name`` is not here (empty: all of it is)."""
    system = SYSTEMS[name]
    gone = [f"module {m}" for m in system.modules if importlib.util.find_spec(m) is None]
    gone += filter(None, (_snapshot_missing(s) for s in system.snapshots))
    if name == "nvrx" and not NVRX.is_dir():
        gone.append(f"nvidia-resiliency-ext unpacked at {NVRX}")
    return gone


def required_everywhere() -> bool:
    """Whether :data:`REQUIRE_ENV` is switched on (the package's own reading of a switch)."""
    return switched_on(os.environ.get(REQUIRE_ENV))


def require(*names: str) -> None:
    """Skip the calling test module (module level) when a system it needs is missing; fail
    instead where :data:`REQUIRE_ENV` is set."""
    for name in names:
        gone = missing(name)
        if not gone:
            continue
        system = SYSTEMS[name]
        hint = system.install or SNAPSHOT_HINT
        if system.install and system.snapshots and any("snapshot" in g for g in gone):
            hint = f"{hint}; {SNAPSHOT_HINT}"
        caller = Path(sys._getframe(1).f_code.co_filename).name  # the line names the module
        message = f"{caller} needs {name}: missing {', '.join(gone)}; install with: {hint}"
        if required_everywhere():
            pytest.fail(f"{message} ({REQUIRE_ENV} is set: optional systems must be here)",
                        pytrace=False)
        pytest.skip(message, allow_module_level=True)
