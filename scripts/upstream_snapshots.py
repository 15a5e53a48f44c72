"""Megatron-LM source snapshots for the tests and scripts that need upstream's own files.

CI and the development machines cannot reach GitHub. Megatron-LM's training package
(``pretrain_gpt.py``, ``megatron/training``), its functional test cases and megatron-core's
own unit tests come from ``git archive`` tarballs in a snapshots folder (``shared/upstream/
megatron-lm`` beside the checkout, with a ``SHA256SUMS`` file). This module finds that
folder, picks the snapshot that matches the installed megatron-core, and extracts it once
into a cache directory (checked against ``SHA256SUMS`` first).

- ``MCF_UPSTREAM_SNAPSHOTS``: the snapshots folder (default: ``../shared/upstream/megatron-lm``
  next to the repository, where CI puts it).
- ``MCF_SNAPSHOT_CACHE``: where snapshots are extracted (default:
  ``~/.cache/megatron-ckpt-fixes/snapshots``).

A missing folder or tarball raises :class:`SnapshotMissing` with what was looked for and how
to provide it: a test that needs a snapshot fails with that message, it never skips.

:func:`training_tree` is the same snapshot without ``megatron/core``: Megatron-LM's scripts
run with their own directory first on ``sys.path``, so in the full tree ``import
megatron.core`` would find the snapshot's sources instead of the installed megatron-core
(``megatron`` is a namespace package; the training tree beside the wheel imports fine).

    python scripts/upstream_snapshots.py [REF]             # print the extracted tree of REF
    python scripts/upstream_snapshots.py --training [REF]  # ... its training tree
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import tarfile
from importlib.metadata import version as installed_version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SNAPSHOTS_ENV = "MCF_UPSTREAM_SNAPSHOTS"
CACHE_ENV = "MCF_SNAPSHOT_CACHE"
DEFAULT_SNAPSHOTS = REPO.parent / "shared" / "upstream" / "megatron-lm"

#: Snapshot ref -> tarball name in the snapshots folder.
TARBALLS: dict[str, str] = {
    "core_v0.16.1": "megatron-lm-core_v0.16.1.tar.gz",
    "core_v0.19.0": "megatron-lm-core_v0.19.0.tar.gz",
    "main": "megatron-lm-main-d98e8a64.tar.gz",
}
#: megatron-core minor release -> the snapshot whose tests and training package match it.
REF_OF_MINOR: dict[str, str] = {"0.16": "core_v0.16.1", "0.19": "core_v0.19.0",
                                "0.20": "main"}


class SnapshotMissing(RuntimeError):
    """A Megatron-LM snapshot that a test or script needs is not there."""


def snapshots_dir() -> Path:
    """The folder holding the tarballs and ``SHA256SUMS``."""
    folder = Path(os.environ.get(SNAPSHOTS_ENV) or DEFAULT_SNAPSHOTS)
    if not (folder / "SHA256SUMS").is_file():
        raise SnapshotMissing(
            f"no Megatron-LM snapshots at {folder} (no SHA256SUMS there): set {SNAPSHOTS_ENV} "
            "to the folder holding megatron-lm-*.tar.gz and SHA256SUMS (shared/upstream/"
            "megatron-lm beside the checkout in CI)")
    return folder


def ref_for_installed() -> str:
    """The snapshot matching the installed megatron-core (by its minor release)."""
    found = installed_version("megatron-core")
    minor = ".".join(found.split(".")[:2])
    if minor not in REF_OF_MINOR:
        raise SnapshotMissing(f"no Megatron-LM snapshot for megatron-core {found}; "
                              f"snapshots exist for {sorted(REF_OF_MINOR)}")
    return REF_OF_MINOR[minor]


def _expected_sha256(folder: Path, name: str) -> str:
    for line in (folder / "SHA256SUMS").read_text().splitlines():
        digest, _, file = line.strip().partition("  ")
        if file.strip().lstrip("*") == name:
            return digest
    raise SnapshotMissing(f"{name} is not listed in {folder / 'SHA256SUMS'}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


#: What :func:`training_tree` leaves out: the snapshot's own megatron-core.
CORE_PREFIX = "megatron/core/"


def snapshot(ref: str | None = None) -> Path:
    """The extracted Megatron-LM tree of ``ref`` (default: the installed megatron-core's).

    Extracted once per tarball digest under the cache directory; concurrent callers (ranks,
    pytest workers) wait on a lock instead of extracting twice.
    """
    return _extracted(ref, training_only=False)


def training_tree(ref: str | None = None) -> Path:
    """The snapshot of ``ref`` without ``megatron/core`` (see the module's docstring): run
    its ``pretrain_gpt.py`` and the installed megatron-core is the one imported."""
    return _extracted(ref, training_only=True)


def _without_core(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    name = member.name.removeprefix("./")
    if name == CORE_PREFIX.rstrip("/") or name.startswith(CORE_PREFIX):
        return None
    return tarfile.data_filter(member, dest)


def _extracted(ref: str | None, training_only: bool) -> Path:
    ref = ref or ref_for_installed()
    if ref not in TARBALLS:
        raise SnapshotMissing(f"unknown snapshot {ref!r}; known: {sorted(TARBALLS)}")
    folder = snapshots_dir()
    tarball = folder / TARBALLS[ref]
    if not tarball.is_file():
        raise SnapshotMissing(f"{tarball} is missing (snapshot {ref})")
    expected = _expected_sha256(folder, tarball.name)
    cache = Path(os.environ.get(CACHE_ENV)
                 or Path.home() / ".cache" / "megatron-ckpt-fixes" / "snapshots")
    tree = cache / f"{ref}-{expected[:12]}{'-training' if training_only else ''}"
    done = tree / ".extracted"
    if done.is_file():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{tree.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            if _sha256(tarball) != expected:
                raise SnapshotMissing(f"{tarball} does not match its SHA256SUMS entry")
            shutil.rmtree(tree, ignore_errors=True)
            partial = tree.with_name(tree.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            with tarfile.open(tarball) as tar:
                tar.extractall(partial, filter=_without_core if training_only else "data")
            partial.rename(tree)
            done.write_text(f"{tarball.name} {expected}\n")
    return tree


if __name__ == "__main__":
    training = "--training" in sys.argv[1:]
    refs = [a for a in sys.argv[1:] if a != "--training"]
    try:
        print((training_tree if training else snapshot)(refs[0] if refs else None))
    except SnapshotMissing as exc:
        sys.exit(f"error: {exc}")
