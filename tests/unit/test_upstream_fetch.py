"""Bringing the upstream snapshots without ``shared/upstream`` (scripts/fetch_upstream_snapshots.py,
scripts/upstream_pins.py): each pinned commit's archive served by a local HTTP server, as
GitHub would serve it, repacked, checked and then extracted by ``upstream_snapshots`` like a
shared snapshot; a tampered, truncated or other-commit archive is refused and nothing is
written; an unreachable server gives one line per commit naming the commit, the URL and the
path to put the file at, and a file put there is taken (checked the same way).

Stdlib only (tarfile, urllib): these vary with Python alone; the pins' digests against the
shared tarballs are static data and run once.
"""

from __future__ import annotations

import dataclasses
import http.server
import io
import os
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from optional_systems import require

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import fetch_upstream_snapshots as fetch  # noqa: E402
import upstream_snapshots  # noqa: E402
from upstream_pins import PINS, ArchiveMismatch, Pin, content_digest  # noqa: E402

pytestmark = pytest.mark.varies_with("python")

COMMIT = "c0ffee" * 6 + "c0ff"
LONG = "sub/" + "deep/" * 22 + "module.py"  # over tar's 100-character name field
#: What the pinned snapshot keeps: path -> bytes, (bytes, mode) or a symlink target.
KEPT: dict[str, bytes | tuple[bytes, int] | str] = {
    "LICENSE": b"Apache-2.0\n", "sub/run.sh": (b"#!/bin/sh\necho ok\n", 0o755),
    "sub/link": "run.sh", LONG: b"x = 1\n"}
#: What GitHub's archive also holds and the snapshot leaves out ("subway" shares a prefix).
LEFT_OUT: dict[str, bytes | tuple[bytes, int] | str] = {
    "README.md": b"# widget\n", "subway.txt": b"no\n", "other/x.py": b"y = 2\n"}


