"""``run_ranks`` forks its ranks from a fork server that started once, with the environment
of that moment: each rank must still see the caller's environment of its own call, and the
package's start-up activation hook must act on it, as in a freshly spawned interpreter."""

from __future__ import annotations

import os

from megatron_ckpt_fixes import _after_import
from megatron_ckpt_fixes.activation import ENV, TRIGGER
from megatron_ckpt_fixes.testing import run_ranks


def _seen(rank: int, world_size: int) -> dict:
    return {"var": os.environ.get("MCF_TEST_RUN_RANKS_VAR"),
            "gone": os.environ.get("MCF_TEST_RUN_RANKS_GONE"),
            "armed": _after_import.pending().get(TRIGGER, 0)}


def test_each_call_gives_its_ranks_the_callers_environment(monkeypatch):
    monkeypatch.setenv("MCF_TEST_RUN_RANKS_GONE", "set before the fork server started")
    monkeypatch.delenv(ENV, raising=False)
    first = [r.value for r in run_ranks(_seen, 2)]  # starts the fork server (if not yet)
    assert first == [{"var": None, "gone": "set before the fork server started",
                      "armed": 0}] * 2

    monkeypatch.delenv("MCF_TEST_RUN_RANKS_GONE")
    monkeypatch.setenv("MCF_TEST_RUN_RANKS_VAR", "set later")
    monkeypatch.setenv(ENV, "1")  # zero-code activation, read at an interpreter's start-up
    later = [r.value for r in run_ranks(_seen, 2)]
    assert all(v["var"] == "set later" and v["gone"] is None for v in later), later
    assert all(v["armed"] >= 1 for v in later), later  # the hook waits for megatron.core
