"""DTensor parameters through megatron-core's own ``dist_checkpointing`` entry points.

Reading order: :mod:`.layout` (pure: a DTensor's block composed with megatron's tensor
parallelism and prepended axes) -> :mod:`.helpers` (the two ``megatron.core.utils`` helpers
every layer's ``sharded_state_dict`` calls) -> :mod:`.experts` (``SequentialMLP``'s replica
ids) -> :mod:`.checkpointable` (uneven chunks with prepended axes reach DCP whole) ->
:mod:`megatron_ckpt_fixes.core.importers` (which modules hold the helpers by name, read from
the installed source). The sharding validation of the irregular grids this produces (uneven, empty
shards) is chunk-exact: :mod:`megatron_ckpt_fixes.fixes.structure.integrity`.
"""

from __future__ import annotations

import functools

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.integrations.mcore_dtensor.checkpointable import (prepended_axes_kept,
    upstream_handles_prepended_axes)
from megatron_ckpt_fixes.integrations.mcore_dtensor.experts import mesh_replicas_kept
from megatron_ckpt_fixes.integrations.mcore_dtensor.helpers import (DTensorShardingError,
    dtensor_aware, signature_problems)
from megatron_ckpt_fixes.core.importers import bound_imports, name_aliases, renamed_imports

_UTILS = "megatron.core.utils"
_CHECKPOINTABLE = "megatron.core.dist_checkpointing.strategies.checkpointable"
_READS = (
    f"{_UTILS}:get_pg_rank",
    f"{_UTILS}:get_pg_size",
    "megatron.core.parallel_state:get_tensor_model_parallel_group",
    "megatron.core.dist_checkpointing.mapping:ShardedTensor",
)


_HELPERS = ("make_tp_sharded_tensor_for_checkpoint", "make_sharded_tensor_for_checkpoint")
#: Which megatron-core modules bind each helper at import time (read from the source).
_IMPORTS = bound_imports("megatron.core", _UTILS, _HELPERS)


def _helper_patch(attr: str, tp_sharded: bool) -> Patch:
    def signature() -> list[str]:
        return signature_problems(attr, tp_sharded)

    def imports() -> list[str]:
        return renamed_imports(_IMPORTS[attr], _UTILS, attr)

    return Patch(
        name=f"dtensor.mcore.{attr}",
        target=_UTILS,
        attr=attr,
        build=functools.partial(dtensor_aware, tp_sharded=tp_sharded),
        reads=_READS,
        probes=(signature, imports),
        aliases=name_aliases(_IMPORTS[attr], attr),
        why="a DTensor parameter's ShardedTensor comes from its own mesh and placements "
            "(exact global shape and offset for uneven, empty, expert-mesh and strided "
            "shards; no full_tensor() gather); other tensors go to upstream unchanged",
    )


PATCHES: tuple[Patch, ...] = (
    _helper_patch(_HELPERS[0], tp_sharded=True),
    _helper_patch(_HELPERS[1], tp_sharded=False),
    Patch(
        name="dtensor.mcore.prepended_axes",
        target=f"{_CHECKPOINTABLE}:CheckpointableShardedTensor",
        attr="from_sh_ten",
        build=prepended_axes_kept,
        reads=tuple(f"{_CHECKPOINTABLE}:CheckpointableShardedTensor.{name}" for name in (
            "__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")),
        not_needed=upstream_handles_prepended_axes,
        why="uneven or empty chunks of tensors with prepended axes (stacked layers, experts) "
            "reach DCP with those axes (upstream: out-of-bounds chunk, IndexError at save)",
    ),
    Patch(
        name="dtensor.mcore.sequential_mlp_replicas",
        target="megatron.core.transformer.moe.experts:SequentialMLP",
        attr="sharded_state_dict",
        build=mesh_replicas_kept,
        why="experts that FSDP2 shards over the expert-data-parallel mesh keep their mesh "
            "replica ids, so every shard is written (upstream marks all but rank 0's as "
            "copies)",
    ),
)

__all__ = ["DTensorShardingError", "PATCHES"]
