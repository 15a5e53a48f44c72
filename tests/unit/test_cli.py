"""verify checks everything a load needs, from the files alone; one test per check.

Checks: .metadata readable; each tensor's chunks inside its shape, not overlapping, covering
it; a storage entry per chunk/object, inside an existing data file; megatron-core's
metadata.json; the common state (common.pt, or the common_state object of >= 0.19); the
checksums recorded at save time. Before, verify exited 0 on a deleted common.pt, a deleted
metadata.json and a flipped byte, and printed a traceback without .metadata.

For real checkpoints: a damaged data file is one PROBLEM line with the count of items it
breaks, then at most ``--items`` of them (before: one line per item, thousands on a real
model); ``inspect`` exits 1 with a one-line hint on a file shorter than its entries need
(before: exit 0); a plain torch DCP checkpoint is recognised without ``--dcp`` (before:
"metadata.json: missing"); verify shows its progress on stderr (before: silence).
"""

from __future__ import annotations

import datetime
import hashlib
import inspect
import io
import json
import re
import shutil
from importlib.metadata import version

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckpt_files import flip_tensor_byte, read_metadata, rerecord, storage_entry, write_metadata
from packaging.version import Version
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import megatron_ckpt_fixes
from megatron_ckpt_fixes.fixes.checksums import SIDECAR
from megatron_ckpt_fixes.tools.cli import main, progress

W = torch.arange(12.0).reshape(3, 4)


def _state():
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    return {"w": ShardedTensor.from_rank_offsets("w", W.clone()),
            "obj": ShardedObject("obj", {"step": 3}, (1,), (0,)),
            "iteration": 3}


def _integrity_flag() -> str | None:
    """``dist_checkpointing.save``'s flag for megatron-core's integrity manifest (0.19 on)."""
    from megatron.core import dist_checkpointing

    params = inspect.signature(dist_checkpointing.save).parameters
    return next((n for n in ("verify_integrity", "save_integrity") if n in params), None)


def _write_manifest_as_megatron_core_0_19(ckpt) -> None:
    """integrity.json in the format megatron-core 0.19 defines (validation.py's
    save_integrity_manifest): every other file of the directory, sorted, with its SHA-256."""
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(ckpt.iterdir(), key=str)
             if p.is_file() and p.name != "integrity.json"}
    (ckpt / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": files},
                                                    indent=2))


#: Tensors of the "many" checkpoint, all in one data file.
MANY = 30


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A megatron-core checkpoint with checksums ("ckpt"), one without ("plain"), one with
    checksums and megatron-core's integrity manifest ("manifest"; written by megatron-core
    where the release has the option, in its format otherwise), and plain torch DCP
    checkpoints ("dcp"; "many": :data:`MANY` tensors in one file)."""
    from megatron.core import dist_checkpointing

    root = tmp_path_factory.mktemp("cli")
    dist.init_process_group("gloo", init_method=f"file://{root / 'rdzv'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    flag = _integrity_flag()
    try:
        for name, features, manifest in (
                ("ckpt", None, False),
                ("plain", [f for f in megatron_ckpt_fixes.FEATURES if f != "checksums"], False),
                ("manifest", None, True)):
            megatron_ckpt_fixes.uninstall()
            megatron_ckpt_fixes.install(features)
            (root / name).mkdir()
            dist_checkpointing.save(_state(), str(root / name),
                                    **({flag: True} if manifest and flag else {}))
            if manifest and not flag:
                _write_manifest_as_megatron_core_0_19(root / name)
        dcp.save({"w": W.clone(), "obj": {"step": 3}}, checkpoint_id=str(root / "dcp"))
        dcp.save({f"t{i}": torch.full((64,), float(i)) for i in range(MANY)},
                 checkpoint_id=str(root / "many"))
    finally:
        megatron_ckpt_fixes.uninstall()
        dist.destroy_process_group()
    return root


@pytest.fixture
def ckpt(saved, tmp_path):
    """A fresh copy of the checksummed megatron-core checkpoint, to damage."""
    return shutil.copytree(saved / "ckpt", tmp_path / "ckpt")


def _verify(capsys, path, *flags) -> tuple[int, list[str], str]:
    code = main(["verify", *flags, str(path)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def _problems(lines: list[str]) -> list[str]:
    return [line.removeprefix("PROBLEM ") for line in lines if line.startswith("PROBLEM ")]


def _item_lines(lines: list[str]) -> list[str]:
    """The items listed under a damaged file's PROBLEM line."""
    return [line.removeprefix("  ") for line in lines if line.startswith("  ")]


