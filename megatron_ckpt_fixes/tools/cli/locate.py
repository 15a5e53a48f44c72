"""Which checkpoint directory a command means, from what the user typed.

Users point at what their training flags name: ``--save ckpt`` is a save directory, whose
``latest_checkpointed_iteration.txt`` names the checkpoint (``ckpt/iter_0000008``) that a
resume loads. Given such a directory, the commands use the checkpoint the tracker names and
say so; given a save directory without a tracker, they name the ``iter_*`` folders it has.
Imports no torch: ``--help`` and these answers take a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_ckpt_fixes._dev.training import layout

#: How many ``iter_*`` folders an error names before it counts the rest.
SHOWN = 3


class Unverifiable(Exception):
    """The directory cannot be checked at all (one line says why)."""


@dataclass(frozen=True)
class Located:
    checkpoint_dir: str
    note: str | None = None  # how it was found, when it is not the directory given


def checkpoints_in(root: Path) -> list[Path]:
    """The finished ``iter_*`` checkpoints in a save directory, oldest first."""
    return sorted(p for p in root.glob("iter_*") if p.is_dir() and p.name[5:].isdigit())


def name_some(paths: list[Path]) -> str:
    """``a, b, c and 4 more``: the first few names, then a count."""
    names = [p.name for p in paths[:SHOWN]]
    rest = len(paths) - len(names)
    return ", ".join(names) + (f" and {rest} more" if rest else "")


def locate(given: str) -> Located:
    """The checkpoint directory ``given`` means: itself, or the one its tracker names."""
    root = Path(given)
    if not root.is_dir() or (root / ".metadata").exists():
        return Located(given)
    try:
        iteration = layout.read_tracker(root)
        if iteration is not None:
            found = layout.checkpoint_dir(root, iteration)
            return Located(str(found), f"{given} is a save directory: using iteration "
                                       f"{iteration} ({found}), the one its "
                                       f"{layout.TRACKER_FILENAME} names")
    except (ValueError, FileNotFoundError) as exc:
        raise Unverifiable(str(exc)) from exc
    found = checkpoints_in(root)
    if found:
        raise Unverifiable(f"{given}: no .metadata file: a save directory without "
                           f"{layout.TRACKER_FILENAME}; name one of its checkpoints: "
                           f"{name_some(found)}")
    return Located(given)
