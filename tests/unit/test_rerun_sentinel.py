"""The rerun state machine emits its ShardedObject in steady state, with upstream semantics."""

from __future__ import annotations

import pytest
from megatron.core.dist_checkpointing import ShardedObject
from megatron.core.rerun_state_machine import RerunMode, RerunState, RerunStateMachine

from megatron_ckpt_fixes.fixes.rerun import RERUN_STATE_KEY
from megatron_ckpt_fixes.fixes.rerun.sentinel import upstream_emits_sentinel


def _machine(mode=RerunMode.VALIDATE_RESULTS) -> RerunStateMachine:
    return RerunStateMachine(mode=mode)


def test_install_applies_the_sentinel_exactly_where_upstream_lacks_it(single_rank_group,
                                                                       clean_install):
    """Upstream 0.16/0.17 return None in steady state (the bug); from 0.18 on upstream emits
    the sentinel itself, and install() leaves the state machine alone."""
    upstream = _machine().state_dict(None, "torch_dist")
    lacks = upstream_emits_sentinel() is None
    applied = "rerun.sentinel.state_dict" in clean_install.install()
    assert applied == (upstream is None) == lacks
    if not applied:
        assert upstream["sharded"].key == RERUN_STATE_KEY
        assert clean_install.installed()["rerun.sentinel.state_dict"].startswith("not applied")


def test_upstream_probe_answers_for_upstream_in_a_patched_process(single_rank_group,
                                                                   clean_install):
    """The probe describes plain upstream also after install(): on a release without the
    sentinel, asking the patched machine would answer "upstream emits" (and the scenarios
    and fault tests would expect upstream to keep the fault's rerun state)."""
    plain = upstream_emits_sentinel()
    applied = "rerun.sentinel.state_dict" in clean_install.install(["rerun.sentinel"])
    assert upstream_emits_sentinel() == plain
    assert applied == (plain is None)


def test_sentinel_is_emitted_in_steady_state(single_rank_group, clean_install):
    clean_install.install(["rerun.sentinel"])
    sd = _machine().state_dict(None, "torch_dist")
    assert isinstance(sd["sharded"], ShardedObject)
    assert sd["sharded"].key == RERUN_STATE_KEY
    assert (sd["sharded"].global_shape, sd["sharded"].global_offset) == ((1,), (0,))
    assert sd["state"] == RerunState.NOT_RUNNING_YET
    assert sd["sharded"].data["data_iterator_checkpoints"] is None


def test_sentinel_has_the_fault_checkpoint_structure(single_rank_group, clean_install):
    clean_install.install(["rerun.sentinel"])
    steady = _machine()
    faulted = _machine()
    faulted.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
    a, b = steady.state_dict(None, "torch_dist"), faulted.state_dict(None, "torch_dist")
    assert a.keys() == b.keys() and a["sharded"].data.keys() == b["sharded"].data.keys()
    assert a["sharded"].unique_key == b["sharded"].unique_key


def test_disabled_mode_and_other_formats_still_return_none(single_rank_group, clean_install):
    clean_install.install(["rerun.sentinel"])
    assert _machine(RerunMode.DISABLED).state_dict(None, "torch_dist") is None
    assert _machine().state_dict(None, "torch") is None


def test_force_builds_the_load_template_unchanged(single_rank_group, clean_install):
    upstream = _machine().state_dict(None, "torch_dist", force=True)
    clean_install.install(["rerun.sentinel"])
    patched = _machine().state_dict(None, "torch_dist", force=True)
    assert patched["sharded"].unique_key == upstream["sharded"].unique_key
    assert patched["sharded"].data == upstream["sharded"].data


def test_sentinel_loads_as_a_no_op(single_rank_group, clean_install):
    clean_install.install(["rerun.sentinel"])
    sd = _machine().state_dict(None, "torch_dist")
    sd["sharded"] = sd["sharded"].data
    assert _machine().validate_state_dict(sd) is False


def _report_determinism_stats() -> None:
    from megatron.core.rerun_state_machine import Caller

    machine = _machine(RerunMode.REPORT_DETERMINISM_STATS)
    machine.current_iteration = 0  # a reporting iteration
    machine.stats[Caller(message="loss", rank=0)].record(1.5)
    machine._maybe_report_stats()


def test_upstream_determinism_report_crashes_where_the_fix_applies(single_rank_group,
                                                                   clean_install):
    """Upstream 0.16 reads Caller.filename, which Caller does not have (0.19 reports by
    message, and then install() leaves Caller alone)."""
    applied = "rerun.stats_report.filename" in clean_install.install(["rerun.stats_report"])
    clean_install.uninstall()
    if not applied:
        _report_determinism_stats()
        return
    with pytest.raises(AttributeError, match="filename"):
        _report_determinism_stats()


def test_determinism_report_runs(single_rank_group, clean_install, caplog):
    clean_install.install(["rerun.stats_report"])
    with caplog.at_level("INFO", logger="megatron.core.rerun_state_machine"):
        _report_determinism_stats()
    assert "validation call 'loss'" in caplog.text or "'loss'" in caplog.text
