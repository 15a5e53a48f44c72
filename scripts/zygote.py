"""A preloaded launcher: one interpreter (per test worker) imports a job's modules once and
forks the runner of each job (``run_with_restarts.py --fork-ranks``), whose ranks are forks
of it in turn (``forked_start.py``).

A training-script rank spends most of its CPU importing torch and megatron-core (about 4.5 s
of a short job's 6), and the tests start about a hundred such ranks per run on a 2-core
machine. Forked, the runner and its ranks are still processes of their own: their own
session, environment (the job's, in full), output file and exit code; signals, SIGKILL
mid-save and relaunches are the real thing. What a fork cannot show is an interpreter's
start-up itself: the tests of the activation switch's start-up and of the launchers
(test_zero_code_activation, test_runner) and of what a rank prints while importing
megatron-core (``fresh=True`` in ``tests/functional/training_runs.run_job``) start new interpreters.

Protocol (the server is this file run as a script, on pipes): one JSON request per line
(``script``, ``args``, ``env``, ``cwd``, ``output``), answered by ``{"pid": N}`` when the
runner is forked and ``{"exit_code": C}`` when it ends; the server ends when its input does
(its test worker ended).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import forked_start

HERE = Path(__file__).resolve().parent
#: How long a runner has to end after SIGTERM on a timeout (it stops and reaps its ranks).
STOP_GRACE_S = 120




def startup_variables(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What an interpreter's start-up reads besides the activation switch (``PYTHON*``: the
    path, hence ``sitecustomize``): a job can run forked from a launcher only if its own are
    the launcher's."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith("PYTHON")))


class ZygoteError(RuntimeError):
    """The preloaded launcher died or answered nonsense."""


class Zygote:
    """The client: a server started with ``startup_env`` that imported ``preload``."""

    def __init__(self, startup_env: dict[str, str], preload: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *preload], env=startup_env, cwd=HERE,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._pending = b""  # read from the server, not yet answered
        atexit.register(self.close)

    def _answer(self, deadline: float | None) -> dict | None:
        """The server's next line; None if the deadline passed first. Read from the pipe's
        descriptor into a buffer of our own: a buffered reader can hold both of a short
        job's answers after its first line, where ``select`` would then wait for a second
        line that already came."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise ZygoteError(f"the preloaded launcher ended ({self.proc.wait()})")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def run(self, script: Path, args: list[str], env: dict[str, str], cwd: Path,
            output: Path, timeout: float) -> int:
        """Run ``script args`` forked with ``env`` in ``cwd``, its output to ``output``; its
        exit code. Past ``timeout`` it is stopped (SIGTERM: a runner stops and reaps its
        ranks) and :class:`subprocess.TimeoutExpired` raised, as ``subprocess.run`` would."""
        request = {"script": str(script), "args": args, "env": env, "cwd": str(cwd),
                   "output": str(output)}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        pid = self._answer(None)["pid"]
        answer = self._answer(time.monotonic() + timeout)
        if answer is None:
            os.kill(pid, signal.SIGTERM)
            self._answer(time.monotonic() + STOP_GRACE_S)
            raise subprocess.TimeoutExpired([str(script), *args], timeout)
        return answer["exit_code"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


#: This process's launchers, by start-up variables and preload.
_launchers: dict[tuple, Zygote] = {}


def for_environment(env: dict[str, str], preload: list[str]) -> Zygote:
    """The launcher (started on first use) whose start-up variables are ``env``'s."""
    key = (startup_variables(env), tuple(preload))
    if key not in _launchers:
        # the activation switch is the job's: its ranks arm it themselves (forked_start)
        _launchers[key] = Zygote({k: v for k, v in env.items()
                                  if k != forked_start.ACTIVATION_ENV}, preload)
    return _launchers[key]


def _preload(entries: list[str]) -> None:
    """Import each ``module``; ``module:function`` also calls ``function()``. A module that
    does not import here (not installed; or it needs what a rank sets up first) is left to
    the ranks, as multiprocessing's forkserver leaves it."""
    for entry in entries:
        module, _, function = entry.partition(":")
        try:
            imported = importlib.import_module(module)
        except ImportError as exc:
            print(f"zygote: not preloading {module}: {exc}", file=sys.stderr, flush=True)
            continue
        if function:
            getattr(imported, function)()


def serve(preload: list[str]) -> None:
    _preload(preload)
    for line in sys.stdin:
        request = json.loads(line)
        out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pid = forked_start.fork_script(Path(request["script"]), request["args"],
                                           request["env"], output=out, cwd=request["cwd"],
                                           startup=False)
        finally:
            os.close(out)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit_code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1:])
