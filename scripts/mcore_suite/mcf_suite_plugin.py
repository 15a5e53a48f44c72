"""pytest plugin: megatron-core's own unit tests on CPU/gloo, with chosen megatron_ckpt_fixes
features installed for the whole session.

Loaded with ``-p mcf_suite_plugin`` (this directory on ``PYTHONPATH``); the upstream test
files are run unedited. Environment:

- ``MCF_FEATURES``: ``all`` (``megatron_ckpt_fixes.install()``), ``none`` (nothing), or a
  comma-separated list of features; ``compat.cpu`` is plain upstream made runnable on gloo.
- ``MCF_SITES_OUT``: where to write (JSON) each call site that asked for CUDA and was mapped
  to the CPU (``{rank}`` in the path is replaced by the rank).
- ``MCF_COLLECTIVE_TIMEOUT_S``: gloo collective timeout (default 180 s), so a hang fails.

With several ranks (torchrun), the ranks are kept in step test by test (:mod:`rank_sync`).

The CPU mappings (:mod:`cpu_platform`) are the same in every mode, so any difference in
outcome between two modes comes from the installed features.
"""

from __future__ import annotations

import json
import os
import typing
from pathlib import Path

import pytest

import cpu_platform
import rank_sync

if not hasattr(typing, "override"):
    # megatron.training as shipped with megatron-core 0.19 is Python 3.12 code
    # (``from typing import override``); on 3.11 the PEP 698 backport is the same decorator.
    # Set at plugin import, before pytest imports the suite's conftest files.
    from typing_extensions import override

    typing.override = override

FEATURES_ENV = "MCF_FEATURES"
SITES_ENV = "MCF_SITES_OUT"

_platform: cpu_platform.CpuPlatform | None = None
_installed: list[str] = []
_sync: rank_sync.RankSync | None = None
_failed_here = False


def chosen_features() -> list[str] | None:
    """The features ``MCF_FEATURES`` names: None for all of them, [] for none."""
    spec = os.environ.get(FEATURES_ENV, "").strip()
    if not spec:
        raise pytest.UsageError(f"set {FEATURES_ENV} to 'all', 'none' or a list of features")
    if spec == "all":
        return None
    if spec == "none":
        return []
    return [name.strip() for name in spec.split(",") if name.strip()]


def _check_installed_megatron(rootdir: Path) -> Path:
    """The suite must test the installed wheel, never a megatron/ source tree beside it."""
    import megatron.core

    location = Path(megatron.core.__file__).resolve()
    if rootdir.resolve() in location.parents or "site-packages" not in location.parts:
        raise pytest.UsageError(f"megatron.core resolves to {location}, not to the installed "
                                "wheel; run from a directory without megatron/")
    return location.parent


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    global _platform, _installed
    _check_installed_megatron(config.rootpath)
    features = chosen_features()
    if features != []:  # before the CPU mappings: install() detects the real process
        import megatron_ckpt_fixes

        _installed = megatron_ckpt_fixes.install(features)
    _platform = cpu_platform.CpuPlatform().open()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        global _sync
        wait_s = 2 * float(config.getoption("timeout", None) or 300) + 60
        _sync = rank_sync.RankSync(int(os.environ["RANK"]), world_size, wait_s)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    global _failed_here
    _failed_here = False
    yield
    if _sync is not None and _sync.after_test(item.nodeid, _failed_here):
        _sync.reset()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    global _failed_here
    _failed_here |= report.failed


def pytest_report_header(config: pytest.Config) -> list[str]:
    from importlib.metadata import version

    import megatron.core
    import torch

    return [
        f"megatron-core {version('megatron-core')} at {Path(megatron.core.__file__).parent}",
        f"torch {torch.__version__}; CUDA mapped to CPU, NCCL to gloo (cpu_platform)",
        f"{FEATURES_ENV}={os.environ.get(FEATURES_ENV)}: {len(_installed)} patches installed",
        *(f"  {name}" for name in _installed),
    ]


def pytest_unconfigure(config: pytest.Config) -> None:
    global _platform
    if _platform is not None:
        _platform.close()
        _platform = None
    out = os.environ.get(SITES_ENV)
    if out:
        path = Path(out.replace("{rank}", os.environ.get("RANK", "0")))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(cpu_platform.SITES.most_common()), indent=1))
