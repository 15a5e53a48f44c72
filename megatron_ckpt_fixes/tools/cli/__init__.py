"""Inspect and verify torch_dist checkpoints; run unchanged scripts with the fixes installed.

    megatron-ckpt-fixes inspect CKPT_DIR     # what is in a checkpoint (exit 1: a file is short)
    megatron-ckpt-fixes verify CKPT_DIR      # will it load what was saved? (exit 1 if not)
    megatron-ckpt-fixes verify --strict DIR  # ... and exit 1 if some bytes had no record
    megatron-ckpt-fixes verify --dcp DIR     # check it as plain torch DCP, whatever it holds
    megatron-ckpt-fixes run [--features F,...] -- SCRIPT ARGS...   # the fixes, no code change
    megatron-ckpt-fixes status [--all]       # what install() applies here, readably
    python -m megatron_ckpt_fixes            # the same

CKPT_DIR may be a checkpoint (``ckpt/iter_0000008``) or the save directory that training's
``--save`` names (``ckpt``): then the checkpoint its ``latest_checkpointed_iteration.txt``
names is used, and the first line says so. ``verify`` checks everything a load needs from the
files alone (see :mod:`.checks`), showing its progress on stderr (:mod:`.progress`), and
prints a damaged data file as one line with the count of items it breaks (:mod:`.summary`);
a plain torch DCP checkpoint (no ``metadata.json``, no common state) is recognised as one.
Its last line says what it checked (:mod:`.coverage`): the bytes only where a record covers
them, and never a model's keys (:mod:`megatron_ckpt_fixes.tools.preflight` answers that);
``--strict`` fails where some bytes could not be checked.
A directory it cannot check at all gets one line on stderr and exit code 1. ``inspect``
reads no data, but a data file shorter than its entries need makes it end with a one-line
hint on stderr and exit code 1. torch is imported only by the command that needs it
(``--help`` does not).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from megatron_ckpt_fixes.tools.cli.locate import Located, Unverifiable, locate
from megatron_ckpt_fixes.tools.cli.summary import SHOWN

__all__ = ["main", "verify"]


def verify(checkpoint_dir: str, megatron: bool | None = None, progress: bool = False) -> Any:
    """:func:`.checks.verify` (imported on use: it needs torch)."""
    from megatron_ckpt_fixes.tools.cli.checks import verify as check_all

    return check_all(checkpoint_dir, megatron=megatron, progress=progress)


def _count(text: str) -> int:
    """A number of lines to show: 0 or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (0, 1, 2, ...)")
    return int(text)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("not reached")


def _inspect(found: Located) -> int:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_ckpt_fixes.tools.cli.checks import data_files, is_megatron, read_metadata

    metadata = read_metadata(found.checkpoint_dir)
    entries = sorted(metadata.state_dict_metadata.items())
    tensors = [md for _, md in entries if isinstance(md, TensorStorageMetadata)]
    files = data_files(metadata, found.checkpoint_dir)
    kind = "torch_dist" if is_megatron(found.checkpoint_dir, metadata) else "torch DCP"
    print(f"{found.checkpoint_dir}: {kind} checkpoint, {len(entries)} keys")
    rows = [(key, "tensor", str(tuple(md.size)), str(md.properties.dtype).removeprefix("torch."),
             str(len(md.chunks)))
            if isinstance(md, TensorStorageMetadata) else (key, "object", "", "", "")
            for key, md in entries]
    header = ("key", "kind", "shape", "dtype", "chunks")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4])
    elements = sum(md.size.numel() for md in tensors)
    stored = sum(info.length for info in (metadata.storage_data or {}).values())
    print(f"total: {len(entries)} keys: {len(tensors)} tensors ({elements:,} elements in "
          f"{sum(len(md.chunks) for md in tensors)} chunks), {len(entries) - len(tensors)} "
          f"objects; {_size(stored)} stored in {len(files)} data file(s)")
    short = [file for _, file in sorted(files.items()) if file.short]
    if short:
        print(f"megatron-ckpt-fixes inspect: {short[0].name}: {short[0].damage} ({len(short)} "
              f"of {len(files)} data file(s) too short or missing): megatron-ckpt-fixes verify "
              f"{found.checkpoint_dir} names the items that cannot load", file=sys.stderr)
        return 1
    return 0


