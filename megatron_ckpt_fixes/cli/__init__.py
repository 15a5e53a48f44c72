"""Inspect and verify torch_dist checkpoints; run unchanged scripts with the fixes installed.

    megatron-ckpt-fixes inspect CKPT_DIR     # what is in a torch_dist checkpoint
    megatron-ckpt-fixes verify CKPT_DIR      # will it load what was saved? (exit 1 if not)
    megatron-ckpt-fixes verify --dcp DIR     # the same for a plain torch DCP checkpoint
    megatron-ckpt-fixes run [--features F,...] -- SCRIPT ARGS...   # the fixes, no code change

``verify`` checks everything a load needs from the files alone (see :mod:`.checks`); a
directory it cannot check at all gets one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .checks import Unverifiable, read_metadata, verify

__all__ = ["main", "verify"]


def _inspect(metadata: Metadata) -> None:
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            print(f"{key}  tensor {tuple(md.size)} {md.properties.dtype}  "
                  f"{len(md.chunks)} chunk(s)")
        else:
            print(f"{key}  object")


def _verify(checkpoint_dir: str, megatron: bool) -> int:
    report = verify(checkpoint_dir, megatron=megatron)
    for problem in report.problems:
        print(f"PROBLEM {problem}")
    if report.checksums is not None:
        print(f"checksums: {report.checksums}")
    if report.manifest is not None:
        print(f"integrity.json: {report.manifest}")
    records = report.records()
    print("records checked: " + (", ".join(records) if records else
                                 "none (no checksums recorded for this save, no integrity.json):"
                                 " its bytes were not checked"))
    kind = "megatron-core torch_dist" if megatron else "torch DCP"
    verdict = "OK" if not report.problems else f"{len(report.problems)} problem(s)"
    print(f"{checkpoint_dir}: {kind} checkpoint, {report.keys} keys, {verdict}")
    return 1 if report.problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        from ..run import main as run_main

        run_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="megatron-ckpt-fixes",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="list the keys of a checkpoint")
    inspect.add_argument("checkpoint_dir")
    check = commands.add_parser("verify", help="check everything a load needs (exit 1 if not)")
    check.add_argument("checkpoint_dir")
    check.add_argument("--dcp", action="store_true",
                       help="a plain torch DCP checkpoint: skip megatron-core's metadata.json "
                            "and common state")
    commands.add_parser("run", help="run a script with the fixes installed: "
                                    "run [--features F,...] -- SCRIPT ARGS")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            _inspect(read_metadata(args.checkpoint_dir))
            return 0
        return _verify(args.checkpoint_dir, megatron=not args.dcp)
    except Unverifiable as exc:
        print(f"megatron-ckpt-fixes {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
