"""Every file a load reads is covered: a changed byte in ``common.pt``, ``.metadata``,
``metadata.json`` or the checksum record fails the load with this package's error, raised
before the file is parsed.

One process (a gloo group of one rank), megatron-core's own save and load. The twin: plain
megatron-core loads a ``common.pt`` whose pickled step was changed (7 -> 8) without a word;
with the fixes the load fails naming ``common.pt`` and its byte range. Two wrong fixes fail
here: checksumming the object pickled in memory instead of the bytes written (the common
state holds an object that pickles differently every time: only the file's bytes match the
record), and checking ``common.pt`` after unpickling it (a garbled archive must give our
error, not torch's unpickling error). megatron-core 0.19+ writes no ``common.pt`` (the
common state is an item, checked as every item is): those cases are skipped there.
"""

from __future__ import annotations

import datetime
import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import xxhash
from ckpt_files import change_bytes

import megatron_ckpt_fixes
from megatron_ckpt_fixes._dev.testing import init_test_group

pytestmark = pytest.mark.varies_with("megatron-core", "torch")

STEP = 7
_pickles = itertools.count()


class PicklesDifferently:
    """An object whose every pickle differs (a counter): the bytes torch.save writes are not
    the bytes of any other pickling of the same state."""

    def __reduce__(self):
        return (str, (f"pickled {next(_pickles)}",))


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    init_test_group(0, 1, f"file://{tmp_path_factory.mktemp('rdzv') / 'f'}",
                    datetime.timedelta(seconds=60))
    yield
    megatron_ckpt_fixes.uninstall()
    dist.destroy_process_group()


def _state(value: float = 1.0) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), value)), "step": STEP}


@pytest.fixture(scope="module")
def saved(group, tmp_path_factory) -> Path:
    from megatron.core import dist_checkpointing as dc

    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install()
    path = tmp_path_factory.mktemp("files") / "ckpt"
    path.mkdir()
    dc.save(_state(), str(path))
    return path


def _copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def _load(path: Path, features: list[str] | None = None):
    """megatron-core's load with ``features`` (None: every fix); the error's text, or the
    loaded state."""
    from megatron.core import dist_checkpointing as dc

    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install(features)
    try:
        return dc.load(_state(0.0), str(path))
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException too
        return exc
    finally:
        megatron_ckpt_fixes.uninstall()


def _record(path: Path) -> dict:
    return json.loads((path / ".checksums.json").read_text())


def _needs_common_pt(path: Path) -> None:
    if not (path / "common.pt").exists():
        pytest.skip("this megatron-core saves the common state as an item (no common.pt)")


def test_each_file_is_recorded_as_its_bytes_on_disk(group, tmp_path):
    """Not a re-pickle: the common state pickles differently every time."""
    from megatron.core import dist_checkpointing as dc

    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install()
    dc.save({**_state(), "note": PicklesDifferently()}, str(tmp_path))
    megatron_ckpt_fixes.uninstall()
    files = _record(tmp_path)["whole_files"]
    expected = {".metadata", "metadata.json"} | (
        {"common.pt"} if (tmp_path / "common.pt").exists() else set())
    assert set(files) == expected
    for name, entry in files.items():
        data = (tmp_path / name).read_bytes()
        assert entry == {"length": len(data), "checksum": xxhash.xxh3_64_hexdigest(data)}, name


def test_upstream_loads_a_changed_step_in_common_pt_silently(saved, tmp_path):
    _needs_common_pt(saved)
    path = _copy(saved, tmp_path)
    change_bytes(path / "common.pt", bytes([0x4B, STEP]), bytes([0x4B, STEP + 1]), after=b"step")
    assert _load(path, ["compat.cpu"])["step"] == STEP + 1  # the resume's wrong iteration
    error = _load(path)
    assert isinstance(error, BaseException), error
    size = (path / "common.pt").stat().st_size
    assert f"rank 0: FileChecksumError: common.pt (bytes 0..{size}): checksum mismatch " \
           "(recorded xxh3_64 " in str(error), error


def test_a_garbled_common_pt_is_our_error_not_torchs(saved, tmp_path):
    """Checked before torch.load: the archive torch cannot even open is named by its bytes."""
    _needs_common_pt(saved)
    path = _copy(saved, tmp_path)
    change_bytes(path / "common.pt", b"PK\x03\x04", b"PK\x03\x05")
    upstream = _load(path, ["compat.cpu"])
    assert isinstance(upstream, BaseException) and "FileChecksumError" not in str(upstream)
    error = str(_load(path))
    assert "FileChecksumError: common.pt (bytes 0.." in error, error
    assert "weights_only" not in error and "Unpickl" not in error, error


