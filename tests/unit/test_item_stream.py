"""torch DCP builds a new stream wrapper class for every item the torch_dist writer saves;
with the fix one class serves every item of a save without stream extensions, the bytes
written are upstream's, and a save with an extension still goes through it.

megatron-core's own file writer (``FileSystemWriterAsync.write_preloaded_data``) writes a
few tiny tensors into one file, in this process (no ranks), with a spy on the classes of
the wrappers torch hands out: upstream (``install(["compat.cpu"])``) one new class per item;
``install(["compat.cpu", "item_stream"])`` one class, the file bitwise upstream's, each item
loaded back exactly. The trivial wrong fix this fails on: reusing the wrapper whatever the
extensions (a save with a stream extension would skip it: the extension here counts the
items it wrapped).
"""

from __future__ import annotations

import io
import os
import queue

import pytest
import torch
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

pytestmark = pytest.mark.varies_with("megatron-core", "torch")

TENSORS = [torch.arange(16.0, dtype=torch.float64) * (i + 1) for i in range(4)]


class _Counting(StreamTransformExtension):
    """A stream extension that passes bytes through and counts the streams it wrapped."""

    wrapped = 0

    @staticmethod
    def registry_name() -> str:
        return "mcf-test-counting"

    @staticmethod
    def from_descriptor(version: str) -> _Counting:
        return _Counting()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output):
        _Counting.wrapped += 1
        return output

    def transform_from(self, input):
        return input


def _write(path: str, transforms: _StorageWriterTransforms) -> list:
    """The items written through megatron-core's writer, and the wrapper classes used."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    classes = []
    patched = _StorageWriterTransforms.transform_save_stream

    def spy(self, write_item, raw_stream):
        transformed = patched(self, write_item, raw_stream)
        classes.append(type(transformed[0]))
        return transformed

    items = [(WriteItem(MetadataIndex(f"t{i}"), WriteItemType.TENSOR), t)
             for i, t in enumerate(TENSORS)]
    results, count = queue.Queue(), queue.Queue()
    count.put(0)
    _StorageWriterTransforms.transform_save_stream = spy
    try:
        FileSystemWriterAsync.write_preloaded_data(
            [transforms], 0, (path, os.path.basename(path), ([], items)), results, count, True)
    finally:
        _StorageWriterTransforms.transform_save_stream = patched
    written = results.get_nowait()[1]
    assert not isinstance(written, BaseException), written
    return [written, classes]


def _load(path: str, results: list) -> list[torch.Tensor]:
    with open(path, "rb") as f:
        data = f.read()
    return [torch.load(io.BytesIO(data[r.storage_data.offset:r.storage_data.offset
                                       + r.storage_data.length]), weights_only=True)
            for r in results]


def test_one_wrapper_class_serves_every_item_with_upstreams_bytes(clean_install, tmp_path):
    clean_install.install(["compat.cpu"])
    _, upstream_classes = _write(str(tmp_path / "upstream"), _StorageWriterTransforms())
    assert len(set(upstream_classes)) == len(TENSORS), upstream_classes  # one class per item
    clean_install.install(["item_stream"])
    fixed_results, fixed_classes = _write(str(tmp_path / "fixed"), _StorageWriterTransforms())
    assert len(set(fixed_classes)) == 1 and len(fixed_classes) == len(TENSORS)
    assert (tmp_path / "fixed").read_bytes() == (tmp_path / "upstream").read_bytes()
    for loaded, saved in zip(_load(str(tmp_path / "fixed"), fixed_results), TENSORS):
        assert torch.equal(loaded, saved)


def test_a_save_with_a_stream_extension_still_goes_through_it(clean_install, tmp_path):
    clean_install.install(["compat.cpu", "item_stream"])
    _write(str(tmp_path / "plain"), _StorageWriterTransforms())  # the one class is built
    _Counting.wrapped = 0
    results, _ = _write(str(tmp_path / "extended"), _StorageWriterTransforms([_Counting()]))
    assert _Counting.wrapped == len(TENSORS)
    assert all(r.storage_data.transform_descriptors == ["mcf-test-counting/1"] for r in results)
