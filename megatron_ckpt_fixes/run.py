"""Run an unchanged training script with the fixes installed (zero-code activation).

    megatron-ckpt-fixes run [--features F,...] -- pretrain_gpt.py ARGS...
    python -m megatron_ckpt_fixes.run [--features F,...] -- pretrain_gpt.py ARGS...
    torchrun --nproc-per-node 8 -m megatron_ckpt_fixes.run -- pretrain_gpt.py ARGS...
    torchrun ... -m megatron_ckpt_fixes.run -- -m package.module ARGS...

The script runs as ``__main__`` exactly as ``python SCRIPT ARGS`` would run it (``sys.argv``,
``sys.path[0]`` = the script's directory, so a Megatron-LM checkout's own ``megatron``
package is found first). ``--features`` defaults to every default feature and takes the
same values as the ``MEGATRON_CKPT_FIXES`` environment switch, which this sets for the
processes the job starts (see :mod:`megatron_ckpt_fixes.activation`).

A command that cannot start (no script, a script or module that is not there, a bad feature
list) is one line and exit code 2 before anything runs, rather than runpy's traceback.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from collections.abc import Sequence

from megatron_ckpt_fixes.activation import ENV, ActivationError, arm, parse_features
from megatron_ckpt_fixes.core.messages import OneLineParser


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(our options, the command): the command starts after ``--`` or at the first
    argument that is not one of our options."""
    argv = list(argv)
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    ours: list[str] = []
    while argv and argv[0].startswith("-") and argv[0] != "-m":
        ours.append(argv.pop(0))
        if ours[-1] == "--features" and argv:
            ours.append(argv.pop(0))
    return ours, argv


def _missing(command: list[str]) -> str | None:
    """Why ``command`` cannot start (its script or module is not there), or None."""
    if command[0] != "-m":
        if os.path.isfile(command[0]):
            return None
        return (f"no script {command[0]!r} (from {os.getcwd()}); give the path of the script "
                "to run, or -m MODULE")
    try:
        found = importlib.util.find_spec(command[1]) is not None
    except (ImportError, ValueError):  # a parent package is missing too
        found = False
    return None if found else (f"no module {command[1]!r} on sys.path (from {os.getcwd()}); "
                               "install it, or give the path of a script")


def main(argv: Sequence[str] | None = None) -> None:
    ours, command = _split(sys.argv[1:] if argv is None else argv)
    parser = OneLineParser(
        prog="megatron-ckpt-fixes run",
        usage="%(prog)s [--features F,...] -- SCRIPT ARGS... | -m MODULE ARGS...",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", default="1",
                        help=f"what to install, as in {ENV}: 1 (default features) or a "
                             "comma-separated list, e.g. default,training.cpu_support")
    args = parser.parse_args(ours)
    try:
        parse_features(args.features)
    except ActivationError as exc:
        parser.error(str(exc))
    if not command or command == ["-m"]:
        parser.error("no script to run: run -- SCRIPT ARGS... or run -- -m MODULE ARGS...")
    if command[0] == "-m":
        sys.path[0] = os.getcwd()  # as python -m has it, also for finding the module
    os.environ[ENV] = args.features
    arm(args.features)  # before finding a module imports its parent package
    problem = _missing(command)
    if problem:
        parser.error(problem)
    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        script = command[0]
        sys.argv = list(command)
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
