"""Several DCP checkpoints read as one, under key prefixes, without copying a byte.

Some trainers save one model as several DCP checkpoints: TorchEasyRec writes
``model.state_dict()`` to ``<ckpt>/model`` and ``optimizer.state_dict()`` to
``<ckpt>/optimizer``. A managed-collision table's embedding rows live in the first and its
optimizer rows in the second, and moving the table by value needs both at once (every
entry's rows move together). A *view* is a folder holding a ``.metadata`` that lists the
chosen keys of each part under ``<prefix>.<key>``, its storage entries pointing into
``<prefix>/<file>``, and one symlink ``<prefix>`` per part to that part's folder. DCP's
``FileSystemReader`` (and anything that resolves a storage entry's relative path against
the checkpoint folder) then reads it like a checkpoint saved from ``{prefix: state_dict}``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

METADATA_FILE = ".metadata"


@dataclass(frozen=True)
class Part:
    """One checkpoint of the view: its folder and metadata, and the saved key each view key
    reads (``{key: saved key}``: the view holds ``<prefix>.<key>``)."""

    path: str
    metadata: Metadata
    keys: Mapping[str, str]


def read_metadata(path: str) -> Metadata:
    return FileSystemReader(path).read_metadata()


def view_metadata(parts: Mapping[str, Part]) -> Metadata:
    """The metadata of a view of ``parts`` (``{prefix: part}``): pure."""
    state: dict = {}
    storage: dict = {}
    for prefix, part in parts.items():
        entries: dict[str, list[tuple[MetadataIndex, object]]] = {}
        for index, info in part.metadata.storage_data.items():
            entries.setdefault(index.fqn, []).append((index, info))
        for key, saved in part.keys.items():
            name = f"{prefix}.{key}"
            state[name] = part.metadata.state_dict_metadata[saved]
            for index, info in entries.get(saved, []):
                storage[MetadataIndex(name, index.offset, index.index)] = dataclasses.replace(
                    info, relative_path=f"{prefix}/{info.relative_path}")
    first = next(iter(parts.values()), None)
    return Metadata(state, planner_data={}, storage_data=storage,
                    version=first.metadata.version if first else None)


def write_view(folder: str | os.PathLike, parts: Mapping[str, Part]) -> str:
    """Make ``folder`` (existing, empty) a view of ``parts``; returns it as a checkpoint id."""
    root = Path(folder)
    for prefix, part in parts.items():
        (root / prefix).symlink_to(Path(part.path).resolve(), target_is_directory=True)
    with open(root / METADATA_FILE, "wb") as f:
        pickle.dump(view_metadata(parts), f)
    return str(root)
