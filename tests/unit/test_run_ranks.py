"""``run_ranks`` forks its ranks from a fork server that imported torch once, while the
caller's start-up variables are the ones that server started with; a rank must still see the
caller's environment of its own call, and start as a fresh interpreter would where start-up
variables changed (the package's activation hook, a ``sitecustomize`` on ``PYTHONPATH``)."""

from __future__ import annotations

import os

import psutil
import torch
import torch.multiprocessing as mp

from megatron_ckpt_fixes.core import after_import as _after_import
from megatron_ckpt_fixes.activation import ENV, TRIGGER
from megatron_ckpt_fixes._dev.testing import RankResult, receive_result, run_ranks, send_result


def _seen(rank: int, world_size: int) -> dict:
    return {"var": os.environ.get("MCF_TEST_RUN_RANKS_VAR"),
            "armed": _after_import.pending().get(TRIGGER, 0),
            "sitecustomize": os.environ.get("MCF_TEST_RUN_RANKS_SITE"),
            "forked": "multiprocessing.forkserver" in " ".join(
                psutil.Process(os.getppid()).cmdline())}


def test_each_call_gives_its_ranks_the_callers_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    first = [r.value for r in run_ranks(_seen, 2)]
    assert [v["var"] for v in first] == [None, None] and all(v["armed"] == 0 for v in first)
    monkeypatch.setenv("MCF_TEST_RUN_RANKS_VAR", "set later")  # read by the rank, not at start-up
    again = [r.value for r in run_ranks(_seen, 2)]
    assert all(v["var"] == "set later" for v in again), again
    if first[0]["forked"]:  # the fork server started with these start-up variables: used again
        assert all(v["forked"] for v in again), again

    (tmp_path / "sitecustomize.py").write_text(
        "import os\nos.environ['MCF_TEST_RUN_RANKS_SITE'] = 'ran'\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(ENV, "1")  # zero-code activation, read at an interpreter's start-up
    later = [r.value for r in run_ranks(_seen, 2)]
    assert all(v["var"] == "set later" and v["sitecustomize"] == "ran" for v in later), later
    assert all(v["armed"] >= 1 for v in later), later  # the hook waits for megatron.core


def _send_and_exit(results) -> None:
    send_result(results, RankResult(0, torch.arange(4.0)))


def test_a_tensor_result_is_read_after_its_rank_exited():
    """torch's multiprocessing pickler would hand the tensor over as a descriptor that the
    exited rank no longer serves (FileNotFoundError in the parent's read); by value it reads."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    proc = ctx.Process(target=_send_and_exit, args=(results,))
    proc.start()
    proc.join()
    got = receive_result(results, timeout=30)
    assert torch.equal(got.value, torch.arange(4.0))
