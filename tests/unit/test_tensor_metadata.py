"""megatron-core reads the tensor metadata of a checkpoint on a torch whose ``TensorProperties``
has a field ``torch.empty`` does not take (torch 2.15's ``strides``): ``compat.tensor_metadata``.

One process (a gloo group of one rank), megatron-core's own save, ``load_sharded_metadata``
and strict load. The twin: plain megatron-core (``compat.cpu`` only) fails every such load
with ``TypeError: empty() got an unexpected keyword argument 'strides'`` where this torch
records the field, and reads it where it does not (the patch is then not applied). The
rule itself (a metadata entry carrying a field ``torch.empty`` does not take) is checked on
every torch, with the field added by hand: upstream fails, the patched method reads the
saved shapes and dtypes, and the checkpoint's own metadata object is left as it was.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import megatron_ckpt_fixes
from megatron_ckpt_fixes.compat import tensor_metadata
from megatron_ckpt_fixes._dev.testing import init_test_group

pytestmark = pytest.mark.varies_with("megatron-core", "torch")

PATCH = "compat.tensor_metadata.load_tensors_metadata"
SAVED = {"w": ((4, 3), torch.float32), "b": ((5,), torch.bfloat16)}


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    init_test_group(0, 1, f"file://{tmp_path_factory.mktemp('rdzv') / 'f'}",
                    datetime.timedelta(seconds=60))
    yield
    megatron_ckpt_fixes.uninstall()
    dist.destroy_process_group()


def _state() -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {key: ShardedTensor.from_rank_offsets(key, torch.ones(shape, dtype=dtype))
            for key, (shape, dtype) in SAVED.items()}


@pytest.fixture(scope="module")
def saved(group, tmp_path_factory) -> Path:
    from megatron.core import dist_checkpointing as dc

    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install(["compat.cpu"])
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    path.mkdir()
    dc.save(_state(), str(path))
    megatron_ckpt_fixes.uninstall()
    return path


def _shapes(metadata: dict) -> dict:
    return {key: (tuple(t.global_shape), t.dtype) for key, t in metadata.items()
            if key in SAVED}


def _this_torch_records_a_field_empty_does_not_take() -> bool:
    from torch.distributed.checkpoint.metadata import TensorProperties

    fields = vars(TensorProperties.create_from_tensor(torch.zeros(1)))
    return not all(map(tensor_metadata.empty_takes, fields))


def _load_sharded_metadata(path: Path, features: list[str]):
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install(features)
    try:
        return load_sharded_metadata(str(path))
    except TypeError as error:
        return error
    finally:
        megatron_ckpt_fixes.uninstall()


def test_upstream_reads_the_metadata_only_where_this_torch_records_nothing_more(saved):
    """The twin: plain megatron-core on this torch."""
    got = _load_sharded_metadata(saved, ["compat.cpu"])
    if _this_torch_records_a_field_empty_does_not_take():
        assert isinstance(got, TypeError) and "unexpected keyword argument" in str(got), got
        assert tensor_metadata.upstream_reads_this_torch() is None
    else:
        assert _shapes(got) == SAVED
        assert tensor_metadata.upstream_reads_this_torch()


def test_with_the_fixes_the_metadata_and_a_strict_load_read_on_this_torch(saved, tmp_path):
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.validation import StrictHandling

    assert _shapes(_load_sharded_metadata(saved, ["compat.cpu", "compat.tensor_metadata"])) \
        == SAVED
    megatron_ckpt_fixes.install()
    try:
        applied = megatron_ckpt_fixes.installed()[PATCH]
        assert applied.startswith("not applied") != \
            _this_torch_records_a_field_empty_does_not_take(), applied
        empty = {k: v.__class__.from_rank_offsets(k, torch.zeros_like(v.data))
                 for k, v in _state().items()}
        loaded = dc.load(empty, str(saved), strict=StrictHandling.RAISE_ALL)
    finally:
        megatron_ckpt_fixes.uninstall()
    assert all(torch.equal(loaded[key], torch.ones(s, dtype=d)) for key, (s, d) in SAVED.items())


def _with_strides(path: Path):
    """The checkpoint's metadata with a ``strides`` field on every tensor entry, as torch 2.15
    records it, whatever this torch records."""
    from megatron.core.dist_checkpointing.strategies.torch import _get_filesystem_reader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _get_filesystem_reader(path).read_metadata()
    for entry in metadata.state_dict_metadata.values():
        if isinstance(entry, TensorStorageMetadata):
            vars(entry.properties)["strides"] = tuple(torch.ones(tuple(entry.size)).stride())
    return metadata


def test_an_entry_with_a_field_empty_does_not_take_fails_upstream_and_reads_patched(saved):
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    assert not tensor_metadata.empty_takes("strides")
    assert all(map(tensor_metadata.empty_takes,
                   ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")))
    upstream = TorchDistLoadShardedStrategy.load_tensors_metadata
    metadata = _with_strides(saved)
    with pytest.raises(TypeError, match="strides"):
        upstream(TorchDistLoadShardedStrategy(), saved, metadata)
    patched = tensor_metadata.reading_this_torchs_metadata(upstream)
    assert _shapes(patched(TorchDistLoadShardedStrategy(), saved, metadata)) == SAVED
    # the checkpoint's own metadata is not edited by the view
    entry = metadata.state_dict_metadata["w"]
    assert vars(entry.properties)["strides"] == (3, 1) and entry.properties.dtype == torch.float32
