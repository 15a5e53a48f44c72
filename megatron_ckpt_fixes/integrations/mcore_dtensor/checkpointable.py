"""megatron-core's ``CheckpointableShardedTensor`` for chunks with prepended axes.

megatron-core hands a ``ShardedTensor`` without a regular grid of equal chunks (uneven or
empty shards) to DCP as a ``CheckpointableShardedTensor``, whose DCP protocol methods give
the chunk the shape of the layer's tensor, ``local_shape``. A ``ShardedTensor`` with
prepended axes (every transformer layer of a stacked ``TransformerBlock``: the layer axis;
every expert: the expert axis) has a global shape with more dims than that, so DCP rejects
the chunk as out of bounds and the save ends in an ``IndexError``. Regular grids never take
this path (they go through torch's ``ShardedTensor``, which views the data with the
prepended singleton axes), which is why it never showed before DTensors brought uneven
chunks.

The replacement describes such a chunk to DCP with its prepended singleton axes, as a view
of the same storage (a load still fills the layer's tensor), while megatron-core's
unwrapping after a load keeps returning the layer's own tensor.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Callable

import torch
from megatron.core.dist_checkpointing import mapping
from megatron.core.dist_checkpointing.strategies.checkpointable import CheckpointableShardedTensor


class PrependedAxesShardedTensor(CheckpointableShardedTensor):
    """A ``CheckpointableShardedTensor`` whose DCP view has the prepended singleton axes."""

    def __init__(self, data: torch.Tensor, sh_ten: Any) -> None:
        super().__init__(data, sh_ten)
        view = sh_ten.data[(None,) * sh_ten.prepend_axis_num]  # a view, whatever the strides
        self._dcp_view = CheckpointableShardedTensor(
            view, replace(sh_ten, data=view, local_shape=tuple(view.shape), prepend_axis_num=0))

    def __create_write_items__(self, fqn: str, sh_ten: Any, index: int | None = None) -> Any:
        return self._dcp_view.__create_write_items__(fqn, self._dcp_view, index)

    def __create_chunk_list__(self) -> Any:
        return self._dcp_view.__create_chunk_list__()

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self._dcp_view.__get_tensor_shard__(index)


def prepended_axes_kept(original: Callable[..., Any]) -> classmethod:
    """Wrap the ``from_sh_ten`` classmethod: chunks with prepended axes get the view above."""
    func = original.__func__

    @functools.wraps(func)
    def from_sh_ten(cls: type, sh_ten: Any) -> Any:
        if sh_ten.prepend_axis_num:
            return PrependedAxesShardedTensor(sh_ten.data, sh_ten)
        return func(cls, sh_ten)

    return classmethod(from_sh_ten)


def upstream_handles_prepended_axes() -> str | None:
    """Whether upstream's chunk of a ShardedTensor with a prepended axis already has the
    global tensor's number of dims (then this patch is not needed)."""
    data = torch.zeros(2, 3)
    sh_ten = mapping.ShardedTensor("probe", data, data.dtype, (2, 3), (4, 2, 3), (1, 0, 0),
                                   None, 0, 1)
    chunk = CheckpointableShardedTensor.from_sh_ten(sh_ten).__create_chunk_list__()[0]
    if len(chunk.sizes) == 3:
        return "CheckpointableShardedTensor already gives chunks their prepended axes"
    return None
