"""Inspect and verify torch_dist checkpoints without loading them.

``verify`` answers "will this checkpoint load?" from the files alone: every tensor's chunks
must tile its global shape exactly, every chunk and object must have a storage entry, and
every storage entry must point inside an existing file. ``inspect`` lists what is in it.

    megatron-ckpt-fixes inspect CKPT_DIR
    megatron-ckpt-fixes verify CKPT_DIR      # exit code 1 if anything is wrong
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)


@dataclass(frozen=True)
class Problem:
    key: str
    cause: str

    def __str__(self) -> str:
        return f"{self.key}: {self.cause}"


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in
               zip(a.offsets, a.sizes, b.offsets, b.sizes))


def _tensor_problems(key: str, md: TensorStorageMetadata) -> list[Problem]:
    problems = []
    total = math.prod(md.size)
    covered = 0
    for chunk in md.chunks:
        if any(o < 0 or o + s > g for o, s, g in zip(chunk.offsets, chunk.sizes, md.size)):
            problems.append(Problem(key, f"chunk at {tuple(chunk.offsets)} of size "
                                         f"{tuple(chunk.sizes)} exceeds shape {tuple(md.size)}"))
        covered += math.prod(chunk.sizes)
    chunks = sorted(md.chunks, key=lambda c: tuple(c.offsets))
    for i, a in enumerate(chunks):
        for b in chunks[i + 1:]:
            if b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
            if _overlap(a, b):
                problems.append(Problem(key, f"chunks at {tuple(a.offsets)} and "
                                             f"{tuple(b.offsets)} overlap"))
    if covered != total and not problems:
        problems.append(Problem(key, f"chunks cover {covered} of {total} elements"))
    return problems


def verify(metadata: Metadata, checkpoint_dir: str) -> list[Problem]:
    """Every reason the checkpoint at ``checkpoint_dir`` would not load completely."""
    problems: list[Problem] = []
    storage = metadata.storage_data or {}
    sizes: dict[str, int | None] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            problems += _tensor_problems(key, md)
            indices = [MetadataIndex(key, chunk.offsets) for chunk in md.chunks]
        else:
            assert isinstance(md, BytesStorageMetadata)
            indices = [MetadataIndex(key)]
        for index in indices:
            info = storage.get(index)
            if info is None:
                problems.append(Problem(key, f"no storage entry for chunk {index.offset}"))
                continue
            path = os.path.join(checkpoint_dir, info.relative_path)
            if info.relative_path not in sizes:
                sizes[info.relative_path] = os.path.getsize(path) if os.path.exists(path) else None
            size = sizes[info.relative_path]
            if size is None:
                problems.append(Problem(key, f"file {info.relative_path} is missing"))
            elif info.offset + info.length > size:
                problems.append(Problem(key, f"{info.relative_path} ends at {size} bytes, "
                                             f"entry needs {info.offset + info.length}"))
    return problems


def _inspect(metadata: Metadata) -> None:
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            print(f"{key}  tensor {tuple(md.size)} {md.properties.dtype}  {len(md.chunks)} chunk(s)")
        else:
            print(f"{key}  object")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-ckpt-fixes", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["inspect", "verify"])
    parser.add_argument("checkpoint_dir")
    args = parser.parse_args(argv)
    metadata = FileSystemReader(args.checkpoint_dir).read_metadata()
    if args.command == "inspect":
        _inspect(metadata)
        return 0
    problems = verify(metadata, args.checkpoint_dir)
    for problem in problems:
        print(f"PROBLEM {problem}")
    print(f"{args.checkpoint_dir}: {len(metadata.state_dict_metadata)} keys, "
          f"{'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