def _archive(top: str, files: dict, commit: str = COMMIT) -> bytes:
    """A gzip'd ``git archive``-like tarball: pax comment = commit, everything under ``top``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT,
                      pax_headers={"comment": commit}) as tar:
        folder = tarfile.TarInfo(top)
        folder.type, folder.mode = tarfile.DIRTYPE, 0o775
        tar.addfile(folder)
        for path, content in files.items():
            info = tarfile.TarInfo(f"{top}/{path}")
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
                continue
            data, info.mode = content if isinstance(content, tuple) else (content, 0o664)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def pin(tmp_path) -> Pin:
    """A pin whose digest is that of a snapshot tarball built apart, in the shared layout."""
    unpinned = Pin("acme/Widget", COMMIT, "widget-c0ffee", ("LICENSE", "sub"), "")
    shared = tmp_path / "shared.tar.gz"
    shared.write_bytes(_archive(unpinned.top, KEPT))
    return dataclasses.replace(unpinned, digest=content_digest(shared, unpinned))


@pytest.fixture
def served(monkeypatch) -> Iterator[dict[str, bytes]]:
    """URL path -> body, served on 127.0.0.1 as the archive URL (``{repo}/{commit}``)."""
    bodies: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = bodies.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    monkeypatch.setenv("no_proxy", "*")
    monkeypatch.setenv(fetch.URL_ENV, f"http://127.0.0.1:{server.server_port}/{{repo}}/{{commit}}")
    yield bodies
    server.shutdown()
    server.server_close()


@pytest.fixture
def target(tmp_path, monkeypatch, pin) -> Path:
    """One snapshot folder, ``megatron-lm`` with the ref ``r``, to be fetched into."""
    folder = tmp_path / "upstream" / "megatron-lm"
    monkeypatch.setenv(upstream_snapshots.SNAPSHOTS_ENV, str(folder))
    monkeypatch.setenv(upstream_snapshots.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(fetch, "PINS", {"megatron-lm": {"r": pin}})
    monkeypatch.setattr(upstream_snapshots, "TARBALLS", {"r": "widget-r.tar.gz"})
    return folder


def _github(pin: Pin, files: dict | None = None, commit: str = COMMIT) -> bytes:
    return _archive(f"Widget-{pin.commit}", files or {**KEPT, **LEFT_OUT}, commit)


def test_a_fetched_snapshot_is_extracted_like_a_shared_one(pin, served, target, capsys):
    served[f"/acme/Widget/{COMMIT}"] = _github(pin)
    assert fetch.main() == 0
    assert capsys.readouterr().out == f"megatron-lm: fetched 1 pinned commits into {target}\n"
    assert upstream_snapshots.snapshots_dir() == target
    tree = upstream_snapshots.snapshot("r") / "widget-c0ffee"
    assert sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if not p.is_dir()) \
        == sorted(KEPT)
    assert os.access(tree / "sub/run.sh", os.X_OK) and not os.access(tree / "LICENSE", os.X_OK)
    assert os.readlink(tree / "sub/link") == "run.sh"
    assert (tree / LONG).read_bytes() == b"x = 1\n"
    assert fetch.main() == 0  # a second run finds the folder complete and fetches nothing
    assert capsys.readouterr().out == f"megatron-lm: snapshots at {target}\n"


@pytest.mark.parametrize("served_files, commit, refusal", [
    ({**KEPT, "sub/run.sh": (b"#!/bin/sh\necho pwned\n", 0o755)}, COMMIT,
     "holds other files than acme/Widget commit"),
    ({k: v for k, v in KEPT.items() if k != LONG}, COMMIT, "holds other files"),
    (KEPT, "badc0de" * 5 + "badc0", f"is an archive of commit {'badc0de' * 5}badc0, not"),
], ids=["altered-file", "missing-file", "other-commit"])
def test_an_archive_that_is_not_the_pinned_tree_is_refused(pin, served, target, capsys,
                                                          served_files, commit, refusal):
    served[f"/acme/Widget/{COMMIT}"] = _github(pin, served_files, commit)
    assert fetch.main() == 1
    error = capsys.readouterr().err
    assert error.startswith("error: megatron-lm r: the archive from http://") and refusal in error
    assert error.count("\n") == 1
    assert list(target.iterdir()) == []
    with pytest.raises(upstream_snapshots.SnapshotMissing, match="fetch_upstream_snapshots"):
        upstream_snapshots.snapshots_dir()


def test_a_truncated_download_is_refused(pin, served, target, capsys):
    whole = _github(pin)
    served[f"/acme/Widget/{COMMIT}"] = whole[:len(whole) // 2]
    assert fetch.main() == 1
    assert "is damaged" in capsys.readouterr().err
    assert list(target.iterdir()) == []


def test_unreachable_github_gives_one_line_per_commit_and_takes_the_file_put_there(
        pin, target, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(fetch.URL_ENV, "http://127.0.0.1:1/{repo}/{commit}")  # refused
    monkeypatch.setitem(fetch.PINS["megatron-lm"], "s", dataclasses.replace(pin, commit="e" * 40))
    monkeypatch.setitem(upstream_snapshots.TARBALLS, "s", "widget-s.tar.gz")
    assert fetch.main() == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    for line, commit in zip(lines, (COMMIT, "e" * 40)):
        url = f"http://127.0.0.1:1/acme/Widget/{commit}"
        assert f"cannot fetch acme/Widget commit {commit} from {url} (" in line
        assert line.endswith(f"put it at {target / f'Widget-{commit}.tar.gz'} and run this again")
    (target / f"Widget-{COMMIT}.tar.gz").write_bytes(_github(pin))
    (target / f"Widget-{'e' * 40}.tar.gz").write_bytes(_github(pin, commit="e" * 40))
    assert fetch.main() == 0
    assert (upstream_snapshots.snapshot("s") / "widget-c0ffee" / "LICENSE").is_file()


def test_a_snapshot_pinned_after_a_fetch_is_added_to_the_folder(pin, served, target, capsys):
    served[f"/acme/Widget/{COMMIT}"] = _github(pin)
    assert fetch.main() == 0
    listed = (target / "SHA256SUMS").read_text()
    later = dataclasses.replace(pin, commit="e" * 40)
    fetch.PINS["megatron-lm"]["s"] = later  # the fixtures' dicts, fresh per test
    upstream_snapshots.TARBALLS["s"] = "widget-s.tar.gz"
    served[f"/acme/Widget/{'e' * 40}"] = _github(later, commit="e" * 40)
    capsys.readouterr()
    assert fetch.main() == 0
    assert capsys.readouterr().out == f"megatron-lm: fetched 1 pinned commits into {target}\n"
    assert (target / "SHA256SUMS").read_text().startswith(listed)  # r's line is kept as it was
    assert (upstream_snapshots.snapshot("s") / "widget-c0ffee" / "LICENSE").is_file()


def test_the_default_url_is_githubs_archive_of_the_commit(monkeypatch):
    monkeypatch.delenv(fetch.URL_ENV, raising=False)
    pin = PINS["megatron-lm"]["core_v0.16.1"]
    assert fetch.url(pin) == f"https://codeload.github.com/NVIDIA/Megatron-LM/tar.gz/{pin.commit}"


def test_without_shared_upstream_the_fetched_folder_is_looked_in(tmp_path, monkeypatch):
    monkeypatch.delenv(upstream_snapshots.SNAPSHOTS_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(upstream_snapshots, "DEFAULT_SNAPSHOTS", tmp_path / "no-shared")
    fetched = tmp_path / ".cache/megatron-ckpt-fixes/upstream/megatron-lm"
    assert fetch.folders() == {"megatron-lm": fetched,
                               "megatron-lite": fetched.parent / "megatron-lite",
                               "torcheasyrec": fetched.parent / "torcheasyrec"}
    with pytest.raises(upstream_snapshots.SnapshotMissing,
                       match=f"no Megatron-LM snapshots at {tmp_path / 'no-shared'} or "
                             f"{fetched} .*python scripts/fetch_upstream_snapshots.py"):
        upstream_snapshots.snapshots_dir()
    fetched.mkdir(parents=True)
    (fetched / "SHA256SUMS").write_text("")
    assert upstream_snapshots.snapshots_dir() == fetched


def test_every_snapshot_has_a_pin():
    assert {name: set(refs) for name, refs in PINS.items()} == {
        "megatron-lm": set(upstream_snapshots.TARBALLS),
        **{name: set(s.tarballs) for name, s in upstream_snapshots.SETS.items()}}


@pytest.mark.varies_with()
@pytest.mark.parametrize("name, ref", [(n, r) for n, refs in PINS.items() for r in refs])
def test_the_pins_hold_for_the_shared_snapshots(name, ref):
    """Each pin's commit and content digest are those of the shared tarball."""
    require({"megatron-lite": "mlite", "torcheasyrec": "tzrec"}.get(name, "megatron-lm"))
    tarball = fetch.folders()[name] / fetch.tarball_names(name)[ref]
    assert content_digest(tarball, PINS[name][ref]) == PINS[name][ref].digest


def test_a_damaged_shared_tarball_is_not_digested(pin, tmp_path):
    tarball = tmp_path / "shared.tar.gz"
    tarball.write_bytes(b"not gzip")
    with pytest.raises(ArchiveMismatch, match="is not a tar.gz archive"):
        content_digest(tarball, pin)