def _verify(found: Located, megatron: bool | None, shown: int, strict: bool = False) -> int:
    from megatron_ckpt_fixes.tools.cli.summary import group, problem_lines, verdict

    report = verify(found.checkpoint_dir, megatron=megatron, progress=True)
    if megatron is None and not report.megatron:
        print("no metadata.json and no common state: checked as a plain torch DCP checkpoint "
              "(--dcp)")
    grouped = group(report.problems, report.file_items)
    for line in problem_lines(grouped, shown):
        print(line)
    if report.checksums is not None:
        print(f"checksums: {report.checksums}")
    if report.manifest is not None:
        print(f"integrity.json: {report.manifest}")
    records = report.records()
    print("records checked: " + (", ".join(records) if records else
                                 "none (no checksums recorded for this save, no integrity.json):"
                                 " its bytes were not checked"))
    kind = "megatron-core torch_dist" if report.megatron else "torch DCP"
    # an OK says what it rests on: "OK" alone reads as "will load"
    assert report.coverage is not None
    checked = "" if report.problems else f" ({report.coverage.checked()})"
    print(f"{found.checkpoint_dir}: {kind} checkpoint, {report.keys} keys, {verdict(grouped)}"
          f"{checked}")
    gaps = report.coverage.unchecked()
    if strict and gaps:
        print(f"megatron-ckpt-fixes verify --strict: not checked: {gaps}")
        return 1
    return 1 if report.problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        from megatron_ckpt_fixes.run import main as run_main

        run_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="megatron-ckpt-fixes",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    where = ("a checkpoint (ckpt/iter_0000008) or a save directory (ckpt: the checkpoint its "
             "latest_checkpointed_iteration.txt names)")
    inspect = commands.add_parser("inspect", help="list the keys of a checkpoint, with totals")
    inspect.add_argument("checkpoint_dir", help=where)
    check = commands.add_parser("verify", help="check everything a load needs (exit 1 if not)")
    check.add_argument("checkpoint_dir", help=where)
    check.add_argument("--dcp", action="store_true",
                       help="check it as a plain torch DCP checkpoint: skip megatron-core's "
                            "metadata.json and common state (a directory with neither is "
                            "recognised as one without this flag)")
    check.add_argument("--strict", action="store_true",
                       help="fail (exit 1) when some bytes could not be checked: no checksum "
                            "record of this save, items or files it does not cover; the last "
                            "line names them")
    check.add_argument("--items", type=_count, default=SHOWN, metavar="N",
                       help=f"list at most N broken items per damaged data file (default "
                            f"{SHOWN}; the file's line counts them all)")
    commands.add_parser("run", help="run a script with the fixes installed: "
                                    "run [--features F,...] -- SCRIPT ARGS")
    status = commands.add_parser("status", help="what install() applies here, per feature, "
                                                "and why not (installs in this process only)")
    status.add_argument("--features", default=None,
                        help="as in MEGATRON_CKPT_FIXES (default: its value, else 1)")
    status.add_argument("--all", action="store_true", help="every patch with its reason")
    status.add_argument("--verbose", action="store_true", help="keep upstream's warnings")
    args = parser.parse_args(argv)
    if args.command == "status":
        from megatron_ckpt_fixes.tools.cli.status import main as status_main

        return status_main(args.features, args.all, args.verbose)
    try:
        found = locate(args.checkpoint_dir)
        if found.note:
            print(found.note, flush=True)
        if args.command == "inspect":
            return _inspect(found)
        return _verify(found, megatron=False if args.dcp else None, shown=args.items,
                       strict=args.strict)
    except Unverifiable as exc:
        print(f"megatron-ckpt-fixes {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