def _files(ckpt) -> set[str]:
    return {info.relative_path for info in read_metadata(ckpt).storage_data.values()}


def _items_in(ckpt, file: str) -> list:
    return [info for info in read_metadata(ckpt).storage_data.values()
            if info.relative_path == file]


def test_a_complete_checkpoint_verifies(ckpt, capsys):
    code, lines, err = _verify(capsys, ckpt)
    assert code == 0 and not _problems(lines), lines
    # stderr is no terminal here: one plain progress line at the end, no bar
    assert [line for line in err.splitlines() if re.fullmatch(
        r"verify: \d+\.\d\d GiB read in \d+\.\d s \(\d+\.\d\d GiB/s\)", line)], err
    assert "\r" not in err
    items = len(read_metadata(ckpt).storage_data)
    files = sum((ckpt / name).exists() for name in ("common.pt", ".metadata", "metadata.json"))
    assert (f"checksums: {items} of {items} item(s) match their xxh3_64 checksums; {files} of "
            f"{files} whole file(s) (common state, metadata) match") in lines, lines
    assert lines[-1].endswith(f"keys, OK (checked: the layout of {items} item(s), the bytes of "
                              f"{items} item(s) and {files} file(s) by .checksums.json; keys "
                              "not compared with a model)"), lines
    assert _verify(capsys, ckpt, "--strict")[0] == 0  # every byte had a record
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{ckpt}: torch_dist checkpoint, {len(read_metadata(ckpt).state_dict_metadata)} keys"
    assert out[1].split() == ["key", "kind", "shape", "dtype", "chunks"]
    assert ["w", "tensor", "(3,", "4)", "float32", "1"] in [line.split() for line in out]
    assert ["obj/shard_0_1", "object"] in [line.split() for line in out]
    assert out[-1].startswith("total: ") and " tensors (" in out[-1] and "elements in" in out[-1]
    assert "stored in" in out[-1] and "data file(s)" in out[-1]


