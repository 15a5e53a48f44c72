"""Zero-code activation: MEGATRON_CKPT_FIXES at interpreter start-up, and ``run``.

The switch must cost nothing when unset, import nothing heavy in an interpreter that never
uses megatron-core, install exactly the named features once megatron-core is imported, and
fail loudly (at that import) on a bad value. The ``.pth`` that does it must be installed by
the package itself (the CI's editable install included).
"""

from __future__ import annotations

import importlib.metadata
import json
import multiprocessing
import os
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_ckpt_fixes
from megatron_ckpt_fixes import FEATURES
from megatron_ckpt_fixes.activation import (
    ENV,
    ActivationError,
    _reports_here,
    arm,
    parse_features,
)
from megatron_ckpt_fixes.run import main as run_main
from megatron_ckpt_fixes.core.verbosity import VERBOSE_ENV

REPO = Path(__file__).resolve().parents[2]
PTH = "megatron_ckpt_fixes-activation.pth"

PROBE = """
import json, sys
state = {"mcf": "megatron_ckpt_fixes" in sys.modules, "megatron": "megatron" in sys.modules,
         "torch": "torch" in sys.modules,
         "hooks": [type(f).__name__ for f in sys.meta_path if "AfterImport" in str(type(f))]}
if "--import" in sys.argv:
    import megatron.core.dist_checkpointing, megatron_ckpt_fixes
    state["installed"] = sorted(megatron_ckpt_fixes.installed())
    state["described"] = megatron_ckpt_fixes.installed()
    state["loader"] = type(megatron.core.__loader__).__name__
    state["hooks"] = [type(f).__name__ for f in sys.meta_path if "AfterImport" in str(type(f))]
if "--spawn" in sys.argv:  # a child as megatron-core starts its checkpoint worker
    import importlib, multiprocessing
    child = multiprocessing.get_context("spawn").Process(target=importlib.import_module,
                                                         args=("megatron.core",))
    child.start()
    child.join()
    state["child"] = child.exitcode
print(json.dumps(state))
"""


def _python(value: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if value is not None:
        env[ENV] = value
    return subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True,
                          text=True, timeout=120, cwd="/")


def _state(value: str | None, *args: str) -> dict:
    done = _python(value, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_package_installs_its_pth_into_site_packages():
    found = [Path(d) / PTH for d in site.getsitepackages() if (Path(d) / PTH).exists()]
    assert found, f"{PTH} is in none of {site.getsitepackages()}"
    assert found[0].read_text() == (REPO / PTH).read_text()


@pytest.mark.parametrize("value", [None, "", "0", "off"])
def test_unset_or_off_costs_nothing(value):
    assert _state(value) == {"mcf": False, "megatron": False, "torch": False, "hooks": []}


def test_set_in_an_interpreter_that_never_uses_megatron_core():
    assert _state("1") == {"mcf": True, "megatron": False, "torch": False,
                           "hooks": ["AfterImportFinder"]}


def test_set_installs_the_named_features_once_megatron_core_is_imported():
    """... and rank 0 says so in one line on stderr, where a pretrain_gpt.py user sees it
    (logged at INFO only before, which a default run never shows): the release, the count,
    what was not applied. The worker it spawns activates silently."""
    done = _python("structure,writer_failures", "--import", "--spawn")
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads(done.stdout.splitlines()[-1])
    assert state["child"] == 0  # it activated too, and said nothing (one line below)
    assert {name.split(".")[0] for name in state["installed"]} == {"save_call", "structure",
                                                                   "writer_failures"}
    assert state["hooks"] == [] and state["loader"] == "SourceFileLoader"  # nothing left behind
    count = sum(not why.startswith("not applied") for why in state["described"].values())
    line = (f"megatron_ckpt_fixes: activated on megatron-core "
            f"{importlib.metadata.version('megatron-core')} ({ENV}=structure,writer_failures): "
            f"{count} patches")
    (said,) = _activation_lines(done.stderr)
    # writer_failures patches the writer megatron-core has: processes (0.16) or threads (0.19)
    assert re.fullmatch(re.escape(line) + r"( \(not applied: writer_failures\.[\w., ]+: not "
                        r"needed here\))?", said), said


def test_the_probes_leave_no_files_behind(tmp_path):
    """install()'s probes save tiny checkpoints to the temporary folder and remove them at
    once, not at exit: a process that ends with ``os._exit``, as the ones multiprocessing
    forks do (megatron-core's writers, forkserver ranks), runs no exit handlers (before, each
    left its directories behind: thousands a day on a busy node)."""
    code = "import os, megatron_ckpt_fixes as m; m.install(); os._exit(0)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("mcf-")] == []


def _activation_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("megatron_ckpt_fixes: ")]


