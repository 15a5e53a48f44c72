"""torch DCP's FileSystemWriter with writer threads: a thread's failure fails the save.

Upstream (pytorch issue 191391): ``FileSystemWriter(thread_count=2)`` writes half of the
files on a thread; that thread's exception goes to ``threading.excepthook``, its results are
missing, and ``dcp.save`` writes ``.metadata`` and returns: a checkpoint without the bytes,
saved "successfully". The failure is injected at torch's own storage layer
(``FileSystemWriter.fs``, its extension point): the file system fails every write that a
thread other than the caller's starts, with EIO, and holds the caller's first write until
the thread has taken a file, so a thread always fails.
"""

from __future__ import annotations

import contextlib
import errno
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

STATE = {f"t{i}": torch.arange(1000.0) + i for i in range(4)}


class _ThreadsFail(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.caller = threading.get_ident()
        self.thread_tried = threading.Event()

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if str(path).endswith(".distcp"):
            if threading.get_ident() != self.caller:
                self.thread_tried.set()
                raise OSError(errno.EIO, "Input/output error (a writer thread's disk)", str(path))
            self.thread_tried.wait(10)
        with super().create_stream(path, mode) as stream:
            yield stream


def _save(path) -> None:
    writer = FileSystemWriter(str(path), thread_count=2)
    writer.fs = _ThreadsFail()
    dcp.save(STATE, storage_writer=writer)


def test_a_writer_thread_failure_fails_the_save(tmp_path, clean_install):
    clean_install.install(["writer_failures"])
    with pytest.raises(CheckpointException) as raised:
        _save(tmp_path / "ckpt")
    assert "Input/output error (a writer thread's disk)" in str(raised.value)
    assert not (tmp_path / "ckpt" / ".metadata").exists()


def test_upstream_reports_success_without_the_bytes(tmp_path, clean_install):
    seen, hook = [], threading.excepthook
    threading.excepthook = seen.append
    try:
        _save(tmp_path / "ckpt")  # returns: "saved"
    finally:
        threading.excepthook = hook
    assert seen and "a writer thread's disk" in str(seen[0].exc_value)
    assert (tmp_path / "ckpt" / ".metadata").exists()
    loaded = {k: torch.zeros_like(v) for k, v in STATE.items()}
    with pytest.raises(CheckpointException):  # the bytes are missing
        dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"))


def test_torch_is_asked_whether_it_raises_thread_failures(clean_install):
    """The patch is applied where torch loses the thread's failure (detected)."""
    names = clean_install.install(["writer_failures"])
    assert "writer_failures.threads.dcp_write" in names
