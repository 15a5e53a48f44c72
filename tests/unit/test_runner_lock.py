"""The runner's lock on --save: one runner per directory; stale locks on this host taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from script_modules import script_module

pytestmark = pytest.mark.varies_with()


@pytest.fixture(scope="module")
def runner():
    with script_module("run_with_restarts") as module:
        yield module


def _write_lock(save: Path, pid: int, host: str, started: float) -> None:
    save.mkdir(parents=True, exist_ok=True)
    (save / ".run_with_restarts.lock").write_text(
        json.dumps({"pid": pid, "host": host, "started": started}))


def test_one_holder_at_a_time(runner, tmp_path):
    lock = runner.SaveLock.acquire(tmp_path / "ckpt")
    holder = json.loads((tmp_path / "ckpt" / runner.LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(runner.LockHeld, match=rf"in use by another run_with_restarts \(pid "
                                              rf"{os.getpid()} on "):
        runner.SaveLock.acquire(tmp_path / "ckpt")
    lock.release()
    assert not (tmp_path / "ckpt" / runner.LOCK_NAME).exists()
    runner.SaveLock.acquire(tmp_path / "ckpt").release()


def test_a_stale_lock_on_this_host_is_taken_over_with_a_log_line(runner, tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(gone.pid).create_time()
    gone.wait()
    _write_lock(tmp_path / "ckpt", gone.pid, socket.gethostname(), started)
    lock = runner.SaveLock.acquire(tmp_path / "ckpt")
    assert f"taking over the stale lock {tmp_path / 'ckpt' / runner.LOCK_NAME} of pid " \
           f"{gone.pid} on" in capsys.readouterr().out
    assert json.loads((tmp_path / "ckpt" / runner.LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_reused_pid_is_not_the_holder(runner, tmp_path):
    """The recorded start time tells a live process that reuses the pid from the holder."""
    _write_lock(tmp_path / "ckpt", os.getpid(), socket.gethostname(), 12345.0)
    runner.SaveLock.acquire(tmp_path / "ckpt").release()


def test_a_live_holder_without_the_flock_is_respected(runner, tmp_path):
    """On a filesystem where flock does not reach the holder, the record still does."""
    me = psutil.Process()
    _write_lock(tmp_path / "ckpt", me.pid, socket.gethostname(), me.create_time())
    with pytest.raises(runner.LockHeld, match="in use by another run_with_restarts"):
        runner.SaveLock.acquire(tmp_path / "ckpt")


def test_a_lock_from_another_host_is_not_taken_over(runner, tmp_path):
    _write_lock(tmp_path / "ckpt", 4242, "some-other-host", 1.0)
    with pytest.raises(runner.LockHeld, match="on another host .*cannot be checked from here; "
                                              "remove .* if that job is gone"):
        runner.SaveLock.acquire(tmp_path / "ckpt")


@pytest.mark.parametrize("args, save", [
    (["--train-iters", "3", "--save", "ck"], Path("ck")),
    (["--save=ck2", "--load", "ck"], Path("ck2")),
    (["--load", "ck"], None),
])
def test_the_save_directory_is_read_from_the_job_arguments(runner, args, save):
    assert runner.save_dir_of(args) == save
