"""No success without the bytes: a writer failure of any kind fails the save on every rank.

Real failures on 2 gloo ranks, through megatron-core's own save paths (synchronous, its
forked asynchronous writer, the persistent worker; scenarios in ``writer_failures.py``):
a writer thread's (0.19; 0.16 with ``writer_threads``) or writer process's (0.16)
``open`` failing, a forked bucket writer SIGKILLed mid-save (0.16 without
``writer_threads``), the asynchronous writer process SIGKILLed, the
coordinator's ``.metadata`` write failing, and (as root, in a private mount namespace) a
real EIO from a shut-down ext4 and a real ENOSPC from a full tmpfs. With ``install()``
every one ends in the same ``WriteFailedError`` (a ``CheckpointException``, as upstream's)
on every rank, naming the failing rank and the cause, within seconds; ``.metadata`` is
never written. The upstream twins: a SIGKILLed bucket writer leaves its rank waiting in
``count_queue.join()`` forever (0.16); a writer thread's failure raises ``AssertionError:
<class 'IsADirectoryError'>`` on its rank alone while the other waits for it (0.19); the
coordinator's failed metadata write leaves the other rank in the broadcast (both).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from writer_failures import applicable, run_cases, writes_with_processes

from megatron_ckpt_fixes._dev.testing import run_ranks

pytestmark = pytest.mark.timeout(600)

#: Every case that must end in the same agreed error, run one after the other in one job.
FIXED = ["thread-exception-sync", "thread-exception-async", "killed-bucket-sync",
         "killed-bucket-async", "killed-writer-async", "metadata-write-fails",
         "thread-exception-persistent"]
#: What each case's error names.
CAUSES = {
    "thread-exception": "IsADirectoryError: [Errno 21] Is a directory" if not
                        writes_with_processes() else "[Errno 21] Is a directory",
    "killed-bucket": "the checkpoint writer process",
    "killed-writer": "the asynchronous checkpoint writer process",
    "metadata-write-fails": "rank 0: writing the checkpoint's metadata: IsADirectoryError",
}


def _cause(name: str) -> str:
    return next(text for prefix, text in CAUSES.items() if name.startswith(prefix))


def _values(results) -> list[dict]:
    assert all(r is not None and r.ok for r in results), results
    return [r.value for r in results]


def _assert_agreed(outcomes: list[dict], cause: str, failing: int = 1) -> None:
    errors = [o.get("error") for o in outcomes]
    assert all(o["outcome"] == "error" for o in outcomes), outcomes
    assert errors[0] == errors[1], f"ranks disagree: {errors}"
    assert f"failed on 1 rank(s):\n  rank {failing}: " in errors[0] and cause in errors[0], \
        errors[0]
    assert all({"WriteFailedError", "CheckpointException"} <= set(o["classes"])
               for o in outcomes)
    assert not any(o["metadata"] for o in outcomes)  # no success without the bytes
    assert not any(o["orphans"] for o in outcomes)  # a killed writer's writers died too


@pytest.fixture(scope="module")
def fixed() -> dict[str, list[dict]]:
    names = [n for n in FIXED if applicable(n)]
    ranks = _values(run_ranks(run_cases, 2, names, True, timeout_s=500))
    return {name: [ranks[0][name], ranks[1][name]] for name in names}


@pytest.mark.parametrize("name", FIXED)
def test_a_failed_writer_fails_the_save_on_every_rank(fixed, name):
    if not applicable(name):
        pytest.skip("megatron-core writes with threads here: no forked bucket writer")
    _assert_agreed(fixed[name], _cause(name), failing=0 if name.startswith("metadata") else 1)


def test_upstream_waits_forever_for_a_dead_writer():
    """0.16: a SIGKILLed bucket writer never calls task_done(): its rank waits in
    ``count_queue.join()``, the other in the barrier after the write. 0.19 (threads): a
    writer thread's failure raises an AssertionError naming only its class, on its rank
    alone; the other rank waits for it in the barrier."""
    name = "killed-bucket-sync" if writes_with_processes() else "thread-exception-sync"
    outcomes = [o[name] for o in _values(run_ranks(run_cases, 2, [name], False,
                                                   timeout_s=400))]
    if writes_with_processes():
        assert [o["outcome"] for o in outcomes] == ["waiting", "waiting"], outcomes
        assert outcomes[1]["waits"][:3] == ["wait", "join", "write_preloaded_data_multiproc"]
        assert "barrier" in outcomes[0]["waits"]
    else:
        assert outcomes[1]["outcome"] == "error" and outcomes[1]["classes"][0] == \
            "AssertionError" and outcomes[1]["error"] == "<class 'IsADirectoryError'>"
        assert outcomes[0]["outcome"] == "waiting" and "barrier" in outcomes[0]["waits"]


def test_upstream_leaves_the_others_waiting_when_the_metadata_write_fails():
    outcomes = [o["metadata-write-fails"] for o in _values(
        run_ranks(run_cases, 2, ["metadata-write-fails"], False, timeout_s=400))]
    assert outcomes[0]["outcome"] == "error" and "Is a directory" in outcomes[0]["error"]
    assert outcomes[1]["outcome"] == "waiting" and outcomes[1]["waits"][0] == "broadcast"


# -- real EIO and ENOSPC, in a private mount namespace -----------------------------------------

_MOUNTS = """set -e
base="$0"
mount -t tmpfs -o size=64m tmpfs "$base"
truncate -s 32M "$base/disk.img"
mkfs.ext4 -q -O ^has_journal "$base/disk.img"
mkdir "$base/ext4" "$base/small"
mount -o loop "$base/disk.img" "$base/ext4"
mount -t tmpfs -o size=96k tmpfs "$base/small"
exec "$@"
"""
_JOB = """import json, sys
sys.path.insert(0, "tests/functional")
from writer_failures import run_cases
from megatron_ckpt_fixes._dev.testing import run_ranks
results = run_ranks(run_cases, 2, sys.argv[2].split(","), sys.argv[3] == "fixes",
                    timeout_s=400, check=False)
