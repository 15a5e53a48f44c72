"""Upstream source snapshots for the tests and scripts that need upstream's own files.

CI and the development machines cannot reach GitHub. Megatron-LM's training package
(``pretrain_gpt.py``, ``megatron/training``), its functional test cases and megatron-core's
own unit tests come from ``git archive`` tarballs in a snapshots folder (``shared/upstream/
megatron-lm`` beside the checkout, with a ``SHA256SUMS`` file; where it is missing,
``scripts/fetch_upstream_snapshots.py`` fetches the same commits from GitHub). This module
finds that folder, picks the snapshot that matches the installed megatron-core, and extracts
it once into a cache directory (checked against ``SHA256SUMS`` first).

The systems that are not packaged (MLite, TorchEasyRec: :data:`SETS`) have their snapshot
folders beside that one (``shared/upstream/megatron-lite``, ``shared/upstream/torcheasyrec``),
found through the same variable: :func:`snapshot_tree` and :func:`import_root`.

- ``MCF_UPSTREAM_SNAPSHOTS``: the snapshots folder (default: ``../shared/upstream/megatron-lm``
  next to the repository, where CI puts it, else the fetched one, :func:`fetched_dir`).
- ``MCF_SNAPSHOT_CACHE``: where snapshots are extracted (default:
  ``~/.cache/megatron-ckpt-fixes/snapshots``).

A missing folder or tarball raises :class:`SnapshotMissing` with what was looked for and how
to provide it. A test module that needs a snapshot folder skips without it, naming it, and
fails where every optional system must be present (CI: tests/optional_systems.py).

:func:`training_tree` is the same snapshot without ``megatron/core``: Megatron-LM's scripts
run with their own directory first on ``sys.path``, so in the full tree ``import
megatron.core`` would find the snapshot's sources instead of the installed megatron-core
(``megatron`` is a namespace package; the training tree beside the wheel imports fine).

    python scripts/upstream_snapshots.py [REF]             # print the extracted tree of REF
    python scripts/upstream_snapshots.py --training [REF]  # ... its training tree
    python scripts/upstream_snapshots.py --set megatron-lite dev  # MLite's import root
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import tarfile
from dataclasses import dataclass
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


@dataclass(frozen=True)
class SnapshotSet:
    """Snapshots of one unpackaged system, in a folder beside the Megatron-LM one.

    ``tarballs`` maps a ref to its tarball (one top folder inside); ``import_root`` is the
    folder, inside that top folder, to put on ``sys.path`` to import the system.
    """

    tarballs: dict[str, str]
    import_root: str


#: Folder name (beside ``megatron-lm``) -> its snapshots; READMEs in each folder.
SETS: dict[str, SnapshotSet] = {
    "megatron-lite": SnapshotSet({"dev": "megatron-lm-dev-d48bd6be-experimental-lite.tar.gz",
                                  "pr61": "mlite-pr61-4b73154f-experimental-lite.tar.gz"},
                                 "experimental/lite"),
    "torcheasyrec": SnapshotSet({"head": "torcheasyrec-54cac316.tar.gz"}, ""),
}


class SnapshotMissing(RuntimeError):
    """A Megatron-LM snapshot that a test or script needs is not there."""


def cache_root() -> Path:
    """The project's cache folder: extracted snapshots, fetched ones (both re-creatable)."""
    return Path.home() / ".cache" / "megatron-ckpt-fixes"


def fetched_dir() -> Path:
    """Where ``scripts/fetch_upstream_snapshots.py`` puts the Megatron-LM snapshots when
    neither :data:`SNAPSHOTS_ENV` nor ``shared/upstream`` names a folder (the other
    systems' folders beside it)."""
    return cache_root() / "upstream" / "megatron-lm"


def snapshots_dir() -> Path:
    """The folder holding the tarballs and ``SHA256SUMS``: :data:`SNAPSHOTS_ENV`'s, else
    the shared one beside the checkout, else the fetched one."""
    configured = os.environ.get(SNAPSHOTS_ENV)
    looked = [Path(configured)] if configured else [DEFAULT_SNAPSHOTS, fetched_dir()]
    for folder in looked:
        if (folder / "SHA256SUMS").is_file():
            return folder
    raise SnapshotMissing(
        f"no Megatron-LM snapshots at {' or '.join(map(str, looked))} (no SHA256SUMS there): "
        "python scripts/fetch_upstream_snapshots.py fetches them (bash scripts/"
        f"install_test_deps.sh runs it), or set {SNAPSHOTS_ENV} to the folder holding "
        "megatron-lm-*.tar.gz and SHA256SUMS (shared/upstream/megatron-lm in CI)")


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
    return _extract(snapshots_dir(), TARBALLS[ref], ref,
                    "-training" if training_only else "", training_only)


def snapshot_tree(name: str, ref: str) -> Path:
    """The extracted top folder of snapshot ``ref`` of the system ``name`` (a key of
    :data:`SETS`), from the folder of that name beside the Megatron-LM snapshots."""
    if name not in SETS:
        raise SnapshotMissing(f"unknown snapshot set {name!r}; known: {sorted(SETS)}")
    tarballs = SETS[name].tarballs
    if ref not in tarballs:
        raise SnapshotMissing(f"unknown {name} snapshot {ref!r}; known: {sorted(tarballs)}")
    folder = snapshots_dir().parent / name
    if not (folder / "SHA256SUMS").is_file():
        raise SnapshotMissing(
            f"no {name} snapshots at {folder} (no SHA256SUMS there): it is the folder beside "
            f"the Megatron-LM snapshots ({SNAPSHOTS_ENV}={snapshots_dir()}); CI has it as "
            f"shared/upstream/{name} beside the checkout")
    tree = _extract(folder, tarballs[ref], f"{name}-{ref}", "", False)
    tops = [p for p in tree.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise SnapshotMissing(f"{folder / tarballs[ref]} should hold one top folder, "
                              f"holds {sorted(p.name for p in tops)}")
    return tops[0]


def import_root(name: str, ref: str) -> Path:
    """The folder to put on ``sys.path`` (``PYTHONPATH``) to import system ``name`` at
    ``ref`` (MLite: ``experimental/lite``, where ``megatron`` is a namespace package)."""
    return snapshot_tree(name, ref) / SETS[name].import_root


def _extract(folder: Path, name: str, ref: str, suffix: str, training_only: bool) -> Path:
    """Extract ``folder/name`` once per digest into the cache; return the extracted tree."""
    tarball = folder / name
    if not tarball.is_file():
        raise SnapshotMissing(f"{tarball} is missing (snapshot {ref}): python "
                              "scripts/fetch_upstream_snapshots.py fetches it")
    expected = _expected_sha256(folder, tarball.name)
    cache = Path(os.environ.get(CACHE_ENV) or cache_root() / "snapshots")
    tree = cache / f"{ref}-{expected[:12]}{suffix}"
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
    args = sys.argv[1:]
    try:
        if args[:1] == ["--set"] and len(args) == 3:
            print(import_root(args[1], args[2]))
        else:
            training = "--training" in args
            refs = [a for a in args if a != "--training"]
            print((training_tree if training else snapshot)(refs[0] if refs else None))
    except SnapshotMissing as exc:
        sys.exit(f"error: {exc}")
