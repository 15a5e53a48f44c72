"""Apply a functional case's own ``AFTER_SCRIPT`` (its log checks) to a job's logs.

Megatron-LM's ``_run_training.sh`` evaluates the case's ``AFTER_SCRIPT`` with ``LOG_DIR``
holding every rank's output (torchrun's ``--log-dir --redirects 3``); its ``check_log``
helpers ``grep -r`` that folder and ``exit 1`` at the first missing line. Here every check
line runs on its own (after the script's helper definitions), unchanged, with ``bash``, so
one failing check does not hide the others.

Some checks of cases that Megatron-LM's CI does not schedule (only
``gpt3_mcore_reruns_persistent_1`` is in its recipes) cannot match the logs of any
Megatron-LM release: :data:`STALE_CHECKS` says why, with the check that matches what
megatron-core logs. A stale check counts as passed when that corrected check passes.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_PERSISTENT = ('check_log -E "ERROR:megatron\\.core\\.rerun_state_machine:Rank [0-9]+, node '
               '([0-9a-z]|\\-)+, device [0-9]+: Possible {} error!!"')
_LOGGED_AS = ("megatron-core logs 'Rank R, node N, device D, iteration #I: Possible {} "
              "error!!' (rerun_state_machine.log_failure, every release here): the pattern "
              "lacks ', iteration #I'; on CPU with the fixes the device is named cpu:D")
_CORRECTED = ('check_log -E "ERROR:megatron\\.core\\.rerun_state_machine:Rank [0-9]+, node '
              '([0-9a-z]|\\-)+, device (cpu:)?[0-9]+, iteration #[0-9]+: Possible {} error!!"')

#: check line -> (why it cannot pass as written, the check that matches megatron-core's log).
STALE_CHECKS: dict[str, tuple[str, str]] = {
    'check_log -F "Setting rerun_state_machine.current_iteration to 0..."': (
        "no Megatron-LM or megatron-core source logs this text; Megatron-LM logs "
        "'Overwriting rerun_state_machine.current_iteration from A to B...', after a load",
        'check_log -F "RerunStateMachine initialized in mode RerunMode.DISABLED"'),
    _PERSISTENT.format("persistent"): (_LOGGED_AS.format("persistent"),
                                       _CORRECTED.format("persistent")),
    _PERSISTENT.format("transient"): (_LOGGED_AS.format("transient"),
                                      _CORRECTED.format("transient")),
}


@dataclass(frozen=True)
class Check:
    line: str
    #: "ok", "failed", "stale" (fails as written, for :data:`STALE_CHECKS`' reason, and its
    #: corrected form passes) or "stale-failed" (the corrected form fails too).
    status: str

    @property
    def passed(self) -> bool:
        return self.status in ("ok", "stale")


@dataclass(frozen=True)
class Checks:
    checks: list[Check]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def __str__(self) -> str:
        counts = {s: sum(c.status == s for c in self.checks)
                  for s in ("ok", "stale", "failed", "stale-failed")}
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no checks"
        failed = [c.line for c in self.checks if not c.passed]
        return (f"{'passed' if self.passed else 'FAILED'} ({summary})"
                + "".join(f"\n    failed: {line}" for line in failed))


def split_script(script: str) -> tuple[str, list[str]]:
    """(the helper definitions and other lines, the check lines)."""
    prelude, checks = [], []
    for line in script.splitlines():
        is_check = line.strip().startswith(("check_log ", "check_log_not "))
        (checks if is_check else prelude).append(line.strip() if is_check else line)
    return "\n".join(prelude), checks


def _passes(prelude: str, line: str, log_dir: Path) -> bool:
    done = subprocess.run(["bash", "-c", f"{prelude}\n{line}"],
                          env={"LOG_DIR": str(log_dir), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120, check=False)
    return done.returncode == 0


def run_checks(script: str, log_dir: Path) -> Checks:
    """Run each check of ``script`` on ``log_dir``."""
    prelude, lines = split_script(script)
    checks = []
    for line in lines:
        if _passes(prelude, line, log_dir):
            status = "ok"
        elif line in STALE_CHECKS:
            corrected = STALE_CHECKS[line][1]
            status = "stale" if _passes(prelude, corrected, log_dir) else "stale-failed"
        else:
            status = "failed"
        checks.append(Check(line, status))
    return Checks(checks)
