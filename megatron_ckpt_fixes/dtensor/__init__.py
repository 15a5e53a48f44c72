"""Checkpoint-placement-aware DTensor wrapping and transpose-aware placements.

DCP saves and loads a DTensor by its mesh, placements and global shape. Three upstream
traps corrupt or break checkpoints here: wrapping a local shard with the parameter's
(FSDP2) mesh instead of the checkpoint's (ranks load each other's expert shards), keeping
``Shard(1)`` after a ``transpose(1, 2)`` (wrong global shape, size mismatch on load), and
``DTensor.from_local`` without ``shape=``/``stride=`` on uneven shards (wrong global
shape). This package closes all three:

- :mod:`.placements`: pure shape/stride/placement math (torch's chunk semantics).
- :mod:`.rules`: an ordered table of key patterns -> placements over named mesh axes.
- :mod:`.wrap`: local shard -> checkpoint DTensor, global shapes agreed by all ranks.
- :mod:`.transpose`: permute/transpose/split/cat that move placements with the dims.
- :mod:`.adapter`: a declarative HF<->native state-dict adapter built on :mod:`.transpose`.
- :mod:`.checkpoint`: ``save``/``load`` around ``torch.distributed.checkpoint``.
"""

from megatron_ckpt_fixes.dtensor.adapter import KeyMap, StateDictAdapter
from megatron_ckpt_fixes.dtensor.checkpoint import load, save
from megatron_ckpt_fixes.dtensor.errors import LayoutAgreementError, PlacementError
from megatron_ckpt_fixes.dtensor.placements import (contiguous_stride, infer_global_shape, local_shape_and_offset,
                         merge_param_sharding)
from megatron_ckpt_fixes.dtensor.rules import PlacementRule, PlacementTable, replicated, sharded
from megatron_ckpt_fixes.dtensor.transpose import (cat, permute, permute_placements, split,
    transpose, transpose_placements)
from megatron_ckpt_fixes.dtensor.wrap import (CheckpointLayout, copy_into, from_local_exact,
    wrap_state_dict)

__all__ = [
    "CheckpointLayout", "KeyMap", "LayoutAgreementError", "PlacementError", "PlacementRule",
    "PlacementTable", "StateDictAdapter", "cat", "contiguous_stride", "copy_into",
    "from_local_exact", "infer_global_shape", "load", "local_shape_and_offset",
    "merge_param_sharding", "permute", "permute_placements", "replicated", "save", "sharded",
    "split", "transpose", "transpose_placements", "wrap_state_dict",
]
