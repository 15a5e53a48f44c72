"""megatron-core's own integrity manifest (``integrity.json``), checked from the files.

From 0.19 on, ``dist_checkpointing.save(..., verify_integrity=True)`` has rank 0 re-read
every file of the finished checkpoint and write :data:`MANIFEST`: ``{"algorithm": "sha256",
"files": {file name: hex digest}}``; ``load(..., verify_integrity=True)`` has rank 0 hash
every file again before the load. ``megatron-ckpt-fixes verify`` checks the same manifest
with any megatron-core release (it is plain JSON), naming each file that differs or is
missing, and hashes the files on several threads (hashlib releases the GIL), where upstream
hashes them one after the other on rank 0.

The manifest and this package's per-item record (:mod:`.record`) are independent: a
checkpoint may have either, both or neither, and ``verify`` checks what it has.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

#: The manifest's file name inside the checkpoint directory (megatron-core's name).
MANIFEST = "integrity.json"
#: Bytes read at a time, into one buffer per thread.
READ_CHUNK = 8 << 20
THREADS = 4


class ManifestError(ValueError):
    """``integrity.json`` exists but cannot be read as megatron-core's manifest."""


@dataclass(frozen=True)
class Manifest:
    algorithm: str
    files: dict[str, str]  # file name -> hex digest

    @classmethod
    def read(cls, checkpoint_dir: str | os.PathLike) -> Manifest | None:
        """The checkpoint's manifest; None when it has none. Raises :class:`ManifestError`."""
        try:
            with open(os.path.join(checkpoint_dir, MANIFEST)) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ManifestError(f"unreadable: {type(exc).__name__}: {exc}") from exc
        try:
            algorithm, files = doc.get("algorithm", "sha256"), doc["files"]
            if algorithm not in hashlib.algorithms_available:
                raise ValueError(f"unknown hash algorithm {algorithm!r}")
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
                raise ValueError("'files' must map file names to hex digests")
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"not megatron-core's manifest: {type(exc).__name__}: "
                                f"{exc}") from exc
        return cls(algorithm, dict(files))


def file_digest(path: str, algorithm: str) -> str:
    """The hex digest of the whole file, read into one reused buffer."""
    hasher = hashlib.new(algorithm)
    view = memoryview(bytearray(READ_CHUNK))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            hasher.update(view[:n])
    return hasher.hexdigest()


@dataclass(frozen=True)
class ManifestSummary:
    algorithm: str
    files: int
    mismatched: int

    def __str__(self) -> str:
        text = (f"{self.files - self.mismatched} of {self.files} file(s) match their "
                f"{self.algorithm} digests (megatron-core's integrity manifest)")
        return text + (f", {self.mismatched} do not" if self.mismatched else "")


def check_manifest(checkpoint_dir: str, manifest: Manifest) -> tuple[list[tuple[str, str]],
                                                                     ManifestSummary]:
    """Re-hash every file the manifest names: ``[(file, cause)]`` for each that differs or
    cannot be read, and the summary."""
    def check(name: str) -> str | None:
        path = os.path.join(checkpoint_dir, name)
        try:
            found = file_digest(path, manifest.algorithm)
        except OSError as exc:
            return f"missing or unreadable ({type(exc).__name__}: {exc.strerror or exc})"
        expected = manifest.files[name]
        if found != expected:
            return (f"{manifest.algorithm} mismatch (recorded {expected[:16]}..., the file "
                    f"holds {found[:16]}...)")
        return None

    names = sorted(manifest.files)
    with ThreadPoolExecutor(THREADS) as pool:
        causes = list(pool.map(check, names))
    problems = [(name, cause) for name, cause in zip(names, causes) if cause is not None]
    return problems, ManifestSummary(manifest.algorithm, len(names), len(problems))
