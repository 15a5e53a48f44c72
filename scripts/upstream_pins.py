"""The upstream commit behind each snapshot tarball, and the check that an archive holds it.

A snapshot tarball (``scripts/upstream_snapshots.py``) is a ``git archive`` of one commit,
sometimes of a few paths only. Where ``shared/upstream`` is missing, the same tree can come
from GitHub's archive of that commit (``scripts/fetch_upstream_snapshots.py``), which is
another ``git archive`` of it: other top folder, other compression, so never the tarball's
bytes or its SHA256SUMS digest. What both share is what the tests read: the files. A
:class:`Pin` therefore names the commit and a digest of the kept files (path, executable bit,
bytes; a symlink's target), and :func:`repack` accepts an archive only when both match:

- the commit id that ``git archive`` writes into the archive's pax header (what ``git
  get-tar-commit-id`` reads), which names a wrong commit in the error;
- the content digest, which a truncated, altered or other-commit archive cannot pass.

The repacked tarball has the layout of the shared one (its top folder, its paths), so the
extraction in ``upstream_snapshots`` treats both alike.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO


class ArchiveMismatch(RuntimeError):
    """An archive is not the pinned commit's tree."""


@dataclass(frozen=True)
class Pin:
    """One snapshot: GitHub ``repo`` at ``commit``, keeping ``paths`` (all when empty),
    under the top folder ``top`` ("" for none), with the content digest of what it keeps."""

    repo: str
    commit: str
    top: str
    paths: tuple[str, ...]
    digest: str

    def keeps(self, path: str) -> bool:
        """Whether ``path`` (relative to the top folder) belongs to the snapshot."""
        return not self.paths or any(path == p or path.startswith(p + "/") for p in self.paths)


_MEGATRON_LM = "NVIDIA/Megatron-LM"
_TZREC_PATHS = ("LICENSE", "requirements", "requirements-cpu.txt", "requirements-cu126.txt",
                "requirements-cu129.txt", "requirements-cu130.txt", "requirements-gpu.txt",
                "requirements.txt", "setup.py", "tzrec")

#: Snapshot folder (``megatron-lm`` or a key of ``upstream_snapshots.SETS``) -> ref -> pin;
#: the commits are the folders' READMEs', the digests those of the shared tarballs.
PINS: dict[str, dict[str, Pin]] = {
    "megatron-lm": {
        "core_v0.16.1": Pin(_MEGATRON_LM, "55ac7082517c3878ae653c07c09c534b8aed49f6", "", (),
                            "c1e8759bf0afbd3f6dbe8b93f22e957325342d1a939e5530cbae74cf8dcc7098"),
        "core_v0.19.0": Pin(_MEGATRON_LM, "5be9626709af2722333bf54797c954c09edeada3", "", (),
                            "78b617f96b9df1b2edadb6e5a3c0a471b132e9ad8ab29272257445c45ce93d4d"),
        "main": Pin(_MEGATRON_LM, "d98e8a64ddf34856e74b24714e3bedb2f5a39553", "", (),
                    "d5f22f8baaf677f1a1c5eedda4f092db0227e0951a6ee9711e182c99e5c5a737"),
    },
    "megatron-lite": {
        "dev": Pin(_MEGATRON_LM, "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1",
                   "megatron-lm-dev-d48bd6be", ("LICENSE", "experimental/lite"),
                   "eeefad919355ce4f479ca59f6c2b3494284fa7d155cee2fa3718f0c5e807b39b"),
        "pr61": Pin("ISEEKYAN/mlite", "4b73154feda340a4988e8526ce5a5a243fc81be8",
                    "mlite-pr61-4b73154f", ("experimental/lite",),
                    "29ae4ca65bd6db133b96fa04514a62748418a4b2fcf3ba8bf4e960de6c6a9518"),
    },
    "torcheasyrec": {
        "head": Pin("alibaba/TorchEasyRec", "54cac3165a2adece9a932616463a5b6a2095b0ce",
                    "torcheasyrec-54cac316", _TZREC_PATHS,
                    "6ea0a7a07d2ca1e25dd4033b6541a664eaddf2f3fae5075f92724e310ca97d20"),
    },
}


