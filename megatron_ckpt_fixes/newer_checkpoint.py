"""A checkpoint that this megatron-core cannot read because a newer one wrote it.

Newer megatron-core releases keep a checkpoint's common state (iteration, args, the
non-sharded values) as a ``common_state`` object inside the torch_dist checkpoint and write no
``common.pt``; older ones read the common state only from ``common.pt`` and fail on such a
checkpoint with an error that says nothing about why (0.16.1: ``AttributeError: 'str' object
has no attribute 'iterdir'``). A downgrade cannot work; this says what happened.

Decided from the checkpoint and from this megatron-core's behaviour, never from version
numbers: no ``common.pt``, a ``common_state`` entry in ``.metadata``, and this
megatron-core's own ``load_common_state_dict`` failing on the directory. Only asked after a
read failed (:mod:`.load_errors` asks it for ``dist_checkpointing.load`` and for
``load_common_state_dict``, which Megatron-LM's training flow and ``load_content_metadata``
call before any load); the facts are on disk, so every rank finds the same answer.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

COMMON_FILE = "common.pt"
COMMON_OBJECT = "common_state"
#: How a reason starts (load_errors recognises it to print one line for every rank).
PREFIX = "written by a newer megatron-core"


def _has_common_object(path: Path) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(key.split("/shard_")[0] == COMMON_OBJECT for key in keys)


def _reads_common_object(checkpoint_dir: Any) -> bool:
    from megatron.core import dist_checkpointing

    try:
        dist_checkpointing.load_common_state_dict(str(checkpoint_dir))
    except Exception:  # noqa: BLE001 - how it fails is what this megatron-core lacks
        return False
    return True


def newer_writer_reason(checkpoint_dir: Any, common_failed: bool = False) -> str | None:
    """One line saying why this megatron-core cannot read ``checkpoint_dir`` if a newer one
    wrote it; None if that is not why (or cannot be told). ``common_failed``: this
    megatron-core's ``load_common_state_dict`` is known to have failed on it already."""
    path = Path(checkpoint_dir)
    try:
        if (path / COMMON_FILE).exists() or not _has_common_object(path):
            return None
    except Exception:  # noqa: BLE001 - no readable .metadata: some other failure
        return None
    if not common_failed and _reads_common_object(checkpoint_dir):
        return None
    return (f"{PREFIX}: its common state is the {COMMON_OBJECT!r} object inside the torch_dist "
            f"checkpoint and there is no {COMMON_FILE}, the only place megatron-core "
            f"{version('megatron-core')} reads it from; load it with the release that wrote it "
            "or a newer one")
