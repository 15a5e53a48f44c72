"""Keep the ranks of a multi-rank suite run in step, test by test.

megatron-core's suite runs every test on every rank (torchrun), and its tests and fixtures
share the default process group. When a test fails on some ranks only, or before a
collective, the ranks leave it at different collectives: the next tests then pair up the
wrong collectives and fail (or hang) for reasons of their own, and one failure turns into a
cascade whose shape depends on timing. That would make two runs incomparable test by test.

After each test every rank reports, through torchrun's TCP store (not the process group),
whether the test failed there, and waits for all ranks. If it failed on any rank, every rank
drops megatron-core's model-parallel state, destroys its process groups and rebuilds the
default one (:func:`store_epoch` gives each re-initialization its own store keys); the next
test builds megatron-core's groups afresh. Each test thus starts from the state its own
setup builds, as in a clean run.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys

import torch.distributed as dist

logger = logging.getLogger(__name__)

_epoch = 0


def store_epoch() -> int:
    """How many times the process groups were reset (a fresh key prefix for each)."""
    return _epoch


class RankSync:
    """A rank's view of the run: one store barrier per test, and the reset after failures."""

    def __init__(self, rank: int, world_size: int, wait_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.wait = datetime.timedelta(seconds=wait_s)
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   is_master=False, timeout=self.wait)
        self.count = 0

    def after_test(self, nodeid: str, failed: bool) -> int:
        """Wait for every rank to finish the test; how many ranks failed it."""
        self.count += 1
        key = f"mcf-suite/{self.count}"
        self.store.add(f"{key}/failed", int(failed))
        self.store.set(f"{key}/done/{self.rank}", nodeid)
        names = [f"{key}/done/{rank}" for rank in range(self.world_size)]
        self.store.wait(names, self.wait)
        seen = {self.store.get(name).decode() for name in names}
        if seen != {nodeid}:
            raise RuntimeError(f"ranks ran different tests as test {self.count}: {sorted(seen)}")
        return int(self.store.add(f"{key}/failed", 0))

    def reset(self) -> None:
        """Forget megatron-core's groups and rebuild the default process group, on every rank.

        In a clean run the default group, once a test has created it, lives until the end
        (the suite's teardown drops only megatron-core's groups); tests that do not build
        one themselves rely on it (``test_safe_globals`` barriers only if it exists). So a
        default group that existed is made afresh here, as the suite's own helper makes it.
        """
        global _epoch
        import megatron.core.parallel_state as ps

        try:
            ps.destroy_model_parallel()
        except Exception as exc:  # noqa: BLE001 - a broken group is why we are here
            logger.warning("destroy_model_parallel during reset: %s", exc)
        had_default = dist.is_initialized()
        if had_default:
            dist.destroy_process_group()
        _epoch += 1
        utilities = sys.modules.get("tests.unit_tests.test_utilities")
        if utilities is not None:
            if had_default:
                utilities.Utils.initialize_distributed()
            utilities.Utils.inited = False
