"""Run a script in a fork of this interpreter as ``python SCRIPT ARGS`` would run it.

A launcher that imported a training job's modules once can fork its processes instead of
starting new interpreters (``run_with_restarts.py --fork-ranks``; the tests' preloaded
launcher, ``zygote.py``): each process skips the seconds of importing torch
and megatron-core. The fork is still a process of its own, in its own session, with its own
environment and exit status; what a new interpreter would do with that environment is done
here, in order:

- start-up (``startup=True``): the package's activation switch (what its ``.pth`` file runs
  at every start-up: :mod:`megatron_ckpt_fixes.activation`), then ``sitecustomize`` (the one
  the launcher's ``PYTHONPATH`` found, run again with the new environment);
- the script as ``__main__``, with ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT``
  sets them (so multiprocessing's spawned children run it as ``__mp_main__``, as always);
- shutdown: non-daemon threads joined, ``atexit`` handlers, streams flushed, and the exit
  status Python gives (``SystemExit``'s code; 1 after an uncaught exception, its traceback
  printed; death by SIGINT after an uncaught ``KeyboardInterrupt``).

A fork shares the launcher's hash seed; numpy's global generator, seeded at its import, is
seeded again from the OS as a new interpreter's would be (Python's ``random`` does so itself).
"""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import signal
import sys
import threading
import traceback
from pathlib import Path


def _exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` gives a process."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


#: The package's activation switch (:data:`megatron_ckpt_fixes.activation.ENV`).
ACTIVATION_ENV = "MEGATRON_CKPT_FIXES"


def _startup() -> None:
    """What a new interpreter's start-up does that depends on the environment."""
    if os.environ.get(ACTIVATION_ENV) or "megatron_ckpt_fixes.activation" in sys.modules:
        from megatron_ckpt_fixes import activation

        activation.disarm()  # what the launcher armed is not this process's switch
        activation.activate_from_environment()
    if "sitecustomize" in sys.modules:
        importlib.reload(sys.modules["sitecustomize"])


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def run_script(script: Path, args: list[str], *, startup: bool = True) -> int:
    """Run ``script`` as ``__main__`` in this process and shut down as Python would; returns
    the exit status (call once, in a process that then ends: see :func:`fork_script`)."""
    sys.argv = [str(script), *args]
    sys.path[0] = str(Path(script).resolve().parent)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    try:
        if startup:
            _startup()
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads
    atexit._run_exitfuncs()
    _flush()
    return code


def fork_script(script: Path, args: list[str], env: dict[str, str], *,
                output: int | None = None, cwd: str | None = None,
                startup: bool = True) -> int:
    """Fork a process that runs ``script args`` with ``env`` (its own session, stdin
    ``/dev/null``, no other descriptor than stdio; ``output``: a file descriptor for its
    stdout and stderr) and ends with its exit status; returns its pid (wait for it with
    ``os.waitpid``)."""
    _flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        if output is not None:
            os.dup2(output, 1)
            os.dup2(output, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # only stdio, as subprocess leaves
        if cwd is not None:
            os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        code = run_script(script, args, startup=startup)
    except BaseException:
        traceback.print_exc()
    finally:
        _flush()
        if code < 0:  # died by a signal, as Python does after an uncaught KeyboardInterrupt
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)
