"""One rank of the suite: pytest with this rank's junit XML and log (started by run.py,
directly for one rank or by torchrun for several, as megatron-core's CI starts its suite).

    python rank_pytest.py OUT_DIR [pytest arguments...]
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import pytest


def leave_together() -> None:
    """Wait until every rank's pytest has finished (its XML written): torchrun stops the
    other ranks as soon as one exits non-zero, which would cut their reports short."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=600))
    store.add("mcf-suite/finished", 1)
    while int(store.add("mcf-suite/finished", 0)) < world_size:
        time.sleep(0.5)


def main() -> int:
    """pytest for this rank. Each rank gets its own ``--basetemp`` under the run's folder:
    the suite's shared checkpoint directory (``tmp_path_dist_ckpt``) is two levels above it,
    so the ranks of one run share it and no other pytest on the machine does (by default it
    is ``/tmp/pytest-of-<user>/tmp_dist_ckpt`` for every suite run of the user at once)."""
    out = Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    (out / "tmp").mkdir(parents=True, exist_ok=True)
    with open(out / f"rank{rank}.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        code = int(pytest.main([*sys.argv[2:], f"--junitxml={out / f'rank{rank}.xml'}",
                                f"--basetemp={out / 'tmp' / f'rank{rank}'}"]))
    leave_together()
    return code


if __name__ == "__main__":
    sys.exit(main())