def test_an_explicit_install_beside_the_switch_does_not_deadlock():
    """install() imports megatron-core to patch it; that import fires the switch's own
    install() in the same thread, inside the first one (with a plain lock it waited forever:
    checked on the code before this test)."""
    done = subprocess.run(
        [sys.executable, "-c", "import megatron_ckpt_fixes as m; m.install(['checksums']); "
         "print(sorted({n.split('.')[0] for n in m.installed()}))"],
        env={**os.environ, ENV: "structure"}, capture_output=True, text=True, timeout=120,
        cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    # both, once each (and the save in progress, which structure reads)
    assert done.stdout.splitlines()[-1] == "['checksums', 'save_call', 'structure']"


def test_old_names_and_the_fixes_alone_are_values_of_the_switch(monkeypatch):
    """``fixes`` is the default features without the speed-ups; a renamed feature's old name
    still selects it (here a name registered as an alias for the test)."""
    from megatron_ckpt_fixes import FEATURES, FIXES, SPEEDUPS
    from megatron_ckpt_fixes.core.features import BY_NAME

    assert parse_features("fixes") == FIXES and not set(FIXES) & set(SPEEDUPS)
    assert set(FEATURES) - set(FIXES) == {"writer_threads", "write_results", "writeback",
                                          "torch_save_frames"}
    monkeypatch.setitem(BY_NAME, "old_structure_name", BY_NAME["structure"])
    assert parse_features("old_structure_name") == ("old_structure_name",)
    assert megatron_ckpt_fixes._known(["old_structure_name", "structure"]) == ["structure"]


def test_a_bad_value_fails_at_the_megatron_core_import_in_one_line():
    """Uncaught, it is one line saying what to set (before: a 15-line import traceback)."""
    done = _python("structure,no-such-feature", "--import")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        f"megatron_ckpt_fixes: error: {ENV}='structure,no-such-feature' names unknown "
        "feature(s) ['no-such-feature']; use 1 (the default features), fixes (the default "
        "fixes without the speed-ups) or a comma-separated list")
    assert done.stderr.endswith("or unset it\n")


def test_a_bad_value_is_still_an_activation_error_to_catch_and_traced_when_verbose():
    code = ("try:\n    import megatron.core\nexcept ValueError as e:\n"
            "    print(type(e).__name__)\n    raise\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, ENV: "nope", VERBOSE_ENV: "1"}, timeout=120,
                          cwd="/")
    assert done.stdout == "ActivationError\n" and done.returncode == 1, done.stderr
    assert "Traceback" in done.stderr
    assert "ActivationError: MEGATRON_CKPT_FIXES='nope'" in done.stderr


@pytest.mark.parametrize("env, reports", [
    ({}, True), ({"RANK": "0"}, True), ({"RANK": "1"}, False), ({"LOCAL_RANK": "3"}, False),
    ({"RANK": "0", "LOCAL_RANK": "3"}, True),
], ids=["no-rank", "rank-0", "rank-1", "local-rank-3", "rank-0-local-3"])
def test_only_rank_0_reports(monkeypatch, env, reports):
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _reports_here() is reports


def test_processes_that_multiprocessing_starts_do_not_report(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    assert not _reports_here()  # importing the parent's main script for a child (forkserver)
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", False)
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    assert not _reports_here()  # a spawned or forkserver child


@pytest.mark.parametrize("value, features", [
    ("1", FEATURES), ("on", FEATURES), ("default", FEATURES),
    ("structure, checksums", ("structure", "checksums")),
    ("default,training.cpu_support", (*FEATURES, "training.cpu_support")),
    ("0", None), ("", None), (None, None), ("false", None),
])
def test_switch_values(value, features):
    assert parse_features(value) == features


@pytest.mark.parametrize("value", ["nope", ",", "structure,nope"])
def test_bad_switch_values(value):
    with pytest.raises(ActivationError) as err:
        parse_features(value)
    assert isinstance(err.value, ValueError)


def test_arm_after_megatron_core_is_imported_installs_at_once(clean_install):
    import megatron.core  # noqa: F401

    arm("structure")
    assert set(clean_install.installed()) and all(
        name.startswith(("structure.", "save_call.")) for name in clean_install.installed())


def test_run_refuses_a_bad_feature_list_before_running_anything(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_main(["--features", "nope", "--", "does_not_exist.py"])
    assert exit_.value.code == 2 and "unknown feature(s) ['nope']" in capsys.readouterr().err


def test_run_runs_a_script_as_main_with_its_arguments_and_directory(tmp_path, monkeypatch):
    """As ``python SCRIPT ARGS`` would: __main__, sys.argv, the script's directory first."""
    script = tmp_path / "job.py"
    script.write_text("import json, os, sys\n"
                      "if __name__ == '__main__':\n"
                      "    print(json.dumps([sys.argv, sys.path[0], os.environ['"
                      f"{ENV}']]))\n")
    done = subprocess.run([sys.executable, "-m", "megatron_ckpt_fixes.run", "--features",
                           "structure", "--", str(script), "--flag", "x"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    argv, path0, switch = json.loads(done.stdout)
    assert argv == [str(script), "--flag", "x"] and path0 == str(tmp_path)
    assert switch == "structure"  # processes the script starts get the same fixes


@pytest.mark.parametrize("command, says", [
    (["--", "missing.py"], "no script 'missing.py' (from /); give the path of the script"),
    (["--", "-m", "no_such_package.job"], "no module 'no_such_package.job' on sys.path"),
    ([], "no script to run: run -- SCRIPT ARGS... or run -- -m MODULE ARGS..."),
], ids=["missing-script", "missing-module", "nothing"])
def test_run_without_something_to_run_is_one_line(command, says):
    """Before: runpy's 11-line traceback for a missing script."""
    done = subprocess.run([sys.executable, "-m", "megatron_ckpt_fixes.run", *command],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("megatron-ckpt-fixes run: error: ") and says in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
