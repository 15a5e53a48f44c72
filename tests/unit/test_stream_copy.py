"""The snapshot's streaming copy: exact, one call for a whole snapshot, memmove elsewhere.

Wrong fixes each check catches: a loop that is never used on x86-64 Linux (every copy falling
back to ``memmove`` gains nothing), a call per tensor (the copy's thread then takes the GIL
back between two tensors and waits for a trainer thread that pickles), a head or tail left
uncopied or written past (misaligned ranges, streamed or not), and a machine whose executable
page is refused or whose loop disagrees with ``memmove`` still using the loop.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch

from megatron_ckpt_fixes.snapshot import stream_copy
from megatron_ckpt_fixes.snapshot.staging import Copies

X86_64_LINUX = sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64")
LEAST = stream_copy.MIN_BYTES
#: (source offset, destination offset, bytes): around the size where streaming takes over,
#: at every kind of misalignment, and nothing
RANGES = ((0, 0, LEAST), (5, 3, LEAST + 1), (64, 1, 2 * LEAST + 127), (1, 0, LEAST - 1),
          (3, 70, 200), (0, 0, 0))


@pytest.fixture
def fresh_loop():
    """Forget the process's loop (found again on next use), before and after the test."""
    stream_copy._copy_many.cache_clear()
    yield
    stream_copy._copy_many.cache_clear()


def _copies_exactly(min_stream: int = LEAST) -> None:
    """Every range of :data:`RANGES`, copied by one :class:`ByteCopies`."""
    source = torch.randint(0, 256, (3 * LEAST,), dtype=torch.uint8)
    targets = [torch.zeros(3 * LEAST + 128, dtype=torch.uint8) for _ in RANGES]
    stream_copy.ByteCopies([(t.data_ptr() + dst_at, source.data_ptr() + src_at, nbytes)
                            for t, (src_at, dst_at, nbytes) in zip(targets, RANGES)]
                           ).run(min_stream)
    for target, (src_at, dst_at, nbytes) in zip(targets, RANGES):
        assert torch.equal(target[dst_at:dst_at + nbytes], source[src_at:src_at + nbytes])
        assert not target[:dst_at].any() and not target[dst_at + nbytes:].any()


def _calls(monkeypatch) -> list[int]:
    """How many copies each call of the machine-code loop makes from now on (its own check
    against memmove, on first use, done before)."""
    found = stream_copy._copy_many()
    if found is None:
        return []
    calls: list[int] = []
    page, copy_many = found

    def counted(table, count, min_stream):
        calls.append(count)
        copy_many(table, count, min_stream)

    monkeypatch.setattr(stream_copy, "_copy_many", lambda: (page, counted))
    return calls


@pytest.mark.skipif(not X86_64_LINUX, reason="the streaming loop is x86-64 Linux's")
@pytest.mark.parametrize("min_stream", [LEAST, 64])
def test_the_loop_is_used_on_x86_64_linux_and_copies_exactly(fresh_loop, monkeypatch,
                                                             min_stream):
    assert stream_copy.available()
    calls = _calls(monkeypatch)
    _copies_exactly(min_stream)  # 64: every range but the empty one streams
    assert calls == [len(RANGES)]


def test_a_snapshot_is_copied_bitwise_by_one_call(fresh_loop, monkeypatch):
    calls = _calls(monkeypatch)
    sources = [torch.randn(LEAST // 2 + 3, dtype=torch.float32),
               torch.arange(11, dtype=torch.int16), torch.randn(5, 3).t()]
    sources[0][7] = float("nan")
    targets = [torch.empty(s.shape, dtype=s.dtype) for s in sources]
    Copies.of(targets, sources).run()
    assert torch.equal(targets[0].view(torch.int32), sources[0].view(torch.int32))
    assert all(torch.equal(t, s) for t, s in zip(targets[1:], sources[1:]))
    assert calls == ([2] if X86_64_LINUX else [])  # the transpose goes through copy_


def test_a_refused_executable_page_falls_back_to_memmove(fresh_loop, monkeypatch):
    def refused(code: bytes):
        raise OSError(13, "mprotect(PROT_EXEC) refused")

    monkeypatch.setattr(stream_copy, "_executable", refused)
    assert not stream_copy.available()
    _copies_exactly()


@pytest.mark.skipif(not X86_64_LINUX, reason="the streaming loop is x86-64 Linux's")
def test_a_loop_that_disagrees_with_memmove_is_never_used(fresh_loop, monkeypatch, caplog):
    monkeypatch.setattr(stream_copy, "_COPY_MANY_X86_64", bytes.fromhex("c3"))  # copies nothing
    assert not stream_copy.available()
    assert "disagrees with memmove" in caplog.text
    _copies_exactly()
