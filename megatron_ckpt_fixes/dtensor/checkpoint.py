"""DCP save/load entry points for DTensor state dicts with checkpoint layouts.

The one place where the pieces meet: wrap local shards with the checkpoint layout
(:func:`.wrap.wrap_state_dict`, one agreement collective), optionally convert to the HF
layout with a :class:`.adapter.StateDictAdapter`, then call
``torch.distributed.checkpoint.save`` / ``load``. Loading writes into the caller's tensors:
the wrapped DTensors share storage with their local shards, and whatever an adapter had to
copy is copied back (an empty local shard is skipped).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron_ckpt_fixes.dtensor.adapter import StateDictAdapter
from megatron_ckpt_fixes.dtensor.wrap import CheckpointLayout, copy_into, wrap_state_dict

logger = logging.getLogger(__name__)


def _prepare(state_dict: Mapping[str, Any], layouts: Mapping[str, CheckpointLayout] | None,
             adapter: StateDictAdapter | None, group: dist.ProcessGroup | None
             ) -> dict[str, Any]:
    wrapped = wrap_state_dict(state_dict, layouts or {}, group)
    return adapter.to_hf(wrapped) if adapter is not None else wrapped


def save(state_dict: Mapping[str, Any], checkpoint_id: str | os.PathLike,
         layouts: Mapping[str, CheckpointLayout] | None = None,
         adapter: StateDictAdapter | None = None,
         process_group: dist.ProcessGroup | None = None) -> None:
    """Save ``state_dict`` with every key in ``layouts`` wrapped in its checkpoint layout.

    Collective over ``process_group``. A layout that does not fit raises the same
    :class:`~.errors.LayoutAgreementError` on every rank before anything is written.
    """
    dcp.save(_prepare(state_dict, layouts, adapter, process_group),
             checkpoint_id=checkpoint_id, process_group=process_group)


def load(state_dict: dict[str, Any], checkpoint_id: str | os.PathLike,
         layouts: Mapping[str, CheckpointLayout] | None = None,
         adapter: StateDictAdapter | None = None,
         process_group: dist.ProcessGroup | None = None) -> None:
    """Load into ``state_dict`` in place (tensors) or by replacement (other values).

    ``layouts`` describe the layout of *this* run; the checkpoint may have been saved with
    any other mesh, placements or world size.
    """
    prepared = _prepare(state_dict, layouts, adapter, process_group)
    dcp.load(prepared, checkpoint_id=checkpoint_id, process_group=process_group)
    loaded = adapter.from_hf(prepared) if adapter is not None else prepared
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            copy_into(key, value, loaded[key])
        else:
            state_dict[key] = loaded[key]
    logger.debug("loaded %d keys from %s", len(state_dict), checkpoint_id)
