"""A checkpoint that this megatron-core cannot read because a newer one wrote it.

Newer megatron-core releases keep a checkpoint's common state (iteration, args, the
non-sharded values) as a ``common_state`` object inside the torch_dist checkpoint and write no
``common.pt``; older ones read the common state only from ``common.pt`` and fail on such a
checkpoint with an error that says nothing about why (0.16.1: ``AttributeError: 'str' object
has no attribute 'iterdir'``). A downgrade cannot work; this says what happened.

Decided from the checkpoint and from this megatron-core's behaviour, never from version
numbers: no ``common.pt``, a ``common_state`` entry in ``.metadata``, and this
megatron-core's own ``load_common_state_dict`` unable to read a tiny checkpoint of that
layout (a damaged ``common_state`` in a checkpoint it can read is another failure). Only asked after a
read failed (:mod:`.load_errors` asks it for ``dist_checkpointing.load`` and for
``load_common_state_dict``, which Megatron-LM's training flow and ``load_content_metadata``
call before any load); the facts are on disk, so every rank finds the same answer.
"""

from __future__ import annotations

import functools
import inspect
import io
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

from megatron_ckpt_fixes.compat.detect import quiet

COMMON_FILE = "common.pt"
COMMON_OBJECT = "common_state"
#: How a reason starts (load_errors recognises it to print one line for every rank).
PREFIX = "written by a newer megatron-core"


def _has_common_object(path: Path) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(key.split("/shard_")[0] == COMMON_OBJECT for key in keys)


#: What the probe checkpoint's common state holds.
_PROBE = {"megatron_ckpt_fixes_probe": 1}


def _write_probe(directory: str) -> None:
    """A checkpoint in the newer layout, as small as can be: ``metadata.json`` and the
    ``common_state`` object only, serialized as megatron-core's torch_dist strategy
    serializes a ShardedObject (``torch.save([data])``), no ``common.pt``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    payload = io.BytesIO()
    torch.save([_PROBE], payload)
    key = ShardedObject(COMMON_OBJECT, None, (1,), (0,)).unique_key
    dcp.save({key: payload}, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    save_config(CheckpointingConfig("torch_dist"), directory)


@functools.lru_cache(maxsize=None)
def reads_common_object(load_common_state_dict: Callable[[str], Any]) -> bool:
    """Whether this megatron-core's ``load_common_state_dict`` (unpatched) reads a common
    state kept only as the ``common_state`` object: asked of a tiny checkpoint in that
    layout, so a damaged object in the user's checkpoint is not taken for a newer writer."""
    with tempfile.TemporaryDirectory() as tmp, quiet("megatron.core"):
        try:
            _write_probe(tmp)
            return load_common_state_dict(tmp) == _PROBE
        except Exception:  # noqa: BLE001 - how it fails is what this megatron-core lacks
            return False


def newer_writer_reason(checkpoint_dir: Any) -> str | None:
    """One line saying why this megatron-core cannot read ``checkpoint_dir`` if a newer one
    wrote it; None if that is not why (or cannot be told)."""
    from megatron.core import dist_checkpointing

    path = Path(checkpoint_dir)
    try:
        if (path / COMMON_FILE).exists() or not _has_common_object(path):
            return None
    except Exception:  # noqa: BLE001 - no readable .metadata: some other failure
        return None
    if reads_common_object(inspect.unwrap(dist_checkpointing.load_common_state_dict)):
        return None
    return (f"{PREFIX}: its common state is the {COMMON_OBJECT!r} object inside the torch_dist "
            f"checkpoint and there is no {COMMON_FILE}, the only place megatron-core "
            f"{version('megatron-core')} reads it from; load it with the release that wrote it "
            "or a newer one")
