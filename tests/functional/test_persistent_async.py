"""megatron-core's persistent async checkpoint worker (``AsyncCallsQueue(persistent=True)``)
on CPU/gloo: it runs, and a worker that dies makes every rank raise instead of waiting."""

from __future__ import annotations

import pytest
from persistent_async_jobs import persistent_save_worker

from megatron_ckpt_fixes._dev.testing import run_ranks


@pytest.mark.timeout(900)
def test_upstream_worker_dies_at_start_and_the_trainer_waits_forever():
    """Upstream on gloo: the worker pins ``rank % torch.cuda.device_count()`` (0 devices:
    ZeroDivisionError, exit code 1) and the trainer keeps waiting for it to stage."""
    results = run_ranks(persistent_save_worker, 2, "upstream-cpu", None, timeout_s=600)
    for r in results:
        first = r.value["first"]
        assert first["worker_exit"] == 1 and first["waiting"], first


@pytest.mark.timeout(900)
def test_persistent_saves_run_and_a_dead_worker_raises_on_every_rank():
    """install() alone, no environment switch: the spawned worker has the trainer's fixes,
    so its writes are checksummed (every saved item, checked), and a byte flipped in a
    large item (hashed through the worker's tap) is caught on every rank."""
    results = run_ranks(persistent_save_worker, 2, "all", 1, timeout_s=840)
    flipped = [r.value["first"]["value"][2] for r in results]
    assert flipped[0] == flipped[1] and flipped[0][0] == "ChecksumError", flipped
    assert "'big' chunk at (0,)" in flipped[0][1] and "checksum mismatch" in flipped[0][1]
    for rank, r in enumerate(results):
        first, killed = r.value["first"], r.value["killed"]
        assert first == {"value": (0.0, ("verified", True, 0), flipped[0]), "waiting": False,
                         "worker_exit": None}, (rank, first)
        assert not killed["waiting"], (rank, killed)  # it raised
        name, message, classes = killed["error"]
        assert name == "AsyncWorkerError" and "CheckpointException" in classes, killed
        assert "failed on 1 rank(s)" in message and "rank 1: the persistent checkpoint " \
               "worker" in message and "exited with code 7" in message, message
    assert results[0].value["killed"]["error"] == results[1].value["killed"]["error"]
    assert results[1].value["killed"]["worker_exit"] == 7
