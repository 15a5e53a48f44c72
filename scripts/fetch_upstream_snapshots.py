"""Bring the upstream snapshot folders the tests need: from ``shared/upstream`` when it is
there, otherwise from GitHub, one pinned commit at a time.

The tests run upstream's own files (``scripts/upstream_snapshots.py``). CI has them in
``shared/upstream`` beside the checkout; a user's clone does not, and cloning Megatron-LM by
hand to ``git archive`` six commits is the step a user should not have to do. For each
snapshot that its folder's ``SHA256SUMS`` does not list (every one of a new folder; one
pinned since an earlier fetch), this downloads GitHub's archive of the pinned commit
(``scripts/upstream_pins.py``), keeps it only if it holds that commit's pinned files,
repacks it in the shared tarball's layout and adds it to ``SHA256SUMS`` last, once the
folder's snapshots are all there. A snapshot already repacked by an interrupted run is kept.

Where: the folder ``MCF_UPSTREAM_SNAPSHOTS`` names (its siblings for the other systems); else
nothing to do when ``../shared/upstream/megatron-lm`` is there; else
``~/.cache/megatron-ckpt-fixes/upstream/megatron-lm`` (``upstream_snapshots.fetched_dir``),
where ``upstream_snapshots`` looks next. ``MCF_UPSTREAM_ARCHIVE_URL`` replaces the GitHub URL
(a template with ``{repo}`` and ``{commit}``) for a mirror.

Where GitHub cannot be reached, each missing commit gets one line naming it, its URL and the
path to put that file at (downloaded elsewhere); a run then takes it from there, checked
the same way.

    python scripts/fetch_upstream_snapshots.py    # bash scripts/install_test_deps.sh runs it
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upstream_snapshots  # noqa: E402 - scripts/ is not a package
from upstream_pins import PINS, ArchiveMismatch, Pin, repack  # noqa: E402

URL_ENV = "MCF_UPSTREAM_ARCHIVE_URL"
#: GitHub's ``git archive`` of a commit (where github.com/REPO/archive/COMMIT.tar.gz leads).
GITHUB_URL = "https://codeload.github.com/{repo}/tar.gz/{commit}"
#: Seconds without a byte before a download counts as unreachable (per commit: where a
#: firewall drops packets, the six lines come after two minutes, not six).
TIMEOUT_S = 20


class FetchFailed(RuntimeError):
    """A pinned commit could not be brought; the message says where to put it by hand."""


def folders() -> dict[str, Path]:
    """Snapshot folder name -> where it is, or is to be fetched (see the module's docstring)."""
    try:
        megatron_lm = upstream_snapshots.snapshots_dir()
    except upstream_snapshots.SnapshotMissing:
        megatron_lm = Path(os.environ.get(upstream_snapshots.SNAPSHOTS_ENV)
                           or upstream_snapshots.fetched_dir())
    return {name: megatron_lm if name == "megatron-lm" else megatron_lm.parent / name
            for name in PINS}


def tarball_names(name: str) -> dict[str, str]:
    """Ref -> tarball name of the snapshot folder ``name``."""
    if name == "megatron-lm":
        return upstream_snapshots.TARBALLS
    return upstream_snapshots.SETS[name].tarballs


def by_hand(pin: Pin, folder: Path) -> Path:
    """Where a user puts GitHub's archive of ``pin`` downloaded elsewhere (GitHub's own file
    name for it)."""
    return folder / f"{pin.repo.split('/')[1]}-{pin.commit}.tar.gz"


def url(pin: Pin) -> str:
    """The archive URL of ``pin``: GitHub's, or the mirror's of :data:`URL_ENV`."""
    return (os.environ.get(URL_ENV) or GITHUB_URL).format(repo=pin.repo, commit=pin.commit)


def fetch(pin: Pin, dest: Path) -> None:
    """Write the snapshot tarball ``dest`` of ``pin``: from the archive put by hand
    (:func:`by_hand`) when there, else downloaded; checked by ``upstream_pins.repack``."""
    placed = by_hand(pin, dest.parent)
    if placed.is_file():
        repack(placed, pin, dest, str(placed))
        return
    download = dest.with_name(f".{placed.name}.download")
    try:
        try:
            with open(download, "wb") as out, \
                    urllib.request.urlopen(url(pin), timeout=TIMEOUT_S) as response:
                shutil.copyfileobj(response, out, 1 << 20)
        except (OSError, http.client.HTTPException, ValueError) as error:
            raise FetchFailed(
                f"cannot fetch {pin.repo} commit {pin.commit} from {url(pin)} ({error}): "
                f"download it where GitHub can be reached, put it at {placed} and run "
                f"this again") from None
        repack(download, pin, dest, f"the archive from {url(pin)}")
    finally:
        download.unlink(missing_ok=True)


def unlisted(name: str, folder: Path) -> list[str]:
    """The refs of snapshot folder ``name`` that its ``SHA256SUMS`` does not list yet (all
    of them without one; a folder fetched before a snapshot was added lacks that one)."""
    sums = folder / "SHA256SUMS"
    text = sums.read_text() if sums.is_file() else ""
    listed = {line.split()[-1].lstrip("*") for line in text.splitlines() if line.strip()}
    return [ref for ref, tarball in tarball_names(name).items() if tarball not in listed]


def bring(name: str, folder: Path, refs: list[str]) -> list[str]:
    """Fetch snapshots ``refs`` of folder ``name`` into ``folder`` and, once all are there,
    add them to its ``SHA256SUMS`` (the lines already there stay: they are what the shared
    or earlier fetched tarballs are checked against); return one error line per commit not
    brought."""
    folder.mkdir(parents=True, exist_ok=True)
    names = tarball_names(name)
    errors = []
    for ref in refs:
        dest = folder / names[ref]
        if dest.is_file():  # repack writes it whole, after its checks, or not at all
            continue
        try:
            fetch(PINS[name][ref], dest)
        except (FetchFailed, ArchiveMismatch) as error:
            errors.append(f"{name} {ref}: {error}")
    if not errors:
        sums = folder / "SHA256SUMS"
        lines = sums.read_text() if sums.is_file() else ""
        for ref in refs:
            with open(folder / names[ref], "rb") as f:
                lines += f"{hashlib.file_digest(f, 'sha256').hexdigest()}  {names[ref]}\n"
        sums.write_text(lines)
    return errors


def main() -> int:
    """Bring every snapshot folder: one line each, one error line per commit not brought."""
    errors = []
    for name, folder in folders().items():
        refs = unlisted(name, folder)
        if not refs:
            print(f"{name}: snapshots at {folder}")
            continue
        try:
            found = bring(name, folder, refs)
        except OSError as error:  # the folder cannot be written
            found = [f"{name}: {error}"]
        if not found:
            print(f"{name}: fetched {len(refs)} pinned commits into {folder}")
        errors += found
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
