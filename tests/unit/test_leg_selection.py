"""CI legs run each test where its outcome can differ (tests/conftest.py): a test without a
``varies_with`` marker runs on every leg, a marked one only where one of its components is
new, and a module proven on an earlier leg is not even imported there (its optional system
need not be installed). The trivial wrong versions fail here: selecting everything (no time
saved), deselecting unmarked tests (a new test would silently run nowhere), or importing a
module before deciding (its missing system would fail the leg)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.varies_with()

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
MODULES = {
    "test_plain.py": "def test_everywhere():\n    pass\n",
    "test_torch_only.py": ("import pytest\n\npytestmark = pytest.mark.varies_with('torch')\n\n"
                           "def test_with_torch():\n    pass\n"),
    "test_system.py": ("import pytest\n\npytestmark = pytest.mark.varies_with('torchrec')\n\n"
                       "import a_system_this_leg_does_not_have\n\n"
                       "def test_with_the_system():\n    pass\n"),
    "test_mixed.py": ("import pytest\n\n@pytest.mark.varies_with()\ndef test_once():\n    pass\n\n"
                      "def test_always():\n    pass\n"),
}


def _collected(tmp_path: Path, new: str | None, without: str = "") -> set[str]:
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    env = {k: v for k, v in os.environ.items() if k not in ("MCF_CI_NEW", "MCF_CI_WITHOUT")}
    if new is not None:
        env.update(MCF_CI_NEW=new, MCF_CI_WITHOUT=without)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p",
                           "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    # on a leg, the module whose system is missing is left out, not imported and failed
    assert new is None or done.returncode == 0, done.stdout[-3000:]
    return {line.split("::")[-1] for line in done.stdout.splitlines() if "::" in line}


def test_each_leg_runs_what_can_differ_there(tmp_path):
    assert _collected(tmp_path, "megatron-core") == {"test_everywhere", "test_always"}
    assert _collected(tmp_path, "torch,python") == {"test_everywhere", "test_with_torch",
                                                    "test_always"}
    # a leg without a system leaves its tests (new torch or not) to the leg that has it
    assert _collected(tmp_path, "torch,torchrec", without="torchrec") == {
        "test_everywhere", "test_with_torch", "test_always"}


def test_without_the_switch_everything_runs(tmp_path):
    """A user's run: every test (here the system's import fails, as it would for a user
    without it: tests/optional_systems.py turns that into a named skip)."""
    collected = _collected(tmp_path, None)
    assert {"test_everywhere", "test_with_torch", "test_once", "test_always"} <= collected
