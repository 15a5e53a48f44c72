#!/usr/bin/env python
"""Relaunch a training job when it exits asking to be resumed (code 16), like a scheduler.

    python scripts/run_with_restarts.py --nproc-per-node 2 --max-restarts 3 -- \
        --tensor-model-parallel-size 2 --train-iters 20 --save ckpt --load ckpt ...

Everything after ``--`` goes to ``scripts/train.py`` (or to ``--script``, e.g. Megatron-LM's
own ``pretrain_gpt.py``). The ranks are started the way a cluster
scheduler (srun) starts them: one process per rank with torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the job's real exit code is seen
(torchrun reports any failing worker as 1). A rank that dies takes the job down: the other
ranks are stopped after ``--grace-seconds`` (SIGTERM, then SIGKILL), and whatever processes
the ranks left behind are killed at the end of each attempt. The job's exit code is the code
every rank exited with, else the first failure's (128 + signal for a rank killed by one).

Like a launcher, the runner never leaves a job behind: SIGINT (Ctrl-C) and SIGTERM are
forwarded to every rank and what it started (each rank runs in its own session, so a
terminal's Ctrl-C reaches only the runner); ranks still running ``--grace-seconds`` later
get SIGKILL (a second signal sends it at once); the runner exits, with 128 + the signal's
number, only once no process of the job is left, and relaunches nothing after a signal.

Two runners must never write one ``--save`` directory: the runner holds an exclusive lock,
``<save>/.run_with_restarts.lock`` (``flock``, released by the kernel however the runner
ends; the file names the holder's pid, host and start time). A second runner on the same
directory refuses to start (exit code 1). A lock left by a runner on this host that is no
longer running is taken over, with a log line; one left by another host is not, since its
holder cannot be checked from here.

Exit code 16 (resume to disambiguate) is relaunched up to ``--max-restarts`` times; 0 (done),
17 (failed validation) and anything else end the run. Each attempt runs on a fresh rendezvous
port and, on CPU, on a new placement (``MCF_CPU_DEVICE_INDEX`` = attempt number), so that the
rerun state machine sees the relaunch on "another device", as a scheduler that excludes the
suspicious node would place it; ``--same-device`` keeps the placement.

With ``--fork-ranks`` each rank is a fork of the runner that runs the script as a new
interpreter would (``forked_start.py``): for a runner forked from a process that already
imported the training's modules (the tests' preloaded launcher), each rank skips those
imports. The ranks still run in their own sessions, with their own environment and exit codes.

With ``--log-dir DIR`` each rank's output (stdout and stderr) of attempt N goes to
``DIR/attempt_N/rank_K.log`` instead of the runner's output, as torchrun's ``--log-dir
--redirects 3`` keeps it; the runner's own lines still go to its output.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import forked_start  # noqa: E402

TRAIN = Path(__file__).resolve().parent / "train.py"
RESUME_TO_DISAMBIGUATE = 16
MEANING = {0: "done", 16: "resume to disambiguate", 17: "failed result validation"}
LOCK_NAME = ".run_with_restarts.lock"
LOCKED = 1  # exit code of a runner that refused to start
#: How long the runner waits for the processes a job left behind to go after SIGKILL.
REAP_TIMEOUT_S = 30.0


def log(message: str) -> None:
    print(f"[run_with_restarts] {message}", flush=True)


@dataclass
class Attempt:
    attempt: int
    exit_code: int
    rank_codes: list[int]
    seconds: float
    stopped_by: str | None = None  # the signal that stopped the job, if one did


# -- the lock on --save ---------------------------------------------------------------------

@dataclass(frozen=True)
class Holder:
    """Who holds a lock: enough to tell, on its host, whether it still runs."""

    pid: int
    host: str
    started: float  # the process's start time (a reused pid has another)

    @classmethod
    def me(cls) -> Holder:
        return cls(os.getpid(), socket.gethostname(), psutil.Process().create_time())

    def running(self) -> bool:
        """Whether the holder still runs (only answerable on its own host)."""
        try:
            return abs(psutil.Process(self.pid).create_time() - self.started) < 1.0
        except psutil.NoSuchProcess:
            return False

    def __str__(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host} (running since {since})"


class LockHeld(Exception):
    """Another runner holds (or may hold) the lock."""


class SaveLock:
    """An exclusive lock on one ``--save`` directory for the runner's whole life."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @staticmethod
    def _holder(fd: int) -> Holder | None:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 4096).decode(errors="replace")
        try:
            return Holder(**json.loads(text))
        except (ValueError, TypeError):
            return None  # empty (being written) or not ours

    @classmethod
    def acquire(cls, save_dir: Path) -> SaveLock:
        """Take the lock or raise :class:`LockHeld` saying who has it."""
        save_dir.mkdir(parents=True, exist_ok=True)
        path = save_dir / LOCK_NAME
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                holder = cls._holder(fd)
                os.close(fd)
                raise LockHeld(f"{save_dir} is in use by another run_with_restarts "
                               f"({holder or 'holder unknown'}); refusing to start") from None
            try:
                same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same_file = False
            if not same_file:  # the previous holder removed it while we waited: retry
                os.close(fd)
                continue
            previous = cls._holder(fd)
            if previous is not None and previous.host != socket.gethostname():
                os.close(fd)
                raise LockHeld(f"{save_dir} was locked by a run_with_restarts on another host "
                               f"({previous}), which cannot be checked from here; remove "
                               f"{path} if that job is gone")
            if previous is not None and previous.running():
                os.close(fd)  # alive but without the flock (a filesystem without flock)
                raise LockHeld(f"{save_dir} is in use by another run_with_restarts "
                               f"({previous}); refusing to start")
            if previous is not None:
                log(f"taking over the stale lock {path} of {previous}: it is no longer "
                    "running")
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(asdict(Holder.me())).encode(), 0)
            os.fsync(fd)
            return cls(path, fd)

    def release(self) -> None:
        try:
            os.unlink(self.path)  # while still holding the flock (see the inode check)
        finally:
            os.close(self.fd)


