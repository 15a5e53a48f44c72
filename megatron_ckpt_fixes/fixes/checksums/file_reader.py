"""Every load checks the whole files it reads (``.metadata``, ``common.pt``, ``metadata.json``)
against the record before it parses them.

- ``FileSystemReader.read_metadata`` (every torch_dist load, megatron-core's cached reader
  included, and this package's own reads of the saved dtypes): the bytes of ``.metadata`` are
  read once, checked, and the *same* bytes are unpickled (served to upstream's
  ``read_metadata`` through its own file system's ``create_stream``).
- ``load_common`` (0.16: ``TorchCommonLoadStrategy``'s method; 0.19+: the module's function,
  for a checkpoint with a ``common.pt``) and ``maybe_load_config`` (``metadata.json``): the
  file's bytes are checked, then upstream reads the file as it always does (a small file,
  read twice: upstream opens it by name).

A file the record does not cover (a record from before file checksums, or no record) is
read as before, and so is every file when the record belongs to another save of the
directory (:func:`.files.belongs`). A mismatch raises :class:`.files.FileChecksumError`; a record that does not
match its own checksum raises :class:`.record.RecordError`, naming the record; the patched
``dist_checkpointing.load`` (``load_errors``) makes either the same one-line error on every
rank. No tensor data is read here.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.core.importers import bound_imports, name_aliases, renamed_imports
from megatron_ckpt_fixes.core.rehearsal import metadata_reads
from megatron_ckpt_fixes.fixes.checksums.file_writer import LOAD_BY_CLASS, LOAD_BY_FUNCTION
from megatron_ckpt_fixes.fixes.checksums.files import COMMON, CONFIG, METADATA, belongs, check_file
from megatron_ckpt_fixes.fixes.checksums.reader import record_of_reader
from megatron_ckpt_fixes.fixes.checksums.record import read_record

_READER = "torch.distributed.checkpoint.filesystem:FileSystemReader"
_COMMON_MODULE = "megatron.core.dist_checkpointing.strategies.common"
_CORE = "megatron.core.dist_checkpointing.core"


class _Serving:
    """A reader's file system that serves ``path`` from bytes already read (and checked);
    everything else goes to the real one."""

    def __init__(self, fs: Any, path: Any, data: bytes) -> None:
        self._fs, self._path, self._data = fs, path, data

    def create_stream(self, path: Any, mode: str) -> Any:
        if path == self._path and mode == "rb":
            return contextlib.nullcontext(io.BytesIO(self._data))
        return self._fs.create_stream(path, mode)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def checked_read_metadata(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``FileSystemReader.read_metadata``: ``.metadata`` checked, then unpickled from
    the bytes checked."""

    @functools.wraps(original)
    def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        record = record_of_reader(self)
        if record is None or METADATA not in record.whole_files or not self.fs.exists(path):
            return original(self, *args, **kwargs)
        with self.fs.create_stream(path, "rb") as stream:
            data = stream.read()
        if os.path.basename(os.fspath(path)) == METADATA and belongs(record, data):
            check_file(record, METADATA, data)
        fs = self.fs
        self.fs = _Serving(fs, path, data)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.fs = fs

    return read_metadata


def _checked_by_name(checkpoint_dir: Any, name: str) -> None:
    """Check the file ``name`` of a local checkpoint directory, when the record covers it."""
    directory = os.fspath(checkpoint_dir)
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return  # upstream says what is missing
    record = read_record(directory)
    if record is None or name not in record.whole_files:
        return
    try:
        with open(os.path.join(directory, METADATA), "rb") as f:
            if not belongs(record, f.read()):
                return
    except FileNotFoundError:
        pass  # judged by the record alone
    with open(path, "rb") as f:
        check_file(record, name, f.read())


def checked_load_common(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``load_common`` (method or function): ``common.pt`` checked before
    ``torch.load``."""

    @functools.wraps(original)
    def load_common(*args: Any, **kwargs: Any) -> Any:
        checkpoint_dir = kwargs.get("checkpoint_dir", args[-1] if args else None)
        if checkpoint_dir is not None:
            _checked_by_name(checkpoint_dir, COMMON)
        return original(*args, **kwargs)

    return load_common


def checked_load_config(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``maybe_load_config``: ``metadata.json`` checked before it is parsed."""

    @functools.wraps(original)
    def maybe_load_config(checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        if checkpoint_dir:
            _checked_by_name(checkpoint_dir, CONFIG)
        return original(checkpoint_dir, *args, **kwargs)

    return maybe_load_config


def _metadata_path_problems() -> list[str]:
    """torch's reader must read ``.metadata`` from the path ``_get_metadata_path`` gives,
    through its ``fs`` (watched while it reads a checkpoint's metadata): the patch serves the
    bytes it checked from there."""
    path, reads = metadata_reads()
    if (path, "rb") in reads:
        return []
    return ["FileSystemReader.read_metadata did not read _get_metadata_path() through its fs: "
            ".metadata would be unpickled unchecked"]


#: The modules that bind ``core.maybe_load_config`` at import time (0.16's ``validation``;
#: read from the source): the patch replaces it there too.
_CONFIG_IMPORTS = bound_imports("megatron.core.dist_checkpointing", _CORE,
                                ("maybe_load_config",))["maybe_load_config"]


def _config_import_problems() -> list[str]:
    return renamed_imports(_CONFIG_IMPORTS, _CORE, "maybe_load_config")


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="checksums.read_metadata",
        target=_READER,
        attr="read_metadata",
        build=checked_read_metadata,
        reads=(f"{_READER}._get_metadata_path",),
        probes=(_metadata_path_problems,),
        why=".metadata is checked against its recorded checksum before it is unpickled",
    ),
    Patch(
        name="checksums.load_common_strategy",
        target=f"{_COMMON_MODULE}:TorchCommonLoadStrategy",
        attr="load_common",
        build=checked_load_common,
        not_needed=LOAD_BY_CLASS,
        why="common.pt (megatron-core 0.16's common state) is checked against its recorded "
            "checksum before torch.load",
    ),
    Patch(
        name="checksums.load_common",
        target=_COMMON_MODULE,
        attr="load_common",
        build=checked_load_common,
        aliases=("megatron.core.dist_checkpointing.serialization",),
        not_needed=LOAD_BY_FUNCTION,
        why="a common.pt (a checkpoint of megatron-core 0.16, loaded by 0.19+) is checked "
            "against its recorded checksum before torch.load",
    ),
    Patch(
        name="checksums.load_config",
        target=_CORE,
        attr="maybe_load_config",
        build=checked_load_config,
        aliases=name_aliases(_CONFIG_IMPORTS, "maybe_load_config"),
        probes=(_config_import_problems,),
        why="metadata.json is checked against its recorded checksum before it is parsed",
    ),
)
