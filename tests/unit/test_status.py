"""What the tools print: upstream's warnings only when asked, ``installed()`` readably.

Before: every scripts/train.py rank printed 12 to 34 lines of megatron-core's import-time
warnings before the job's one-line error, and ``print(installed())`` was one line of 7,912
characters. The filter must hide upstream's warnings only, never the package's own.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import warnings

import pytest

from megatron_ckpt_fixes import __version__
from megatron_ckpt_fixes.activation import ENV
from megatron_ckpt_fixes.tools.cli import main as cli_main
from megatron_ckpt_fixes.tools.status import activation_line, not_applied, report
from megatron_ckpt_fixes.core.verbosity import VERBOSE_ENV, hide_upstream_warnings, quiet_unless

MCORE = f"megatron-core {importlib.metadata.version('megatron-core')}"

#: installed() as it reads: applied patches with why, the others with why not.
INSTALLED = {
    "structure.cached_save.plan.save": "cached save plans are reused only while every rank's "
                                       "structure signature holds",
    "structure.integrity.validate_sharding_integrity": "sharding is validated by all ranks",
    "writer_failures.processes.mp": "the forked checkpoint writers are watched",
    "writer_failures.threads.collection": "not applied: not needed: megatron-core's file "
                                          "writer writes with processes",
    "dtensor.mlite.dcp": "not applied: megatron.lite is not installed",
    "dtensor.mlite.empty_dcp_tensor_like_param": "not applied: megatron.lite is not installed",
    "reshard.tzrec.restore_model": "not applied: tzrec is not installed",
    "dtensor.nemo_automodel.gemma4_gather": "waiting: applied when nemo_automodel is first "
                                            "imported",
}


def _shown(module: str, message: str = "note", category: type = UserWarning) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        hide_upstream_warnings()
        warnings.warn_explicit(message, category, "x.py", 1, module=module)
    return [str(w.message) for w in seen]


@pytest.mark.parametrize("module, hidden", [
    ("megatron.core.optimizer", True), ("megatron.core", True),
    ("megatron_fsdp.mixed_precision", True), ("transformer_engine.pytorch", True),
    ("megatron_ckpt_fixes._dev.training.loop", False), ("megatron.training.arguments", False),
    ("torch.distributed.checkpoint", False), ("megatron_core_other", False),
])
def test_only_upstreams_warnings_are_hidden(module, hidden):
    assert _shown(module) == ([] if hidden else ["note"])


def test_torchs_sharded_tensor_deprecation_that_every_resume_repeats_is_hidden():
    deprecated = "Please use DTensor instead and we are deprecating ShardedTensor."
    module = "torch.distributed.checkpoint.planner_helpers"
    assert _shown(module, deprecated, FutureWarning) == []
    assert _shown(module, "another deprecation", FutureWarning) == ["another deprecation"]


@pytest.mark.parametrize("flag, env, verbose", [
    (False, None, False), (True, None, True), (False, "1", True), (False, "0", False),
])
def test_verbose_flag_or_variable_keeps_them(monkeypatch, flag, env, verbose):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(VERBOSE_ENV, env)
    with warnings.catch_warnings():
        before = list(warnings.filters)
        assert quiet_unless(flag) is verbose
        assert (warnings.filters == before) is verbose


def test_not_applied_in_a_few_words_per_feature():
    assert not_applied(INSTALLED) == {
        "not needed here": ["writer_failures.threads.collection"],
        "system not installed": ["dtensor.mlite", "reshard.tzrec"],
        "waiting for nemo_automodel": ["dtensor.nemo_automodel"]}


def test_the_activation_line():
    assert activation_line(INSTALLED, "megatron.core", f"{ENV}=1") == (
        f"megatron_ckpt_fixes: activated on {MCORE} ({ENV}=1): 3 patches (not applied: "
        "writer_failures.threads.collection: not needed here; dtensor.mlite, reshard.tzrec: "
        "system not installed; dtensor.nemo_automodel: waiting for nemo_automodel)")


def test_the_status_report_per_feature():
    lines = report(INSTALLED, "default")
    assert lines[0].startswith(f"megatron-ckpt-fixes {__version__} on {MCORE}, torch ")
    assert lines[1:] == [
        "applied: 3 patches",
        "  structure (2): cached_save.plan.save, integrity.validate_sharding_integrity",
        "  writer_failures (1): processes.mp",
        "not applied: 5 patches",
        "  writer_failures.threads.collection: not needed: megatron-core's file writer writes "
        "with processes",
        "  dtensor.mlite (2): megatron.lite is not installed",
        "  reshard.tzrec (1): tzrec is not installed",
        "  dtensor.nemo_automodel (1): waiting: applied when nemo_automodel is first imported",
        "each patch and why: megatron-ckpt-fixes status --all"]
    every = report(INSTALLED, "default", every_patch=True)
    assert every[-len(INSTALLED):] == [f"  {name}: {why}" for name, why in INSTALLED.items()]


def test_status_installs_here_and_reports(clean_install, capsys, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert cli_main(["status", "--features", "structure"]) == 0
    out = capsys.readouterr().out.splitlines()
    count = len(clean_install.installed())
    assert out[0].endswith("; features: structure (--features)")
    assert out[1] == f"applied: {count} patches"
    assert out[2] == "  save_call (1): save"  # the save in progress, which structure reads
    assert out[3].startswith(f"  structure ({count - 1}): cached_save.")
    assert cli_main(["status", "--features", "nope"]) == 2
    assert "unknown feature(s) ['nope']" in capsys.readouterr().err


def test_python_m_package_is_status_of_the_switch_without_upstream_warnings():
    done = subprocess.run([sys.executable, "-m", "megatron_ckpt_fixes"], capture_output=True,
                          env={**os.environ, ENV: "rerun.sentinel"}, text=True, timeout=120,
                          cwd="/")
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].endswith(f"; features: rerun.sentinel ({ENV})")
    assert lines[-1] == "each patch and why: megatron-ckpt-fixes status --all"
