"""Megatron's checkpoint layout, and the rule that the tracker only names finished saves.

``<root>/iter_0000123/`` holds one checkpoint; ``<root>/latest_checkpointed_iteration.txt``
names the one to resume from. A save is written into ``iter_0000123.saving/`` and only after
every rank has finalized it (see :mod:`.checkpointing`) does rank 0 :func:`publish` it: rename
it into place, then replace the tracker atomically (write a temporary file, fsync,
``os.replace``). A rank killed mid-save therefore leaves at most an ``.saving`` directory
behind, the tracker still naming the previous complete checkpoint.

A fault checkpoint can be taken at an iteration that already has a checkpoint (the rerun
state machine saves *before* the step's optimizer update). Then the old directory is moved to
``iter_0000123.superseded`` before the new one is renamed into place; a crash between those two
renames leaves the tracker naming an iteration whose complete checkpoint is the superseded
one, which :func:`checkpoint_dir` falls back to.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


def iteration_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def staging_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}.saving"


def superseded_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}.superseded"


def tracker_path(root: Path) -> Path:
    return Path(root) / TRACKER_FILENAME


def no_checkpoint(root: Path) -> str:
    """What a job says of a ``--load`` without a tracker: the same words whether the path
    does not exist, is empty, or was just created by the job's own ``--save`` (the runner's
    lock does that), so a mistyped resume path reads the same as a missing one."""
    return f"--load {root} holds no checkpoint (no {TRACKER_FILENAME})"


def read_tracker(root: Path) -> int | None:
    """The iteration the tracker names, or None when there is no checkpoint yet."""
    path = tracker_path(root)
    if not path.exists():
        return None
    text = path.read_text().strip()
    try:
        return int(text)
    except ValueError as exc:
        raise ValueError(f"{path}: expected an iteration number, found {text!r}") from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tracker(root: Path, iteration: int) -> None:
    """Replace the tracker atomically: readers see the old or the new iteration, never a mix."""
    path = tracker_path(root)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def publish(root: Path, iteration: int) -> Path:
    """Move a finalized ``.saving`` directory into place and point the tracker at it.

    Called on one rank only, after every rank has finalized the save.
    """
    staging, final, old = (staging_dir(root, iteration), iteration_dir(root, iteration),
                           superseded_dir(root, iteration))
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    write_tracker(root, iteration)
    shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_dir(root: Path, iteration: int) -> Path:
    """The complete checkpoint of ``iteration`` (see the module docstring for the fallback)."""
    final = iteration_dir(root, iteration)
    if final.exists():
        return final
    old = superseded_dir(root, iteration)
    if old.exists():
        return old
    raise FileNotFoundError(
        f"{tracker_path(root)} names iteration {iteration} but neither {final} nor {old} exists"
    )
