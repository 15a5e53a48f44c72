"""A process forked from the preloaded launcher ends, prints and sees what ``python SCRIPT``
would: exit status, traceback, environment, session, stdin, atexit and thread shutdown.

The tests' jobs run their runner and ranks forked (scripts/zygote.py, forked_start.py); a fork
that turned an uncaught exception into exit 0, or kept the launcher's environment, would let a
failing job pass.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import zygote  # noqa: E402

pytestmark = pytest.mark.varies_with("python")

SCRIPTS = {
    "exits_3": "import sys; sys.exit(3)",
    "exits_with_a_message": "import sys; sys.exit('bad flag')",
    "raises": "raise ValueError('the cause')",
    "interrupted": "raise KeyboardInterrupt",
    "reports": """
        import atexit, json, os, sys, threading, time
        def late():
            time.sleep(0.2)
            print("thread done", flush=True)
        threading.Thread(target=late).start()  # non-daemon: joined before atexit
        atexit.register(lambda: print("atexit ran", flush=True))
        print(json.dumps({"argv": sys.argv, "var": os.environ.get("MCF_FORK_TEST"),
                          "launcher_var": os.environ.get("MCF_LAUNCHER_ONLY"),
                          "own_session": os.getsid(0) == os.getpid(),
                          "stdin": os.readlink("/proc/self/fd/0"),
                          "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
                          "path0": sys.path[0], "cwd": os.getcwd()}), flush=True)
    """,
}


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripts")
    for name, code in SCRIPTS.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(code))
    server = zygote.Zygote({**os.environ, "MCF_LAUNCHER_ONLY": "1"}, ["json"])
    yield server, folder
    server.close()


def _run(launcher, tmp_path: Path, name: str, *args: str) -> tuple[int, str]:
    server, folder = launcher
    out = tmp_path / f"{name}.out"
    env = {k: v for k, v in os.environ.items()} | {"MCF_FORK_TEST": "job"}
    code = server.run(folder / f"{name}.py", list(args), env, tmp_path, out, timeout=60)
    return code, out.read_text()


@pytest.mark.parametrize("name, code, printed", [
    ("exits_3", 3, ""),
    ("exits_with_a_message", 1, "bad flag"),
    ("raises", 1, "ValueError: the cause"),
    ("interrupted", -signal.SIGINT, ""),
])
def test_exit_status_is_pythons(launcher, tmp_path, name, code, printed):
    got, output = _run(launcher, tmp_path, name)
    assert got == code, output
    assert printed in output
    if name == "raises":
        assert output.startswith("Traceback"), output


def test_a_fork_sees_its_own_start(launcher, tmp_path):
    import json

    code, output = _run(launcher, tmp_path, "reports", "--flag", "x")
    assert code == 0, output
    lines = output.splitlines()
    report = json.loads(lines[0])
    assert lines[1:] == ["thread done", "atexit ran"]
    assert report["argv"] == [str(launcher[1] / "reports.py"), "--flag", "x"]
    assert report["var"] == "job" and report["launcher_var"] is None
    assert report["own_session"] and report["stdin"] == os.devnull
    assert report["fds"] == [0, 1, 2, 3]  # stdio and the listing's own descriptor
    assert report["path0"] == str(launcher[1]) and report["cwd"] == str(tmp_path)


def test_both_answers_of_a_short_job_read_at_once_are_both_used():
    """A job that ends at once: the server's two lines come in one read. Both are answers;
    waiting on the pipe for the second would time out (seen in CI: the runner taken for a
    hung one, then every later answer off by one)."""
    read, write = os.pipe()
    os.write(write, b'{"pid": 12}\n{"exit_code": 3}\n')
    client = object.__new__(zygote.Zygote)
    client.proc, client._pending = SimpleNamespace(stdout=os.fdopen(read, "rb")), b""
    try:
        assert client._answer(None) == {"pid": 12}
        assert client._answer(time.monotonic() + 2.0) == {"exit_code": 3}
    finally:
        client.proc.stdout.close()
        os.close(write)
