"""TorchRec next to whichever torch is installed: the right pair, or one error naming both.

``scripts/install_torchrec_cpu.sh`` picks the torchrec / fbgemm-gpu-cpu pair from FBGEMM's own
compatibility table (``scripts/torchrec_pair.py``); a mismatched FBGEMM makes ``import
torchrec`` fail with a linker error, which ``megatron_ckpt_fixes.integrations.torchrec``'s
import turns into one line naming both versions. Needs TorchRec
(``scripts/install_torchrec_cpu.sh``) and the package registry (the mismatched FBGEMM is
installed beside this environment, ``pip install --no-deps --target``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from optional_systems import require

require("torchrec")

from megatron_ckpt_fixes.compat.torchrec import compat_table, minor

pytestmark = pytest.mark.varies_with("torch", "python", "torchrec")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "torchrec_pair.py"

#: FBGEMM 1.9.0's table, newest entries (fbgemm_gpu/__init__.py).
TABLE = {"1.9": "2.14", "1.8": "2.13", "1.7": "2.12"}
FBGEMM = ["1.9.0", "1.8.0", "1.7.0", "1.6.0"]
TORCHREC = ["1.9.2", "1.9.1", "1.9.0", "1.8.0", "1.7.0", "1.10.0rc1"]


def _pair_module():
    spec = importlib.util.spec_from_file_location("torchrec_pair", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("torchrec_pair", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("torch, expected", [
    ("2.13.0+cpu", ("1.8.0", "1.8.0")),
    ("2.14.1", ("1.9.2", "1.9.0")),
    ("2.14.0+cu130", ("1.9.2", "1.9.0")),
])
def test_the_pair_follows_fbgemms_table(torch, expected):
    pair = _pair_module().choose(torch, TABLE, FBGEMM, TORCHREC)
    assert (pair.torchrec, pair.fbgemm) == expected


def test_a_torch_no_table_names_is_one_error():
    pairs = _pair_module()
    with pytest.raises(pairs.NoPair) as raised:
        pairs.choose("2.15.0", TABLE, FBGEMM, TORCHREC)
    assert str(raised.value).startswith("torch 2.15.0: no fbgemm-gpu-cpu release is built for "
                                        "torch 2.15 (FBGEMM's compatibility table, newest "
                                        "entries: torch 2.14 -> 1.9, torch 2.13 -> 1.8")
    with pytest.raises(pairs.NoPair, match=r"torch 2\.14\.1 needs torchrec 1\.9\.x"):
        pairs.choose("2.14.1", TABLE, FBGEMM, ["1.8.0", "1.10.0rc1"])


def test_the_installed_pair_is_the_one_the_script_picks():
    """The script, on the real registry and FBGEMM's real table, picks what this environment
    runs (installed by that script), and the installed FBGEMM's table agrees with torch."""
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [version("torchrec"), version("fbgemm-gpu-cpu")]
    installed = importlib.util.find_spec("fbgemm_gpu").origin
    table = compat_table(Path(installed).read_text())
    assert table[minor(version("fbgemm-gpu-cpu"))] == minor(version("torch"))


def _mismatched_fbgemm() -> str:
    """A fbgemm-gpu-cpu release built for another torch minor than the installed one."""
    table = compat_table(Path(importlib.util.find_spec("fbgemm_gpu").origin).read_text())
    mine = minor(version("fbgemm-gpu-cpu"))
    other = "1.8" if mine != "1.8" else "1.9"
    assert table.get(other, other) != minor(version("torch"))
    return f"{other}.0"


def test_a_mismatched_fbgemm_is_one_error_naming_both_versions(beside):
    fbgemm = _mismatched_fbgemm()
    env = beside(f"fbgemm-gpu-cpu=={fbgemm}")

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300)

    # Upstream twin: TorchRec's own import ends in the linker's words.
    upstream = run("import torchrec")
    assert upstream.returncode == 1
    assert "undefined symbol" in upstream.stderr, upstream.stderr[-3000:]
    assert "FBGEMM_GPU version is" in upstream.stderr  # FBGEMM's multi-line warnings

    fixed = run("import megatron_ckpt_fixes.integrations.torchrec")
    assert fixed.returncode == 1
    last = fixed.stderr.strip().splitlines()[-1]
    torch = version("torch")
    built_for = "2.14" if fbgemm.startswith("1.9") else "2.13"
    assert last.startswith(
        f"megatron_ckpt_fixes.compat.torchrec.FbgemmMismatchError: cannot import torchrec: "
        f"fbgemm-gpu-cpu {fbgemm} is built for torch {built_for} (FBGEMM's compatibility "
        f"table) and this is torch {torch}: install "), last
    assert "(scripts/install_torchrec_cpu.sh picks the pair)" in last
    assert len(last) < 400, last
    assert "FBGEMM_GPU version is" not in fixed.stderr  # held, not printed
