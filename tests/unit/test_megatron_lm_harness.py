"""The pure parts of the Megatron-LM case harness (scripts/megatron_lm): flag adaptation,
the per-check AFTER_SCRIPT runner and its stale checks, which processes get the platform."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from optional_systems import require

require("megatron-lm")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "scripts" / "megatron_lm"))
sys.path.insert(0, str(REPO / "scripts" / "megatron_lm" / "rank_env"))

import adapt  # noqa: E402
import after_script  # noqa: E402
import mlm_rank  # noqa: E402
import upstream_snapshots  # noqa: E402
from cases import Case, load_case  # noqa: E402

pytestmark = pytest.mark.varies_with()

PERSISTENT_1 = Case("gpt3_mcore_reruns_persistent_1", "regular", {
    "--bf16": True, "--train-iters": 50, "--eval-iters": 0, "--distributed-backend": "nccl",
    "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 2,
    "--micro-batch-size": 1, "--global-batch-size": 128, "--num-layers": 32,
    "--hidden-size": 3072, "--transformer-impl": "transformer_engine",
    "--use-distributed-optimizer": True, "--overlap-param-gather": True,
    "--save-interval": 10000, "--ckpt-format": "torch_dist", "--async-save": True,
    "--use-persistent-ckpt-worker": True, "--save": "${CHECKPOINT_SAVE_PATH}",
    "--load": "${CHECKPOINT_LOAD_PATH}", "--data-path": "${DATA_PATH}/x",
    "--rerun-mode": "validate_results", "--error-injection-rate": 100,
    "--error-injection-type": "persistent_error"})
PATHS = adapt.Paths(Path("/s"), Path("/l"), Path("/t"))


def _flags(argv: list[str]) -> dict[str, object]:
    flags: dict[str, object] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            flags[arg] = nxt if nxt is not None and not nxt.startswith("--") else True
    return flags


def test_adapt_keeps_checkpoint_fault_and_async_flags_and_names_every_change():
    adapted = adapt.adapt(PERSISTENT_1, PATHS, world_size=2, async_strategy_needed=True,
                          extra={"--ckpt-assume-constant-structure": True})
    flags = _flags(adapted.argv)
    for flag in ("--ckpt-format", "--async-save", "--use-persistent-ckpt-worker",
                 "--rerun-mode", "--error-injection-rate", "--error-injection-type",
                 "--save-interval", "--train-iters", "--bf16"):
        assert str(flags[flag]) == str(PERSISTENT_1.model_args[flag]), flag
    assert flags["--eval-iters"] == "0"  # a zero is a value, not an absent flag
    assert (flags["--save"], flags["--load"]) == ("/s", "/l")
    assert flags["--distributed-backend"] == "gloo"
    assert flags["--async-strategy"] == "mcore"
    assert "--use-distributed-optimizer" not in flags and "--data-path" not in flags
    assert flags["--global-batch-size"] == "4" and adapted.data_parallel_size == 1
    changed = {c.flag for c in adapted.changes}
    assert {flag for flag in flags if flags[flag] != PERSISTENT_1.model_args.get(flag)
            and str(flags[flag]) != str(PERSISTENT_1.model_args.get(flag))} <= changed | {
        "--save", "--load"}
    assert all(c.why for c in adapted.changes)


def test_adapt_refuses_a_world_size_the_parallel_layout_does_not_divide():
    with pytest.raises(ValueError, match="do not divide"):
        adapt.adapt(PERSISTENT_1, PATHS, world_size=3, async_strategy_needed=False)


def _log_dir(tmp_path: Path, text: str) -> Path:
    (tmp_path / "attempt_1").mkdir(parents=True)
    (tmp_path / "attempt_1" / "rank_0.log").write_text(text)
    return tmp_path


SCRIPT = """check_log() { if [[ -z $(grep -r $1 "$2" $LOG_DIR) ]]; then exit 1; else echo OK; fi }
check_log -F "Result validation enabled"
check_log -F "never logged"
""" + after_script._PERSISTENT.format("persistent") + "\nEXIT_CODE=0\n"


def test_every_check_runs_and_a_stale_one_passes_only_in_its_corrected_form(tmp_path):
    log = ("WARNING:megatron.core.rerun_state_machine:Result validation enabled\n"
           "ERROR:megatron.core.rerun_state_machine:Rank 0, node vm, device cpu:1, "
           "iteration #2: Possible persistent error!!\n")
    checks = after_script.run_checks(SCRIPT, _log_dir(tmp_path, log))
    assert [c.status for c in checks.checks] == ["ok", "failed", "stale"]
    assert not checks.passed and "never logged" in str(checks)


def test_a_stale_check_whose_corrected_form_fails_too_fails(tmp_path):
    checks = after_script.run_checks(SCRIPT, _log_dir(tmp_path, "nothing\n"))
    assert checks.checks[2].status == "stale-failed" and not checks.passed


def test_the_stale_checks_reasons_hold_for_every_snapshot():
    """What STALE_CHECKS says about the sources is true of every Megatron-LM snapshot."""
    for ref in upstream_snapshots.TARBALLS:
        tree = upstream_snapshots.snapshot(ref)
        sources = "\n".join(p.read_text(errors="replace")
                            for p in (tree / "megatron").rglob("*.py"))
        assert "Setting rerun_state_machine.current_iteration" not in sources, ref
        machine = (tree / "megatron/core/rerun_state_machine.py").read_text()
        logged = (r'f"Rank \{rank\}, node \{node\}, device \{device\}, "\s*'
                  r'f"iteration #\{self\.current_iteration( \+ 1)?\}: \{message\}!"')
        assert re.search(logged, machine), ref
        cases = {name: load_case(tree, name) for name in (
            "gpt3_mcore_reruns_disable", "gpt3_mcore_reruns_persistent_2",
            "gpt3_mcore_reruns_transient")}
        stale = [line for case in cases.values()
                 for line in after_script.split_script(case.after_script)[1]
                 if line in after_script.STALE_CHECKS]
        assert len(stale) == 3, (ref, stale)


@pytest.mark.parametrize("orig_argv, argv, expected", [
    (["python", "/tree/pretrain_gpt.py", "--x"], ["/tree/pretrain_gpt.py", "--x"], "rank1"),
    (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()",
      "--multiprocessing-fork"], ["-c", "--multiprocessing-fork"], "worker-of-rank1"),
    (["python", "-c", "from multiprocessing.forkserver import main; main(3)"], ["-c"],
     "worker-of-rank1"),
    (["python", "-B", "-c", "from multiprocessing.resource_tracker import main;main(5)"],
     ["-c"], None),
    (["python", "/elsewhere/script.py"], ["/elsewhere/script.py"], None),
])
def test_only_ranks_and_their_checkpoint_workers_get_the_platform(monkeypatch, orig_argv,
                                                                  argv, expected):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(mlm_rank.TREE_ENV, "/tree")
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    monkeypatch.setattr(sys, "argv", argv)
    assert mlm_rank._role() == expected


def test_the_launcher_gets_no_platform(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["/tree/pretrain_gpt.py"])
    assert mlm_rank._role() is None


@pytest.mark.parametrize("name, ref, witness", [
    ("megatron-lite", "dev", "megatron/lite/primitive/ckpt/dcp.py"),
    ("megatron-lite", "pr61", "megatron/lite/primitive/ckpt/dcp.py"),
    ("torcheasyrec", "head", "tzrec/utils/checkpoint_util.py"),
])
def test_the_systems_snapshots_are_found_beside_megatron_lms(name, ref, witness):
    require({"megatron-lite": "mlite", "torcheasyrec": "tzrec"}[name])
    assert (upstream_snapshots.import_root(name, ref) / witness).is_file()


def test_a_missing_systems_snapshot_folder_fails_naming_it(tmp_path, monkeypatch):
    (tmp_path / "megatron-lm").mkdir()
    (tmp_path / "megatron-lm" / "SHA256SUMS").write_text("")
    monkeypatch.setenv(upstream_snapshots.SNAPSHOTS_ENV, str(tmp_path / "megatron-lm"))
    with pytest.raises(upstream_snapshots.SnapshotMissing,
                       match=f"no torcheasyrec snapshots at {tmp_path / 'torcheasyrec'}"):
        upstream_snapshots.import_root("torcheasyrec", "head")
