"""scripts/gpu_check.sh is for a GPU machine; here it must say in one line why it cannot run.

Nothing depends on the script (CI has no GPU); this keeps it runnable. Skipped where CUDA is
available, since the script would then run its checks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.varies_with()

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run the script itself")
def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin",
                               "PYTHON": sys.executable, "OUT": str(tmp_path)})
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == (f"gpu_check: no CUDA device (torch {torch.__version__}): nothing to "
                           "check here\n")
