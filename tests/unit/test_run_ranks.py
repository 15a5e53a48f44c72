"""``run_ranks`` forks its ranks from a fork server that imported torch once, while the
caller's start-up variables are the ones that server started with; a rank must still see the
caller's environment of its own call, and start as a fresh interpreter would where start-up
variables changed (the package's activation hook, a ``sitecustomize`` on ``PYTHONPATH``)."""

from __future__ import annotations

import os

import psutil

from megatron_ckpt_fixes import _after_import
from megatron_ckpt_fixes.activation import ENV, TRIGGER
from megatron_ckpt_fixes.testing import run_ranks


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