def _entry(path: str, member: tarfile.TarInfo, data: bytes) -> str:
    """One kept member as a line of the content digest (directories carry nothing)."""
    if member.issym():
        return f"{path}\0link\0{hashlib.sha256(member.linkname.encode()).hexdigest()}"
    kind = "exec" if member.mode & 0o100 else "file"
    return f"{path}\0{kind}\0{hashlib.sha256(data).hexdigest()}"


def _relative(name: str, top: str) -> str | None:
    """``name`` below the top folder ``top`` ("" for the top folder itself); None outside."""
    name = name.removeprefix("./").rstrip("/")
    if not top:
        return name
    if name == top:
        return ""
    return name.removeprefix(top + "/") if name.startswith(top + "/") else None


def _copy_kept(source: tarfile.TarFile, top: str, pin: Pin, out: tarfile.TarFile | None,
               where: str) -> str:
    """Read ``source`` (the archive ``where``) once, in order: add what ``pin`` keeps to ``out``
    (under ``pin.top``) and return its content digest."""
    try:
        return _digest(_kept(source, top, pin, out, where))
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        raise ArchiveMismatch(f"{where} is damaged ({error})") from None


def _digest(lines: Iterator[str]) -> str:
    """The digest of the member lines, sorted: the archive's member order does not count."""
    return hashlib.sha256("\n".join(sorted(lines)).encode("utf-8", "surrogateescape")).hexdigest()


def _kept(source: tarfile.TarFile, top: str, pin: Pin, out: tarfile.TarFile | None,
          where: str) -> Iterator[str]:
    """The digest lines of what ``pin`` keeps of ``source``, each member added to ``out``."""
    for member in source:
        path = _relative(member.name, top)
        if path is None:
            raise ArchiveMismatch(f"{where}: {member.name} lies outside its top folder {top}")
        if not path or not pin.keeps(path):
            continue
        if not (member.isfile() or member.isdir() or member.issym()):
            raise ArchiveMismatch(f"{where}: {member.name} is not a file, folder or symlink")
        data = source.extractfile(member).read() if member.isfile() else b""
        if not member.isdir():
            yield _entry(path, member, data)
        if out is not None:
            member.name = f"{pin.top}/{path}" if pin.top else path
            member.pax_headers = {}  # a long name's old "path" record would win over the new
            out.addfile(member, io.BytesIO(data) if member.isfile() else None)


def _opened(archive: BinaryIO, pin: Pin, where: str) -> tarfile.TarFile:
    """``archive`` opened as a gzip'd tar whose pax header names ``pin.commit``; read in
    order, but not as a stream ("r|gz"), which ends quietly where a download was cut."""
    try:
        source = tarfile.open(fileobj=archive, mode="r:gz")
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        raise ArchiveMismatch(f"{where} is not a tar.gz archive ({error})") from None
    found = source.pax_headers.get("comment")
    if found != pin.commit:
        raise ArchiveMismatch(f"{where} is an archive of commit {found}, not {pin.commit} "
                              f"({pin.repo})")
    return source


def content_digest(tarball: Path, pin: Pin) -> str:
    """The content digest of a snapshot tarball laid out as ``pin`` says (checked to hold
    ``pin.commit``): what :data:`PINS` records, and what a test compares."""
    with open(tarball, "rb") as f, _opened(f, pin, str(tarball)) as source:
        return _copy_kept(source, pin.top, pin, None, str(tarball))


def repack(archive: Path, pin: Pin, dest: Path, where: str) -> None:
    """Write ``dest``, the snapshot tarball of ``pin``, from ``archive`` (GitHub's archive of
    the commit: one top folder, any name; ``where`` names it in errors); raise
    :class:`ArchiveMismatch` and write nothing unless it holds ``pin.commit`` with exactly
    the pinned content."""
    partial = dest.with_name(f".{dest.name}.partial")
    try:
        with open(archive, "rb") as f, _opened(f, pin, where) as source, \
                tarfile.open(partial, "w:gz", format=tarfile.PAX_FORMAT,
                             pax_headers={"comment": pin.commit}) as out:
            first = source.firstmember
            top = "" if first is None else first.name.removeprefix("./").split("/")[0]
            found = _copy_kept(source, top, pin, out, where)
        if found != pin.digest:
            raise ArchiveMismatch(f"{where} holds other files than {pin.repo} commit "
                                  f"{pin.commit} (content digest {found}, pinned {pin.digest})")
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