def _save_dir(ckpt, tmp_path, iterations=(3, 6), tracker: int | None = 6):
    """A training job's --save directory: iter_* copies of ``ckpt`` and its tracker."""
    root = tmp_path / "save"
    for i in iterations:
        shutil.copytree(ckpt, root / f"iter_{i:07d}")
    if tracker is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(f"{tracker}\n")
    return root


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_save_directory_means_the_checkpoint_its_tracker_names(ckpt, tmp_path, capsys, command):
    root = _save_dir(ckpt, tmp_path)
    shutil.rmtree(root / "iter_0000003" / "common.pt", ignore_errors=True)
    (root / "iter_0000003" / ".metadata").unlink()  # not the one the tracker names
    assert main([command, str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"{root} is a save directory: using iteration 6 ({root / 'iter_0000006'}),"
                      " the one its latest_checkpointed_iteration.txt names")
    assert str(root / "iter_0000006") in out[-1 if command == "verify" else 1]


def test_a_save_directory_without_tracker_names_its_checkpoints(ckpt, tmp_path, capsys):
    root = _save_dir(ckpt, tmp_path, iterations=(1, 2, 3, 4, 5), tracker=None)
    assert main(["verify", str(root)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"megatron-ckpt-fixes verify: {root}: no .metadata file: a save directory without "
        "latest_checkpointed_iteration.txt; name one of its checkpoints: iter_0000001, "
        "iter_0000002, iter_0000003 and 2 more\n")


def test_help_does_not_import_torch():
    """``--help`` answers at once: torch (seconds to import) is imported by the commands only."""
    import subprocess
    import sys

    code = ("import sys\nfrom megatron_ckpt_fixes.tools.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in sys.modules if m == 'torch' "
            "or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: megatron-ckpt-fixes" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("damage, says", [
    (lambda p: (p / ".metadata").unlink(), "no .metadata file: not a torch_dist checkpoint"),
    (lambda p: (p / ".metadata").write_bytes(b"not a pickle"), ".metadata is unreadable"),
    (lambda p: shutil.rmtree(p), "no such directory"),
])
@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_unverifiable_directory_is_one_line_and_exit_1(ckpt, capsys, damage, says, command):
    damage(ckpt)
    assert main([command, str(ckpt)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and says in err, err
    assert "Traceback" not in err


def test_a_chunk_outside_the_shape(ckpt, capsys):
    md = read_metadata(ckpt)
    md.state_dict_metadata["w"].size = torch.Size([2, 4])
    write_metadata(ckpt, md)
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1 and "w: chunk at (0, 0) of size (3, 4) exceeds shape (2, 4)" in lines[0]


def test_overlapping_chunks(ckpt, capsys):
    md = read_metadata(ckpt)
    md.state_dict_metadata["w"].chunks.append(
        ChunkStorageMetadata(offsets=torch.Size([1, 0]), sizes=torch.Size([2, 4])))
    write_metadata(ckpt, md)
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1
    assert _problems(lines) == ["w: chunks at (0, 0) and (1, 0) overlap",
                                "w: no storage entry for chunk at (1, 0)"]


def test_chunks_that_do_not_cover_the_shape(ckpt, capsys):
    md = read_metadata(ckpt)
    md.state_dict_metadata["w"].size = torch.Size([4, 4])
    write_metadata(ckpt, md)
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1 and _problems(lines) == ["w: chunks cover 12 of 16 elements"]


def test_a_missing_storage_entry(ckpt, capsys):
    md = read_metadata(ckpt)
    del md.storage_data[next(i for i in md.storage_data if i.fqn == "obj/shard_0_1")]
    write_metadata(ckpt, md)
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1 and _problems(lines) == ["obj/shard_0_1: no storage entry"]


def test_missing_and_truncated_data_files(ckpt, capsys):
    info = storage_entry(ckpt, "w")
    file, cut = info.relative_path, info.offset + 8
    entries = _items_in(ckpt, file)
    broken = sum(e.offset + e.length > cut for e in entries)
    need = max(e.offset + e.length for e in entries)
    with open(ckpt / file, "r+b") as f:
        f.truncate(cut)
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1 and _problems(lines) == [
        f"{file}: ends at {cut} bytes, its entries need {need}: breaks {broken} of its "
        f"{len(entries)} item(s)"]
    assert (f"w: {file} ends at {cut} bytes, its entry needs {info.offset + info.length} "
            "(chunk at (0, 0))") in _item_lines(lines)
    assert main(["inspect", str(ckpt)]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("total: ")
    assert err == (f"megatron-ckpt-fixes inspect: {file}: ends at {cut} bytes, its entries need "
                   f"{need} (1 of {len(_files(ckpt))} data file(s) too short or missing): "
                   f"megatron-ckpt-fixes verify {ckpt} names the items that cannot load\n")
    (ckpt / file).unlink()
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1 and f"{file}: missing: breaks {len(entries)} of its {len(entries)} " \
                         "item(s)" in _problems(lines)
    assert f"w: data file {file} is missing (chunk at (0, 0))" in _item_lines(lines)


@pytest.mark.parametrize("content, says", [
    (None, "metadata.json: missing: megatron-core's load refuses a directory without it"),
    ("{not json", "metadata.json: unreadable: JSONDecodeError"),
    (json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}),
     "metadata.json: sharded backend 'zarr'"),
])
def test_megatron_metadata_json(ckpt, capsys, content, says):
    if content is None:
        (ckpt / "metadata.json").unlink()
    else:
        (ckpt / "metadata.json").write_text(content)
        rerecord(ckpt, "metadata.json")  # as a save that wrote it so
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1 and len(_problems(lines)) == 1 and _problems(lines)[0].startswith(says)


def test_common_state_that_cannot_be_loaded(ckpt, capsys):
    """megatron-core 0.16 keeps the common state in common.pt; 0.19 writes it as the
    ``common_state`` object (and still reads a legacy common.pt first)."""
    if (ckpt / "common.pt").exists():
        (ckpt / "common.pt").unlink()
        code, lines, _ = _verify(capsys, ckpt)
        assert code == 1 and len(_problems(lines)) == 1
        assert _problems(lines)[0].startswith("common state: cannot be loaded: common.pt is "
                                              "absent and megatron-core's load fails without it")
    else:
        info = storage_entry(ckpt, "common_state/shard_0_1")
        with open(ckpt / info.relative_path, "r+b") as f:
            f.seek(info.offset)
            f.write(bytes(info.length))
        code, lines, _ = _verify(capsys, ckpt)
        assert code == 1
        assert _problems(lines)[0].startswith("common state: cannot be loaded:"), lines
    (ckpt / "common.pt").write_bytes(b"garbage")  # read first by both versions
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1 and _problems(lines)[0].startswith("common state: cannot be loaded: "
                                                        "UnpicklingError")


def test_a_flipped_byte_is_named_with_key_and_file(ckpt, capsys):
    """Every other check passes on this checkpoint: only the checksum sees the flip."""
    file = flip_tensor_byte(ckpt, "w", (0, 0))
    info = storage_entry(ckpt, "w")
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1
    assert _problems(lines) == [f"{file}: bytes differ from the checksum record: breaks 1 of "
                                f"its {len(_items_in(ckpt, file))} item(s)"]
    [problem] = _item_lines(lines)
    assert problem.startswith("w: checksum mismatch (recorded xxh3_64 ")
    assert problem.endswith(f"in {file} at bytes {info.offset}..{info.offset + info.length} "
                            "(chunk at (0, 0))")
    items = len(read_metadata(ckpt).storage_data)
    assert any(line.startswith(f"checksums: {items - 1} of {items} item(s) match their "
                               "xxh3_64 checksums, 1 do not; ") for line in lines), lines


def test_without_checksums_verify_says_absent(saved, capsys):
    code, lines, _ = _verify(capsys, saved / "plain")
    assert code == 0 and "checksums: absent (.checksums.json missing: saved without the " \
                         "checksums feature)" in lines
    assert "records checked: none (no checksums recorded for this save, no integrity.json): " \
           "its bytes were not checked" in lines


def test_strict_fails_where_bytes_could_not_be_checked(saved, tmp_path, capsys):
    """Issue 31: verify said "OK" for a checkpoint without a record, which
    --ckpt-verify-checksums refuses. Its last line now says what it checked; --strict fails
    naming what it could not check: no record, and a record of another save (a --strict that
    only asks whether a record file exists passes that one)."""
    plain = saved / "plain"
    items = len(read_metadata(plain).storage_data)
    files = [n for n in ("metadata.json", ".metadata", "common.pt") if (plain / n).exists()]
    code, lines, _ = _verify(capsys, plain)
    assert code == 0 and lines[-1].endswith(
        f"OK (checked: the layout of {items} item(s), not their bytes (no record of them); keys "
        "not compared with a model)"), lines
    code, lines, _ = _verify(capsys, plain, "--strict")
    assert code == 1 and lines[-1] == (
        f"megatron-ckpt-fixes verify --strict: not checked: the bytes of {items} item(s) (no "
        "checksum record: .checksums.json missing, saved without the checksums feature) and "
        f"{len(files)} whole file(s) ({', '.join(files)})"), lines
    other = shutil.copytree(plain, tmp_path / "other")
    shutil.copy(saved / "ckpt" / SIDECAR, other / SIDECAR)
    code, lines, _ = _verify(capsys, other, "--strict")
    assert code == 1 and lines[-1].startswith(
        f"megatron-ckpt-fixes verify --strict: not checked: the bytes of {items} item(s) "
        "(.checksums.json belongs to another save of this directory)"), lines


def test_megatron_core_writes_its_integrity_manifest_from_0_19():
    """Where the release has the option, the "manifest" checkpoint's integrity.json is
    megatron-core's own; 0.16 lacks it (the fixture then writes one in 0.19's format)."""
    if Version(version("megatron-core")) >= Version("0.19"):
        assert _integrity_flag() == "verify_integrity"
    else:
        assert _integrity_flag() is None


def test_megatron_cores_integrity_manifest_is_checked(saved, capsys):
    ckpt = saved / "manifest"
    names = sorted(json.loads((ckpt / "integrity.json").read_text())["files"])
    assert names == sorted(p.name for p in ckpt.iterdir() if p.name != "integrity.json")
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 0 and not _problems(lines), lines
    assert (f"integrity.json: {len(names)} of {len(names)} file(s) match their sha256 digests "
            "(megatron-core's integrity manifest)") in lines
    files = sum((ckpt / name).exists() for name in ("common.pt", ".metadata", "metadata.json"))
    assert (f"records checked: .checksums.json (xxh3_64 per item and per file, {files} "
            "file(s)), integrity.json (megatron-core's, sha256 per file)") in lines
    assert _upstream_verdict(ckpt) == ("ok" if _integrity_flag() else None)
    assert _verify(capsys, ckpt, "--strict")[0] == 0


def _upstream_verdict(ckpt) -> str | None:
    """megatron-core's own check of its manifest (0.19 on), or None without one."""
    try:
        from megatron.core.dist_checkpointing.validation import verify_integrity_manifest
    except ImportError:
        return None
    try:
        verify_integrity_manifest(str(ckpt))
    except Exception as exc:  # noqa: BLE001 - the message is the verdict
        return str(exc)
    return "ok"


def test_a_tampered_checkpoint_fails_both_records(saved, tmp_path, capsys):
    """A flipped byte in tensor data: the item's checksum and the file's SHA-256 both
    catch it (and megatron-core's own check agrees, where the release has one); a file the
    manifest names but the directory lacks is named too."""
    ckpt = shutil.copytree(saved / "manifest", tmp_path / "manifest")
    file = flip_tensor_byte(ckpt, "w", (0, 0))
    code, lines, _ = _verify(capsys, ckpt)
    problems = _problems(lines)
    assert code == 1 and len(problems) == 2, problems
    assert problems[0].startswith(f"{file}: bytes differ from the checksum record: breaks 1 ")
    assert _item_lines(lines)[0].startswith("w: checksum mismatch (recorded xxh3_64 ")
    assert problems[1].startswith(f"integrity.json: {file}: sha256 mismatch (recorded ")
    upstream = _upstream_verdict(ckpt)
    if upstream is not None:  # megatron-core's own check names the same file
        assert "hash mismatch" in upstream and file in upstream, upstream
    (ckpt / "metadata.json").unlink()
    code, lines, _ = _verify(capsys, ckpt)
    assert "integrity.json: metadata.json: missing or unreadable (FileNotFoundError: No such " \
           "file or directory)" in _problems(lines)


def test_an_unreadable_manifest_is_a_problem(saved, tmp_path, capsys):
    ckpt = shutil.copytree(saved / "manifest", tmp_path / "manifest")
    (ckpt / "integrity.json").write_text('{"algorithm": "sha256"}')
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1 and _problems(lines) == [
        "integrity.json: not megatron-core's manifest: KeyError: 'files'"]


def test_a_record_of_another_save_is_not_used(saved, tmp_path, capsys):
    other = shutil.copytree(saved / "plain", tmp_path / "other")
    shutil.copy(saved / "ckpt" / SIDECAR, other / SIDECAR)
    code, lines, _ = _verify(capsys, other)
    assert code == 0 and any(line.startswith("checksums: not checked (.checksums.json belongs "
                                             "to another save") for line in lines)


def test_an_unreadable_record_is_a_problem(ckpt, capsys):
    (ckpt / SIDECAR).write_text("{")
    code, lines, _ = _verify(capsys, ckpt)
    assert code == 1 and _problems(lines)[0].startswith(".checksums.json: .checksums.json is "
                                                        "unreadable")


def test_plain_torch_dcp_checkpoint(saved, capsys):
    """Recognised without --dcp (neither metadata.json nor a common state); --dcp still
    works; a megatron-core checkpoint without metadata.json stays one
    (test_megatron_metadata_json)."""
    ok = ("torch DCP checkpoint, 2 keys, OK (checked: the layout of 2 item(s), not their bytes "
          "(no record of them); keys not compared with a model)")
    code, lines, _ = _verify(capsys, saved / "dcp", "--dcp")
    assert code == 0 and lines[-1].endswith(ok), lines
    code, lines, _ = _verify(capsys, saved / "dcp")
    assert code == 0 and lines[-1].endswith(ok), lines
    assert lines[0] == ("no metadata.json and no common state: checked as a plain torch DCP "
                        "checkpoint (--dcp)")
    assert main(["inspect", str(saved / "dcp")]) == 0
    assert capsys.readouterr().out.startswith(f"{saved / 'dcp'}: torch DCP checkpoint, 2 keys")


def test_a_cut_short_file_is_one_line_with_its_item_count(saved, tmp_path, capsys):
    """Half of a file of 30 items cut off: one PROBLEM line counting the items it breaks,
    then the first --items of them and how many more (a line per item before)."""
    ckpt = shutil.copytree(saved / "many", tmp_path / "many")
    [file] = _files(ckpt)
    entries = _items_in(ckpt, file)
    assert len(entries) == MANY
    cut = (ckpt / file).stat().st_size // 2
    with open(ckpt / file, "r+b") as f:
        f.truncate(cut)
    broken = sum(e.offset + e.length > cut for e in entries)
    need = max(e.offset + e.length for e in entries)
    assert 10 < broken < MANY
    for flags, shown in ((), 10), (("--items", "3"), 3), (("--items", str(MANY)), broken):
        code, lines, _ = _verify(capsys, ckpt, *flags)
        assert code == 1 and _problems(lines) == [
            f"{file}: ends at {cut} bytes, its entries need {need}: breaks {broken} of its "
            f"{MANY} item(s)"], lines
        items = _item_lines(lines)
        more = [] if shown == broken else [f"... and {broken - shown} more (--items {broken} "
                                           "lists them all)"]
        assert len(items) == shown + len(more) and items[shown:] == more, items
        assert all(f" ends at {cut} bytes, its entry needs " in i for i in items[:shown])
        assert lines[-1].endswith(f", 1 damaged file(s) breaking {broken} item(s)")


@pytest.mark.varies_with()
@pytest.mark.parametrize("tty", [True, False])
def test_progress_on_a_terminal_is_a_bar_with_gib_per_s(tty):
    """A tqdm bar (carriage returns, GiB and GiB/s) on a terminal; a plain line otherwise."""

    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return tty

    stream = Stream()
    with progress.reading(3 << 30, "verify", True, stream) as advance:
        for _ in range(3):
            advance(1 << 30)
    text = stream.getvalue()
    if tty:
        assert "\r" in text and "100%" in text and "3.00/3.00 GiB" in text, text
        assert re.search(r"\d+\.\d\dGiB/s", text), text
        slow = Stream()  # under 1 GiB/s: tqdm's own rate would say s/GiB
        with progress.reading(3 << 10, "verify", True, slow) as advance:
            advance(3 << 10)
        assert re.search(r" 0\.\d\dGiB/s\]", slow.getvalue()), slow.getvalue()
    else:
        assert re.fullmatch(r"verify: 3\.00 GiB read in \d+\.\d s \(\d+\.\d\d GiB/s\)\n",
                            text), text
    quiet = Stream()
    with progress.reading(3 << 30, "verify", False, quiet) as advance:
        advance(3 << 30)
    assert quiet.getvalue() == ""