json.dump([r.value if r is not None and r.ok else repr(r) for r in results],
          open(sys.argv[1], "w"))
"""


def _mounted_job(tmp_path: Path, names: list[str], fixes: bool) -> list[dict]:
    """``run_cases`` in a private mount namespace with an ext4 on a loop device and a
    96 KiB tmpfs (root only: loop devices)."""
    base, out = tmp_path / "mounts", tmp_path / f"{'-'.join(names)}.json"
    base.mkdir(exist_ok=True)
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", _MOUNTS, str(base), "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace with a loop device here: {probe.stderr[-300:]}")
    env = {**os.environ, "MCF_TEST_EXT4_DIR": str(base / "ext4"),
           "MCF_TEST_SMALL_TMPFS_DIR": str(base / "small"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["unshare", "--mount", "sh", "-c", _MOUNTS, str(base), sys.executable,
                           "-c", _JOB, str(out), ",".join(names),
                           "fixes" if fixes else "upstream"],
                          cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=500)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert all(isinstance(r, dict) for r in results), results
    return results


def test_real_eio_and_enospc_fail_the_save_on_every_rank(tmp_path):
    ranks = _mounted_job(tmp_path, ["eio", "enospc"], True)
    eio, enospc = ([r[name] for r in ranks] for name in ("eio", "enospc"))
    assert eio[0]["error"] == eio[1]["error"] and eio[0]["outcome"] == "error", eio
    assert "failed on 2 rank(s)" in eio[0]["error"], eio[0]["error"]
    assert eio[0]["error"].count("[Errno 5] Input/output error") == 2, eio[0]["error"]
    assert enospc[0]["error"] == enospc[1]["error"] and enospc[0]["outcome"] == "error"
    assert "No space left on device" in enospc[0]["error"] or \
        "unexpected pos" in enospc[0]["error"], enospc[0]["error"]
    assert not any(o["metadata"] for o in (*eio, *enospc))


def test_upstream_real_eio_names_its_cause_on_one_rank_only(tmp_path):
    """Upstream fails the save too, but only the coordinator learns why (0.19's threaded
    writer: only the class, ``<class 'OSError'>``); the other rank's error names nothing."""
    eio = [r["eio"] for r in _mounted_job(tmp_path, ["eio"], False)]
    assert [o["outcome"] for o in eio] == ["error", "error"], eio
    assert "Input/output error" in eio[0]["error"] or "<class 'OSError'>" in eio[0]["error"]
    assert eio[1]["error"] == "CheckpointException ranks:dict_keys([])\n", eio[1]
