"""The rerun state machine's exit 16, bounded per fault and checkpoint; every other answer kept.

The relaunches of a real job (exit codes 16, 16, 17 on the same device; upstream's endless
16s): tests/functional/test_train_fault.py. Here the machine itself, in one process whose
"relaunches" are separate calls: the count is in the record beside the checkpoint, not in
the process (the trivial wrong fix, a counter in memory, never counts a relaunch: each is a
new process).
"""

from __future__ import annotations

import json

import pytest

from megatron_ckpt_fixes.fixes.rerun import relaunch_bound

pytestmark = pytest.mark.varies_with("megatron-core")


def _machine(state: str, message: str = "found NaN in local forward loss calculation"):
    from megatron.core.rerun_state_machine import (
        Call,
        Caller,
        RerunMode,
        RerunState,
        RerunStateMachine,
    )

    machine = RerunStateMachine(mode=RerunMode.VALIDATE_RESULTS)
    machine.state = RerunState[state]
    machine.current_iteration = 4
    machine.failed_validation_call = Call(Caller(message, 0), 1)
    return machine


def _relaunch(checkpoint, state: str = "RERUNNING_AGAIN_FROM_CHECKPOINT", **fault):
    """A new process that resumed from ``checkpoint`` and reached the fault again."""
    relaunch_bound._resumed = None
    relaunch_bound.note_loaded(checkpoint)
    return _machine(state, **fault).should_checkpoint_and_exit()


@pytest.fixture
def patched(single_rank_group, clean_install, tmp_path, monkeypatch):
    monkeypatch.delenv(relaunch_bound.LIMIT_ENV, raising=False)
    monkeypatch.setattr(relaunch_bound, "_resumed", None)
    clean_install.install(["rerun.transient_fault"])
    ckpt = tmp_path / "ckpt" / "iter_0000004"
    ckpt.mkdir(parents=True)
    return ckpt


def test_the_same_fault_from_the_same_checkpoint_is_relaunched_three_times(patched, caplog):
    answers = [_relaunch(patched) for _ in range(5)]
    assert answers == [(False, True, 16)] * 3 + [(False, True, 17)] * 2
    record = json.loads((patched.parent / relaunch_bound.RECORD).read_text())
    assert record == {"iter_0000004 | iteration 4 | found NaN in local forward loss "
                      "calculation (check #1)": 5}
    gave_up = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(gave_up) == 2 and "came back 4 times" in gave_up[0]


def test_the_fault_checkpoints_own_request_is_counted_too(patched, monkeypatch):
    """WILL_RERUN_FROM_CHECKPOINT (the in-place rerun reproduced the fault: checkpoint, exit
    16); once over the bound: exit 17 and no checkpoint (the one resumed from reproduces it)."""
    monkeypatch.setenv(relaunch_bound.LIMIT_ENV, "1")
    state = "WILL_RERUN_FROM_CHECKPOINT"
    assert _relaunch(patched, state) == (True, True, 16)
    assert _relaunch(patched, state) == (False, True, 17)


def test_each_fault_and_checkpoint_is_counted_apart(patched, monkeypatch):
    monkeypatch.setenv(relaunch_bound.LIMIT_ENV, "1")
    other = patched.parent / "iter_0000002"
    other.mkdir()
    assert _relaunch(patched) == (False, True, 16)
    assert _relaunch(other) == (False, True, 16)
    assert _relaunch(patched, message="found Inf in local forward loss calculation") == \
        (False, True, 16)
    assert _relaunch(patched) == (False, True, 17)


def test_no_checkpoint_resumed_or_no_record_keeps_upstreams_answer(patched, caplog):
    relaunch_bound._resumed = None
    assert [_machine("RERUNNING_AGAIN_FROM_CHECKPOINT").should_checkpoint_and_exit()
            for _ in range(5)] == [(False, True, 16)] * 5
    (patched.parent / relaunch_bound.RECORD).mkdir()  # cannot be written
    assert [_relaunch(patched) for _ in range(5)] == [(False, True, 16)] * 5
    assert any("cannot count this relaunch" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("state, answer", [("RERUNNING_FROM_CHECKPOINT", (False, True, 17)),
                                           ("NOT_RUNNING_YET", (False, False, 0))])
def test_other_answers_are_upstreams(patched, state, answer):
    assert [_relaunch(patched, state) for _ in range(5)] == [answer] * 5
    assert not (patched.parent / relaunch_bound.RECORD).exists()


@pytest.mark.parametrize("value, expected", [("0", 0), ("7", 7), ("-1", 3), ("many", 3)])
def test_the_limit(monkeypatch, value, expected):
    monkeypatch.setenv(relaunch_bound.LIMIT_ENV, value)
    assert relaunch_bound.limit() == expected