def save_dir_of(train_args: list[str]) -> Path | None:
    """The job's ``--save`` directory, if it has one."""
    for i, arg in enumerate(train_args):
        if arg == "--save" and i + 1 < len(train_args):
            return Path(train_args[i + 1])
        if arg.startswith("--save="):
            return Path(arg.split("=", 1)[1])
    return None


# -- signals --------------------------------------------------------------------------------

class StopSignals:
    """Records SIGINT/SIGTERM sent to the runner; the launch loop forwards them."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self.received.append(signum)

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None


# -- one attempt ----------------------------------------------------------------------------

#: Where Linux takes the source ports of outgoing connections when the system does not say.
EPHEMERAL_LOW = 32768
#: How many ports below the ephemeral range :func:`free_port` draws from.
PORT_SPAN = 12000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_LOW


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port for the job's store, free now, drawn below the kernel's ephemeral range.

    A port that ``bind(0)`` hands out lies in the ephemeral range, where every outgoing
    connection on the host also takes its source port (the gloo connections and store clients
    of other jobs): between this check and rank 0's store binding it, another process may take
    it, and the job dies with EADDRINUSE. Below the range a port is only taken by a listener
    that asks for it. ``bind(0)`` where no such port is free."""
    low = _ephemeral_low()
    first = max(1024, low - PORT_SPAN)
    draw = random.Random(os.getpid() ^ time.time_ns())
    for port in draw.sample(range(first, low), min(64, low - first)):
        if _bindable(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ForkedRank:
    """A rank forked by this runner (``--fork-ranks``), polled like a ``subprocess.Popen``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _start_rank(script: Path, train_args: list[str], env: dict[str, str],
                output: int | None, fork: bool) -> subprocess.Popen | ForkedRank:
    """One rank in its own session (so the job's leftovers can be cleaned up: _reap)."""
    if fork:
        return ForkedRank(forked_start.fork_script(script, train_args, env, output=output))
    return subprocess.Popen([sys.executable, str(script), *train_args], env=env,
                            start_new_session=True, stdout=output,
                            stderr=None if output is None else subprocess.STDOUT)


def _code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # -9 -> 137, like a shell


def _signal_group(proc: subprocess.Popen | ForkedRank, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the rank's session: the rank and what it started
    except ProcessLookupError:
        pass


def _left_in(groups: set[int]) -> list[int]:
    """Processes (not zombies) still in the ranks' process groups."""
    left = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) in groups and proc.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return left


def _reap(procs: list[subprocess.Popen | ForkedRank]) -> None:
    """Kill what the ranks left behind and wait until it is gone (a rank killed mid-save
    orphans the Manager process of megatron's async writer)."""
    groups = {p.pid for p in procs}
    deadline = time.monotonic() + REAP_TIMEOUT_S
    while left := _left_in(groups):
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            log(f"processes {left} of the job did not go after SIGKILL")
            return
        time.sleep(0.1)


def _rank_output(log_dir: Path | None, attempt: int, rank: int) -> int | None:
    """Where rank ``rank`` of ``attempt`` writes (None: the runner's own output)."""
    if log_dir is None:
        return None
    folder = log_dir / f"attempt_{attempt}"
    folder.mkdir(parents=True, exist_ok=True)
    return os.open(folder / f"rank_{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def launch(nproc: int, train_args: list[str], attempt: int, same_device: bool,
           grace_s: float, stop: StopSignals, script: Path = TRAIN,
           log_dir: Path | None = None, fork: bool = False) -> Attempt:
    """Start one process per rank and wait until none is left; a failing rank or a stop
    signal takes the others down (the signal, SIGTERM after a failure; SIGKILL after
    ``grace_s``)."""
    port = free_port()
    start = time.monotonic()
    procs: list[subprocess.Popen | ForkedRank] = []
    for rank in range(nproc):
        if stop.first is not None:
            break
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", "1")
        if not same_device:
            env["MCF_CPU_DEVICE_INDEX"] = str(attempt - 1)
        output = _rank_output(log_dir, attempt, rank)
        try:
            procs.append(_start_rank(script, train_args, env, output, fork))
        finally:
            if output is not None:
                os.close(output)
    ended: list[subprocess.Popen | ForkedRank] = []  # in the order the ranks ended
    plan: list[tuple[float, int]] = []  # signals still to send to running ranks: (when, sig)
    handled = 0  # stop signals acted on
    failure_seen = False
    while len(ended) < len(procs):
        ended += [p for p in procs if p not in ended and p.poll() is not None]
        running = [p for p in procs if p.poll() is None]
        now = time.monotonic()
        while handled < len(stop.received):
            sig = stop.received[handled]
            handled += 1
            if handled == 1:
                log(f"received {signal.Signals(sig).name}: forwarding it to {len(running)} "
                    f"rank(s); SIGKILL in {grace_s:g}s")
                for p in running:
                    _signal_group(p, sig)
                plan = [(now + grace_s, signal.SIGKILL)]
            else:  # a second signal: no more grace
                plan = [(now, signal.SIGKILL)]
        failed = any(p.returncode not in (0, RESUME_TO_DISAMBIGUATE) for p in ended)
        if failed and not failure_seen and not stop.received:
            failure_seen = True  # the others may end on their own first
            plan = [(now + grace_s, signal.SIGTERM), (now + 2 * grace_s, signal.SIGKILL)]
        while plan and plan[0][0] <= now:
            _, sig = plan.pop(0)
            for p in running:
                _signal_group(p, sig)
        time.sleep(0.1)
    _reap(procs)
    codes = [_code(p.returncode) for p in procs]
    if stop.first is not None:
        job_code = 128 + stop.first
    elif len(set(codes)) == 1:
        job_code = codes[0]
    else:
        job_code = next(_code(p.returncode) for p in ended if p.returncode != 0)
    stopped_by = None if stop.first is None else signal.Signals(stop.first).name
    return Attempt(attempt, job_code, codes, round(time.monotonic() - start, 1), stopped_by)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        ours, train_args = argv[:split], argv[split + 1:]
    else:
        ours, train_args = argv, []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--same-device", action="store_true")
    p.add_argument("--grace-seconds", type=float, default=10.0,
                   help="how long ranks may run after one rank failed or a stop signal "
                        "before they are killed")
    p.add_argument("--report", type=Path, default=None, help="write the attempts as JSON")
    p.add_argument("--script", type=Path, default=TRAIN,
                   help="the training script the ranks run (default: scripts/train.py)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="write each rank's output to LOG_DIR/attempt_N/rank_K.log")
    p.add_argument("--fork-ranks", action="store_true",
                   help="start each rank as a fork of the runner (for a runner forked from a "
                        "process that imported the training's modules) instead of a new "
                        "interpreter")
    args = p.parse_args(ours)

    stop = StopSignals()
    stop.install()
    save_dir = save_dir_of(train_args)
    try:
        lock = SaveLock.acquire(save_dir) if save_dir is not None else None
    except LockHeld as exc:
        log(str(exc))
        return LOCKED
    attempts: list[Attempt] = []
    try:
        while stop.first is None:
            number = len(attempts) + 1
            log(f"attempt {number}: launching {args.nproc_per_node} ranks")
            result = launch(args.nproc_per_node, train_args, number, args.same_device,
                            args.grace_seconds, stop, args.script, args.log_dir,
                            args.fork_ranks)
            attempts.append(result)
            if result.stopped_by is not None:
                log(f"attempt {number}: stopped by {result.stopped_by}; ranks "
                    f"{result.rank_codes}; no rank is left; {result.seconds}s")
                break
            meaning = MEANING.get(result.exit_code, "failed")
            log(f"attempt {number}: exit code {result.exit_code} ({meaning}); "
                f"ranks {result.rank_codes}; {result.seconds}s")
            if result.exit_code != RESUME_TO_DISAMBIGUATE:
                break
            if number > args.max_restarts:
                log(f"giving up after {args.max_restarts} restarts")
                break
            log("relaunching to resume from the checkpoint")
    finally:
        if lock is not None:
            lock.release()
    if args.report is not None:
        args.report.write_text(json.dumps([asdict(a) for a in attempts], indent=1))
    if stop.first is not None:
        return 128 + stop.first
    return attempts[-1].exit_code


if __name__ == "__main__":
    sys.exit(main())