def test_a_changed_byte_in_metadata_fails_before_it_is_unpickled(saved, tmp_path):
    path = _copy(saved, tmp_path)
    data = (path / ".metadata").read_bytes()
    change_bytes(path / ".metadata", b"w", b"x")  # in the item's name: a missing key, upstream
    assert isinstance(_load(path, ["compat.cpu"]), BaseException)
    error = str(_load(path))
    assert f"rank 0: FileChecksumError: .metadata (bytes 0..{len(data)}): checksum mismatch" \
           in error, error
    assert error.count("checksum mismatch") == 1, error


def test_a_changed_byte_in_metadata_json_fails_before_it_is_parsed(saved, tmp_path):
    path = _copy(saved, tmp_path)
    change_bytes(path / "metadata.json", b"torch_dist", b"torch_disT")
    error = str(_load(path))
    assert "FileChecksumError: metadata.json (bytes 0.." in error, error


def test_a_changed_byte_in_the_record_names_the_record(saved, tmp_path):
    """A changed item checksum in the record: a false item mismatch without the record's own
    checksum; with it, the record is the bad file."""
    path = _copy(saved, tmp_path)
    text = (path / ".checksums.json").read_text()
    value = _record(path)["files"]["__0_0.distcp"]["checksum"][0]
    at = text.index(f'"checksum":["{value}') + len('"checksum":["')
    flipped = "0" if value[0] != "0" else "1"
    (path / ".checksums.json").write_text(text[:at] + flipped + text[at + 1:])
    error = str(_load(path))
    assert "RecordError: .checksums.json is unreadable: it does not match its own checksum" \
           in error, error
    assert "ItemChecksumError" not in error and "FileChecksumError" not in error, error


def test_a_record_from_before_file_checksums_loads_with_items_checked(saved, tmp_path):
    path = _copy(saved, tmp_path)
    doc = _record(path)
    del doc["digest"], doc["whole_files"]
    (path / ".checksums.json").write_text(json.dumps(doc))
    change_bytes(path / "metadata.json", b"torch_dist", b"torch_dist")  # unchanged, unchecked
    loaded = _load(path)
    assert not isinstance(loaded, BaseException), loaded
    assert torch.equal(loaded["w"], torch.full((4, 3), 1.0)) and loaded["step"] == STEP


def test_verify_counts_and_names_the_files(saved, tmp_path):
    from megatron_ckpt_fixes.tools.cli.checks import verify

    report = verify(str(saved))
    assert not report.problems and report.checksums.files == len(_record(saved)["whole_files"])
    path = _copy(saved, tmp_path)
    change_bytes(path / "metadata.json", b"torch_dist", b"torch_disT")
    report = verify(str(path))
    assert any(str(p).startswith("whole file: metadata.json (bytes 0..")
               for p in report.problems), report.problems


def test_megatron_cores_own_edit_of_metadata_keeps_loading(saved, tmp_path):
    """``remove_sharded_tensors`` rewrites ``.metadata`` on purpose: not a changed byte."""
    from megatron.core import dist_checkpointing as dc

    path = _copy(saved, tmp_path)
    (path / "extra.distcp").write_bytes(b"a file of removed keys")
    before = (path / ".metadata").read_bytes()
    megatron_ckpt_fixes.install()
    try:
        dc.remove_sharded_tensors(str(path), "extra")
    except AttributeError as exc:  # megatron-core 0.16 with torch 2.13: FileSystemWriter
        pytest.skip(f"upstream's remove_sharded_tensors fails here: {exc}")  # .metadata_path
    finally:
        megatron_ckpt_fixes.uninstall()
    assert (path / ".metadata").read_bytes() != before and not (path / "extra.distcp").exists()
    loaded = _load(path)
    assert not isinstance(loaded, BaseException), loaded
    assert torch.equal(loaded["w"], torch.full((4, 3), 1.0))


def test_verify_of_an_unreadable_metadata_says_it_is_not_what_was_saved(saved, tmp_path):
    from megatron_ckpt_fixes.tools.cli.checks import Unverifiable, verify

    path = _copy(saved, tmp_path)
    data = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(data[:len(data) // 2])
    with pytest.raises(Unverifiable, match=rf"; \.metadata \(bytes 0\.\.{len(data) // 2}\): "
                                           f"the record says {len(data)} bytes"):
        verify(str(path))
