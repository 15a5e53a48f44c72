"""megatron-core's ``make_tp_sharded_tensor_for_checkpoint`` and
``make_sharded_tensor_for_checkpoint``, with DTensor parameters laid out by their own mesh.

Every megatron-core layer's ``sharded_state_dict`` turns its parameters into
``ShardedTensor``\\ s through these two helpers. Given an FSDP2-sharded DTensor, upstream took
the data-parallel group from ``parallel_state`` (or the ``dp_cp_group`` passed in) as the shard
axis and assumed equal chunks (global size = local size x group size, offset = group rank x
local size), and ``make_sharded_tensor_for_checkpoint`` fell back to ``full_tensor()`` (an
all-gather, and a copy that a load then fills instead of the parameter) when a mesh axis was
larger than the dim. Uneven shards then got a different global shape on every rank
(``dist_checkpointing.save`` asserts on one rank while the others die or hang), and a
DTensor whose mesh is not that group (an expert mesh, an HSDP mesh) saved its shards at
other ranks' slots.

The replacements build the ``ShardedTensor`` of a DTensor from the DTensor itself
(:mod:`.layout`): its global shape, its mesh coordinate and placements give the exact block
of this rank (uneven and empty shards, several axes on one dim, ``_StridedShard``), composed
with megatron's tensor parallelism and prepended axes. The data is the local shard itself
(no gather), so a load writes straight into the parameter. Replica ids keep megatron's
``(pipeline, tensor, data)`` convention with the data part being this rank's index over the
mesh's ``Replicate`` axes, so every block is written once. Anything that is not a DTensor
goes to the original helper untouched.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core import utils as mcore_utils
from megatron.core.dist_checkpointing import mapping
from megatron.core.dist_checkpointing.core import CheckpointingException
from torch.distributed.tensor import DTensor

from megatron_ckpt_fixes.dtensor.errors import PlacementError
from megatron_ckpt_fixes.integrations.mcore_dtensor.layout import mesh_shard, sharded_tensor_fields

#: Attribute on a ShardedTensor built from a DTensor: the data-parallel part of its replica
#: id (see :mod:`.experts`, which restores it after megatron overwrites it).
MESH_REPLICA_ATTR = "_mcf_mesh_replica"

#: Parameters of the upstream helpers that the replacements read.
HELPER_PARAMETERS = ("tensor", "key", "replica_id", "prepend_offsets")


class DTensorShardingError(PlacementError, CheckpointingException):
    """A DTensor parameter cannot be described as one megatron ``ShardedTensor``: its local
    shard does not fit its own global shape and placements, its placements are ``Partial``
    or interleave indices, or the sharded offsets are invalid. A ``ValueError`` like the
    other layout errors, and a ``CheckpointingException`` like megatron's own."""


def _rank() -> int | None:
    return dist.get_rank() if dist.is_initialized() else None


def dtensor_sharded_tensor(tensor: DTensor, key: str, tp_axis: int | None,
                           replica_id: Any, prepend_offsets: Any,
                           init_kwargs: dict[str, Any]) -> Any:
    """The ``ShardedTensor`` of a DTensor parameter (``tp_axis`` None: not TP-sharded).

    ``init_kwargs`` are the helper's extra keyword arguments: the groups (``tp_group``,
    ``dp_cp_group``, as upstream: both None means parallel_state's) and what goes on to the
    ``ShardedTensor`` (``allow_shape_mismatch``). The data-parallel group is not used: the
    DTensor's mesh says how the data-parallel ranks share the tensor.
    """
    rank = _rank()
    extra = dict(init_kwargs)
    tp_group = extra.pop("tp_group", None)
    dp_cp_group = extra.pop("dp_cp_group", None)  # only to tell "no groups given", as upstream
    if tp_group is None and dp_cp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_rank, tp_size = mcore_utils.get_pg_rank(tp_group), mcore_utils.get_pg_size(tp_group)
    mesh = tensor.device_mesh
    coord = mesh.get_coordinate()
    try:
        if coord is None:
            raise PlacementError(key, rank, f"this rank is not part of the DTensor's mesh {mesh}")
        with torch.no_grad():
            local = tensor.to_local()
        shard = mesh_shard(key, rank, tuple(tensor.shape), tuple(mesh.shape), tuple(coord),
                           tensor.placements, tuple(local.shape))
        fields = sharded_tensor_fields(key, rank, shard, tuple(prepend_offsets),
                                       None if tp_axis is None else (tp_axis, tp_rank, tp_size))
    except PlacementError as exc:
        raise DTensorShardingError(exc.key, exc.rank, exc.problem) from exc
    if replica_id is None:
        replica_id = (0, 0 if tp_axis is not None else tp_rank, shard.replica)
    sharded = mapping.ShardedTensor(
        key, local, local.dtype, fields.local_shape, fields.global_shape, fields.global_offset,
        fields.axis_fragmentations, replica_id, fields.prepend_axis_num, **extra)
    setattr(sharded, MESH_REPLICA_ATTR, shard.replica)
    if hasattr(tensor, "is_torch_fsdp2_param"):
        # megatron-core >= 0.19 marks FSDP2 parameters' ShardedTensors for its SwiGLU factory.
        sharded.is_torch_fsdp2_param = True
    return sharded


def dtensor_aware(original: Callable[..., Any], tp_sharded: bool) -> Callable[..., Any]:
    """Wrap one upstream helper: DTensors are laid out here, everything else goes to it."""
    signature = inspect.signature(original)
    var_keyword = next(name for name, p in signature.parameters.items()
                       if p.kind is inspect.Parameter.VAR_KEYWORD)  # checked at install

    @functools.wraps(original)
    def helper(*args: Any, **kwargs: Any) -> Any:
        tensor = args[0] if args else kwargs.get("tensor")
        if not isinstance(tensor, DTensor):
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        return dtensor_sharded_tensor(
            tensor, arguments["key"], arguments["tp_axis"] if tp_sharded else None,
            arguments["replica_id"], arguments["prepend_offsets"], arguments[var_keyword])

    return helper


def signature_problems(attr: str, tp_sharded: bool) -> list[str]:
    """What the replacement of ``megatron.core.utils.<attr>`` needs from its signature."""
    params = inspect.signature(getattr(mcore_utils, attr)).parameters
    needed = HELPER_PARAMETERS + (("tp_axis",) if tp_sharded else ())
    problems = [f"megatron.core.utils.{attr} has no parameter {name!r}"
                for name in needed if name not in params]
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        problems.append(f"megatron.core.utils.{attr} takes no **kwargs (tp_group, dp_cp_group)")
    return problems
