"""One rank of the suite: pytest with this rank's junit XML and log (started by run.py,
directly for one rank or by torchrun for several, as megatron-core's CI starts its suite).

    python rank_pytest.py OUT_DIR [pytest arguments...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def main() -> int:
    out = Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"rank{rank}.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        return int(pytest.main([*sys.argv[2:], f"--junitxml={out / f'rank{rank}.xml'}"]))


if __name__ == "__main__":
    sys.exit(main())
