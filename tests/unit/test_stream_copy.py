"""The snapshot's streaming copy: exact, used where the machine runs it, memmove elsewhere.

Wrong fixes each check catches: a loop that is never used on x86-64 Linux (every copy falling
back to ``memmove`` gains nothing), a head or tail left uncopied or written past (misaligned
ranges), and a machine whose executable page is refused or whose loop disagrees with
``memmove`` still using the loop.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch

from megatron_ckpt_fixes.snapshot import stream_copy
from megatron_ckpt_fixes.snapshot.staging import copy_into

X86_64_LINUX = sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture
def fresh_loop():
    """Forget the process's loop (found again on next use), before and after the test."""
    stream_copy._loop.cache_clear()
    yield
    stream_copy._loop.cache_clear()


def _copies_exactly() -> None:
    """Ranges around the size where the loop takes over, at every kind of misalignment."""
    least = stream_copy.MIN_BYTES
    source = torch.randint(0, 256, (3 * least,), dtype=torch.uint8)
    for src_at, dst_at, nbytes in ((0, 0, least), (5, 3, least + 1), (64, 1, 2 * least + 127),
                                   (1, 0, least - 1), (0, 0, 0)):
        target = torch.zeros(3 * least + 64, dtype=torch.uint8)
        stream_copy.copy(target.data_ptr() + dst_at, source.data_ptr() + src_at, nbytes)
        assert torch.equal(target[dst_at:dst_at + nbytes], source[src_at:src_at + nbytes])
        assert not target[:dst_at].any() and not target[dst_at + nbytes:].any()


def _counting(monkeypatch) -> list[int]:
    """The sizes of the copies that go through the streaming loop from now on (the loop's
    own check against memmove, on first use, done before)."""
    stream_copy.available()
    used: list[int] = []
    original = stream_copy._copy_with
    monkeypatch.setattr(stream_copy, "_copy_with",
                        lambda *args: (used.append(args[3]), original(*args))[1])
    return used


@pytest.mark.skipif(not X86_64_LINUX, reason="the streaming loop is x86-64 Linux's")
def test_the_loop_is_used_on_x86_64_linux_and_copies_exactly(fresh_loop, monkeypatch):
    assert stream_copy.available()
    used = _counting(monkeypatch)
    _copies_exactly()
    assert used == [stream_copy.MIN_BYTES, stream_copy.MIN_BYTES + 1,
                    2 * stream_copy.MIN_BYTES + 127]  # smaller copies stay with memmove


def test_the_snapshot_copy_of_a_float_tensor_is_bitwise(fresh_loop, monkeypatch):
    used = _counting(monkeypatch)
    source = torch.randn(stream_copy.MIN_BYTES // 2 + 3, dtype=torch.float32)
    source[7] = float("nan")
    target = torch.empty_like(source)
    copy_into(target, source)
    assert torch.equal(target.view(torch.int32), source.view(torch.int32))
    assert used == ([source.nbytes] if X86_64_LINUX else [])  # the snapshot's copy streams


def test_a_refused_executable_page_falls_back_to_memmove(fresh_loop, monkeypatch):
    def refused(code: bytes):
        raise OSError(13, "mprotect(PROT_EXEC) refused")

    monkeypatch.setattr(stream_copy, "_executable", refused)
    assert not stream_copy.available()
    _copies_exactly()


@pytest.mark.skipif(not X86_64_LINUX, reason="the streaming loop is x86-64 Linux's")
def test_a_loop_that_disagrees_with_memmove_is_never_used(fresh_loop, monkeypatch, caplog):
    monkeypatch.setattr(stream_copy, "_LOOP_X86_64", bytes.fromhex("c3"))  # ret: copies nothing
    assert not stream_copy.available()
    assert "disagrees with memmove" in caplog.text
    _copies_exactly()
