"""Checksums of the whole files a save writes besides the items, taken from the files.

``common.pt`` (megatron-core 0.16's ``save_common``, rank 0, before the items), ``.metadata``
(torch DCP's ``finish``, the coordinator) and ``metadata.json`` (``save_config``, rank 0, after
every item and ``.metadata``) are each written by upstream code that hands the file name to
``torch.save``, ``pickle.dump`` or ``json.dump``: no stream of ours sees the bytes. Each file
is read back right after its writer returns, before the record is finalized, and the checksum
is of those bytes (what the file holds, not a second serialization of the object, which can
differ and would certify bytes nobody wrote). The reads are of small files, from the page
cache.

- ``common.pt``'s checksum waits in this process until the save's ``finish`` writes the record
  (rank 0 is DCP's coordinator: the same process).
- ``.metadata``'s is taken in the patched ``finish`` (:mod:`.writer`), right after upstream's.
- ``metadata.json`` is written after the record: the patched ``save_config`` adds its checksum
  to the record of this save (the record whose ``.metadata`` checksum matches the file).
- megatron-core's ``remove_sharded_tensors`` rewrites ``.metadata`` of a saved checkpoint on
  purpose: the record that covered the old one takes the new one.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.core.agreement import rank_and_size
from megatron_ckpt_fixes.fixes.checksums.files import COMMON, CONFIG, METADATA, read_back
from megatron_ckpt_fixes.fixes.checksums.record import RecordError, read_record, write_record

logger = logging.getLogger(__name__)

_COMMON_MODULE = "megatron.core.dist_checkpointing.strategies.common"
_SERIALIZATION = "megatron.core.dist_checkpointing.serialization"

#: ``realpath(checkpoint_dir) -> (length, checksum)`` of the ``common.pt`` this process wrote,
#: until the save's ``finish`` records it.
_common_written: dict[str, tuple[int, int]] = {}
_lock = threading.Lock()


def _key(checkpoint_dir: Any) -> str:
    return os.path.realpath(os.fspath(checkpoint_dir))


def files_at_finish(checkpoint_dir: str) -> dict[str, tuple[int, int]]:
    """The whole files a save's record covers when ``finish`` writes it: ``.metadata`` (just
    written) and the ``common.pt`` this process wrote for the save, if any."""
    files = {}
    metadata = read_back(os.path.join(checkpoint_dir, METADATA))
    if metadata is not None:
        files[METADATA] = metadata
    with _lock:
        common = _common_written.pop(_key(checkpoint_dir), None)
    if common is not None:
        files[COMMON] = common
    return files


def recording_save_common(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``save_common`` (0.16: ``TorchCommonSaveStrategy``'s method; 0.19+: the module's
    function): the checksum of ``common.pt`` as written, kept for the save's record."""

    @functools.wraps(original)
    def save_common(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        checkpoint_dir = kwargs.get("checkpoint_dir", args[-1] if args else None)
        if rank_and_size()[0] != 0:  # upstream's writer of common.pt
            return
        written = read_back(os.path.join(os.fspath(checkpoint_dir), COMMON))
        with _lock:
            if written is None:
                _common_written.pop(_key(checkpoint_dir), None)
            else:
                _common_written[_key(checkpoint_dir)] = written

    return save_common


def recording_save_config(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``serialization.save_config`` (rank 0, the save's last file): ``metadata.json``
    as written joins the record of this save."""

    @functools.wraps(original)
    def save_config(config: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> None:
        original(config, checkpoint_dir, *args, **kwargs)
        directory = os.fspath(checkpoint_dir)
        try:
            record = read_record(directory)
        except RecordError as exc:
            logger.warning("metadata.json of %s not recorded: %s", directory, exc)
            return
        if record is None or record.whole_files.get(METADATA) != read_back(
                os.path.join(directory, METADATA)):
            return  # saved without checksums, or the record of another save
        written = read_back(os.path.join(directory, CONFIG))
        if written is not None:
            write_record(directory, record.with_files({CONFIG: written}))

    return save_config


def rerecording_removal(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``TorchDistLoadShardedStrategy.remove_sharded_tensors`` (megatron-core's own edit
    of a saved checkpoint: it rewrites ``.metadata`` without the removed keys): a record that
    covered the old ``.metadata`` covers the new one, so the edited checkpoint still loads."""

    @functools.wraps(original)
    def remove_sharded_tensors(self: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> None:
        directory = os.fspath(checkpoint_dir)
        path = os.path.join(directory, METADATA)
        try:
            record = read_record(directory)
        except RecordError:
            record = None  # left as it is: a load names it
        before = read_back(path)
        original(self, checkpoint_dir, *args, **kwargs)
        after = read_back(path)
        if (record is not None and after != before and after is not None
                and record.whole_files.get(METADATA) == before):
            write_record(directory, record.with_files({METADATA: after}))

    return remove_sharded_tensors


def _strategy_classes(name: str, wanted: bool, why: str) -> Callable[[], str | None]:
    """``not_needed`` of a patch of one way to write or read ``common.pt``: megatron-core
    0.16 does it in its strategy class ``name``, 0.19+ (the common state is an item; a legacy
    common.pt only) in module functions. A patch of the way this release does not have is
    not needed (``wanted``: the patch is of the class's method)."""

    def not_needed() -> str | None:
        import importlib

        has_class = hasattr(importlib.import_module(_COMMON_MODULE), name)
        return None if has_class == wanted else why

    return not_needed


_BY_FUNCTIONS = ("no common-state strategy classes here: the common state is saved as an "
                 "item, a legacy common.pt goes through the module's functions")
_BY_CLASSES = "common.pt goes through the common-state strategy classes here"
#: ``not_needed`` of the patches of the strategy classes' methods, and of the functions.
SAVE_BY_CLASS = _strategy_classes("TorchCommonSaveStrategy", True, _BY_FUNCTIONS)
SAVE_BY_FUNCTION = _strategy_classes("TorchCommonSaveStrategy", False, _BY_CLASSES)
LOAD_BY_CLASS = _strategy_classes("TorchCommonLoadStrategy", True, _BY_FUNCTIONS)
LOAD_BY_FUNCTION = _strategy_classes("TorchCommonLoadStrategy", False, _BY_CLASSES)

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="checksums.save_common_strategy",
        target=f"{_COMMON_MODULE}:TorchCommonSaveStrategy",
        attr="save_common",
        build=recording_save_common,
        not_needed=SAVE_BY_CLASS,
        why="common.pt (megatron-core 0.16's common state) is covered by the checksum of "
            "its bytes as written",
    ),
    Patch(
        name="checksums.save_common",
        target=_COMMON_MODULE,
        attr="save_common",
        build=recording_save_common,
        not_needed=SAVE_BY_FUNCTION,
        why="common.pt written by the deprecated save_common (megatron-core 0.19+) is "
            "covered by the checksum of its bytes as written",
    ),
    Patch(
        name="checksums.remove_sharded_tensors",
        target="megatron.core.dist_checkpointing.strategies.torch:TorchDistLoadShardedStrategy",
        attr="remove_sharded_tensors",
        build=rerecording_removal,
        why="a checkpoint edited by megatron-core's remove_sharded_tensors keeps a record of "
            "its new .metadata",
    ),
    Patch(
        name="checksums.save_config",
        target=_SERIALIZATION,
        attr="save_config",
        build=recording_save_config,
        reads=("megatron.core.dist_checkpointing.core:save_config",),
        why="metadata.json is covered by the checksum of its bytes as written",
    ),
)
