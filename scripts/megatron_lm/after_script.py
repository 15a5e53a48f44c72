"""Apply a functional case's own ``AFTER_SCRIPT`` (its log checks) to a job's logs.

Megatron-LM's ``_run_training.sh`` evaluates the case's ``AFTER_SCRIPT`` with ``LOG_DIR``
holding every rank's output (torchrun's ``--log-dir --redirects 3``); its ``check_log``
helpers ``grep -r`` that folder and ``exit 1`` on the first missing line. The script runs
here unchanged, with ``bash``, on the job's log folder.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Checks:
    passed: bool
    #: the script's own output (an ``OK`` per passed check) and, on failure, the last check.
    output: str
    count: int

    def __str__(self) -> str:
        return (f"{'passed' if self.passed else 'FAILED'} ({self.count} check(s)): "
                f"{' '.join(self.output.split())}")


def check_lines(script: str) -> list[str]:
    """The script's ``check_log``/``check_log_not`` calls, one per line."""
    return [line.strip() for line in script.splitlines()
            if line.strip().startswith(("check_log ", "check_log_not "))]


def run_checks(script: str, log_dir: Path) -> Checks:
    """Run ``script`` with ``LOG_DIR=log_dir``; passed when it exits 0."""
    done = subprocess.run(["bash", "-c", script], env={"LOG_DIR": str(log_dir),
                                                       "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120, check=False)
    lines = check_lines(script)
    output = done.stdout.strip()
    if done.returncode != 0:
        failed = lines[output.count("OK")] if output.count("OK") < len(lines) else "?"
        output += f" | failed: {failed}"
    return Checks(done.returncode == 0, output, len(lines))
