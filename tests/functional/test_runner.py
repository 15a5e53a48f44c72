"""run_with_restarts behaves like a launcher: it never leaves a job behind.

Before, SIGINT/SIGTERM killed only the runner: the ranks (each in its own session) were
reparented to init and kept training and saving into --save, and a second runner on the same
--save started a second job writing the same directory.
"""

from __future__ import annotations

import pytest

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

pytestmark = pytest.mark.varies_with("torch", "python")

REPO = Path(__file__).resolve().parents[2]
RUNNER = REPO / "scripts" / "run_with_restarts.py"
#: A job that would run for hours: only a signal ends it (no checkpoint is ever written).
ENDLESS = ["--train-iters", "1000000", "--tensor-model-parallel-size", "2"]
TIMEOUT_S = 180


def _start(tmp_path: Path, name: str, grace_s: float) -> tuple[subprocess.Popen, Path]:
    """A runner in its own session, as in a terminal of its own: a signal to its process
    group reaches the runner, not its ranks (which run in sessions of their own)."""
    out = tmp_path / f"{name}.out"
    cmd = [sys.executable, str(RUNNER), "--nproc-per-node", "2", "--max-restarts", "0",
           "--grace-seconds", str(grace_s), "--report", str(tmp_path / f"{name}.json"), "--",
           *ENDLESS, "--save", str(tmp_path / "ckpt")]
    with open(out, "w") as f:
        runner = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"},
                                  start_new_session=True)
    return runner, out


def _wait_for_training(runner: subprocess.Popen, out: Path) -> list[psutil.Process]:
    """Wait until the ranks train (rank 0 logged a step); returns the ranks."""
    deadline = time.monotonic() + TIMEOUT_S
    while "iteration        1/" not in out.read_text():
        assert runner.poll() is None, out.read_text()[-4000:]
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.5)
    ranks = psutil.Process(runner.pid).children()
    assert len(ranks) == 2, ranks
    return ranks


def _job_processes(ranks: list[psutil.Process]) -> list[int]:
    """Every live process in the ranks' sessions (the ranks and what they started)."""
    sessions = {r.pid for r in ranks}
    alive = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getsid(proc.pid) in sessions and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


def _finish(runner: subprocess.Popen, out: Path) -> int:
    try:
        return runner.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(runner.pid, signal.SIGKILL)
        raise AssertionError(f"the runner did not exit:\n{out.read_text()[-4000:]}") from None


def test_sigterm_is_forwarded_then_sigkill_and_the_lock_refuses_a_second_runner(tmp_path):
    runner, out = _start(tmp_path, "first", grace_s=3)
    try:
        ranks = _wait_for_training(runner, out)
        lock = json.loads((tmp_path / "ckpt" / ".run_with_restarts.lock").read_text())
        assert lock["pid"] == runner.pid

        second = subprocess.run(
            [sys.executable, str(RUNNER), "--nproc-per-node", "2", "--", "--train-iters", "1",
             "--save", str(tmp_path / "ckpt")],
            cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert second.returncode == 1, second.stdout + second.stderr
        assert (f"{tmp_path / 'ckpt'} is in use by another run_with_restarts (pid "
                f"{runner.pid} on ") in second.stdout
        assert "launching" not in second.stdout  # it started nothing
        assert runner.poll() is None and all(r.is_running() for r in ranks)

        ranks[1].suspend()  # a rank that cannot act on SIGTERM: SIGKILL after the grace
        os.kill(runner.pid, signal.SIGTERM)
        code = _finish(runner, out)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
    report = json.loads((tmp_path / "first.json").read_text())
    assert code == 128 + signal.SIGTERM, out.read_text()[-4000:]
    assert report[-1]["rank_codes"] == [128 + signal.SIGTERM, 128 + signal.SIGKILL], report
    assert report[-1]["stopped_by"] == "SIGTERM" and len(report) == 1  # no relaunch
    assert "received SIGTERM: forwarding it to 2 rank(s); SIGKILL in 3s" in out.read_text()
    assert _job_processes(ranks) == []
    assert not (tmp_path / "ckpt" / ".run_with_restarts.lock").exists()


def test_ctrl_c_reaches_every_rank(tmp_path):
    runner, out = _start(tmp_path, "ctrl_c", grace_s=60)
    try:
        ranks = _wait_for_training(runner, out)
        os.killpg(runner.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        code = _finish(runner, out)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
    report = json.loads((tmp_path / "ctrl_c.json").read_text())
    assert code == 128 + signal.SIGINT, out.read_text()[-4000:]
    # Each rank got the SIGINT itself (KeyboardInterrupt), long before the SIGKILL was due.
    assert report[-1]["rank_codes"] == [128 + signal.SIGINT] * 2, report
    assert _job_processes(ranks) == []
