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
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Sequence

from .activation import ENV, ActivationError, arm, parse_features


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


def main(argv: Sequence[str] | None = None) -> None:
    ours, command = _split(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
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
        parser.error("no script to run")
    os.environ[ENV] = args.features
    arm(args.features)
    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        script = command[0]
        sys.argv = list(command)
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
