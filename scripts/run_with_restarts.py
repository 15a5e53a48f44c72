#!/usr/bin/env python
"""Relaunch a training job when it exits asking to be resumed (code 16), like a scheduler.

    python scripts/run_with_restarts.py --nproc-per-node 2 --max-restarts 3 -- \
        --tensor-model-parallel-size 2 --train-iters 20 --save ckpt --load ckpt ...

Everything after ``--`` goes to ``scripts/train.py``. The ranks are started the way a cluster
scheduler (srun) starts them: one process per rank with torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the job's real exit code is seen
(torchrun reports any failing worker as 1). A rank that dies takes the job down: the other
ranks are stopped after ``--grace-seconds`` (SIGTERM, then SIGKILL), and whatever processes
the ranks left behind are killed at the end of each attempt. The job's exit code is the code
every rank exited with, else the first failure's (128 + signal for a rank killed by one).

Exit code 16 (resume to disambiguate) is relaunched up to ``--max-restarts`` times; 0 (done),
17 (failed validation) and anything else end the run. Each attempt runs on a fresh rendezvous
port and, on CPU, on a new placement (``MCF_CPU_DEVICE_INDEX`` = attempt number), so that the
rerun state machine sees the relaunch on "another device", as a scheduler that excludes the
suspicious node would place it; ``--same-device`` keeps the placement.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TRAIN = Path(__file__).resolve().parent / "train.py"
RESUME_TO_DISAMBIGUATE = 16
MEANING = {0: "done", 16: "resume to disambiguate", 17: "failed result validation"}


@dataclass
class Attempt:
    attempt: int
    exit_code: int
    rank_codes: list[int]
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # -9 -> 137, like a shell


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the rank's session: the rank and what it started
    except ProcessLookupError:
        pass


def launch(nproc: int, train_args: list[str], attempt: int, same_device: bool,
           grace_s: float) -> Attempt:
    """Start one process per rank, wait; a failing rank takes the others down."""
    port = free_port()
    start = time.monotonic()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", "1")
        if not same_device:
            env["MCF_CPU_DEVICE_INDEX"] = str(attempt - 1)
        # Own session per rank, so the job's leftovers can be cleaned up (below).
        procs.append(subprocess.Popen([sys.executable, str(TRAIN), *train_args], env=env,
                                      start_new_session=True))
    ended: list[subprocess.Popen] = []  # in the order the ranks ended
    stop_at: float | None = None
    stop_signals = iter((signal.SIGTERM, signal.SIGKILL))
    while len(ended) < len(procs):
        ended += [p for p in procs if p not in ended and p.poll() is not None]
        failed = any(p.returncode not in (0, RESUME_TO_DISAMBIGUATE) for p in ended)
        if failed and stop_at is None:
            stop_at = time.monotonic() + grace_s
        if stop_at is not None and time.monotonic() > stop_at:
            sig = next(stop_signals, signal.SIGKILL)
            for p in procs:
                if p.poll() is None:
                    _signal_group(p, sig)
            stop_at = time.monotonic() + grace_s
        time.sleep(0.1)
    for p in procs:
        # Like a scheduler ending a job step: processes a rank left behind go too (a rank
        # killed mid-save orphans the Manager process of megatron's async writer).
        _signal_group(p, signal.SIGKILL)
    codes = [_code(p.returncode) for p in procs]
    if len(set(codes)) == 1:
        job_code = codes[0]
    else:
        job_code = next(_code(p.returncode) for p in ended if p.returncode != 0)
    return Attempt(attempt, job_code, codes, round(time.monotonic() - start, 1))


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
                   help="how long the other ranks may run after one rank failed")
    p.add_argument("--report", type=Path, default=None, help="write the attempts as JSON")
    args = p.parse_args(ours)

    attempts: list[Attempt] = []
    while True:
        number = len(attempts) + 1
        print(f"[run_with_restarts] attempt {number}: launching {args.nproc_per_node} ranks",
              flush=True)
        result = launch(args.nproc_per_node, train_args, number, args.same_device,
                        args.grace_seconds)
        attempts.append(result)
        meaning = MEANING.get(result.exit_code, "failed")
        print(f"[run_with_restarts] attempt {number}: exit code {result.exit_code} ({meaning}); "
              f"ranks {result.rank_codes}; {result.seconds}s", flush=True)
        if result.exit_code != RESUME_TO_DISAMBIGUATE:
            break
        if number > args.max_restarts:
            print(f"[run_with_restarts] giving up after {args.max_restarts} restarts", flush=True)
            break
        print("[run_with_restarts] relaunching to resume from the checkpoint", flush=True)
    if args.report is not None:
        args.report.write_text(json.dumps([asdict(a) for a in attempts], indent=1))
    return attempts[-1].exit_code


if __name__ == "__main__":
    sys.exit(main())
