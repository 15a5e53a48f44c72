"""megatron-core's reading of a checkpoint's tensor metadata, on a torch that records more.

``TorchDistLoadShardedStrategy.load_tensors_metadata`` (behind ``load_sharded_metadata``: a
strict load's mismatch check, ``load_tensors_metadata``, Megatron-LM's resume) builds every
saved tensor as ``torch.empty(size, **properties.__dict__, device='meta')``: it passes every
field of torch DCP's ``TensorProperties`` to ``torch.empty``. torch 2.15 added a field,
``strides``, that ``torch.empty`` does not take (every ``TensorProperties`` has it, also
one unpickled from an older checkpoint), so on that torch every such load fails with
``TypeError: empty() got an unexpected keyword argument 'strides'``, whichever torch saved
the checkpoint.

The patch hands upstream's unchanged method a view of the metadata whose tensor entries keep
only the properties ``torch.empty`` accepts (asked of ``torch.empty`` itself, per field);
what megatron-core takes from the meta tensor, its shape and dtype, is unchanged. Applied
only where upstream's own method fails on the metadata this torch records
(:func:`upstream_reads_this_torch`), never from a version number.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_ckpt_fixes.core.patching import Patch

_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch:TorchDistLoadShardedStrategy"
_READER = "megatron.core.dist_checkpointing.strategies.torch:_get_filesystem_reader"
#: where the replacement keeps upstream's own method, for :func:`upstream_reads_this_torch`
_UPSTREAM = "_mcf_upstream"


@functools.lru_cache(maxsize=None)
def empty_takes(field: str) -> bool:
    """Whether ``torch.empty`` takes ``TensorProperties``' field ``field`` (with its default
    value; None for a field this torch's class lacks) as a keyword argument, as megatron-core
    passes it."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    try:
        torch.empty(0, device="meta", **{field: getattr(TensorProperties(), field, None)})
    except TypeError:
        return False
    return True


def _entry_view(entry: Any) -> Any:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not isinstance(entry, TensorStorageMetadata):
        return entry
    fields = vars(entry.properties)
    if all(map(empty_takes, fields)):
        return entry
    kept = types.SimpleNamespace(**{name: value for name, value in fields.items()
                                    if empty_takes(name)})
    return dataclasses.replace(entry, properties=kept)


def metadata_view(metadata: Any) -> Any:
    """A shallow copy of a DCP ``Metadata`` whose tensor entries carry only the properties
    ``torch.empty`` takes (the checkpoint's own metadata object is left as it is)."""
    view = copy.copy(metadata)
    view.state_dict_metadata = {key: _entry_view(entry)
                                for key, entry in metadata.state_dict_metadata.items()}
    return view


def reading_this_torchs_metadata(original: Callable[..., Any]) -> Callable[..., Any]:
    from megatron.core.dist_checkpointing.strategies import torch as strategies

    @functools.wraps(original)
    def load_tensors_metadata(self: Any, checkpoint_dir: Path, metadata: Any = None) -> Any:
        if metadata is None:  # as upstream reads it
            metadata = strategies._get_filesystem_reader(checkpoint_dir).read_metadata()
        return original(self, checkpoint_dir, metadata_view(metadata))

    setattr(load_tensors_metadata, _UPSTREAM, original)
    return load_tensors_metadata


def upstream_reads_this_torch() -> str | None:
    """Ask upstream's own ``load_tensors_metadata`` to read the metadata of a tensor as this
    torch records it at a save: why the patch is not needed (it reads it), or None (it fails
    on a field ``torch.empty`` does not take)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       TensorProperties, TensorStorageMetadata)

    current = TorchDistLoadShardedStrategy.load_tensors_metadata
    upstream = getattr(current, _UPSTREAM, current)
    tensor = torch.zeros(2, 3)
    entry = TensorStorageMetadata(TensorProperties.create_from_tensor(tensor), tensor.size(),
                                  [ChunkStorageMetadata(torch.Size([0, 0]), tensor.size())])
    try:
        upstream(TorchDistLoadShardedStrategy(), Path("."), Metadata({"probe": entry}))
    except TypeError:
        if all(map(empty_takes, vars(entry.properties))):
            raise  # not the failure this patch is about: cannot tell, refuse
        return None
    return "megatron-core reads the tensor metadata this torch records"


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="compat.tensor_metadata.load_tensors_metadata",
        target=_STRATEGY,
        attr="load_tensors_metadata",
        build=reading_this_torchs_metadata,
        reads=(_READER,),
        not_needed=upstream_reads_this_torch,
        why="megatron-core passes every field of torch's TensorProperties to torch.empty; "
            "this torch records one it does not take (strides): every load of the tensor "
            "metadata (strict loads, Megatron-LM's resume) would fail with TypeError",
    ),
)
