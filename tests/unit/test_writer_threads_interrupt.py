"""An interrupt (Ctrl-C) while the calling thread writes its bucket stays an interrupt.

The threaded bucket writers report what escapes a writer thread as the save's failure (a
thread's end must never be lost). The last bucket is written on the calling thread, where a
``KeyboardInterrupt`` arrives: it must reach the trainer as one, not become a write failure
on the save's results queue. Wrong fix caught: catching ``BaseException`` around every
bucket's write.
"""

from __future__ import annotations

import queue

import pytest

pytestmark = pytest.mark.varies_with("megatron-core")


def test_an_interrupt_on_the_calling_thread_is_raised_and_a_thread_failure_reported(
        monkeypatch):
    from megatron_ckpt_fixes.speedups.writer_threads import threaded_bucket_writers

    fs = pytest.importorskip("megatron.core.dist_checkpointing.strategies.filesystem_async")
    writer = fs.FileSystemWriterAsync
    if not hasattr(writer, "write_preloaded_data_multiproc"):
        pytest.skip("this megatron-core writes its buckets with threads itself")

    def write_preloaded_data(transform_list, local_proc_idx, write_bucket, results_queue,
                             count_queue, use_fsync, **kwargs):
        if write_bucket[1] == "interrupted":
            raise KeyboardInterrupt
        if write_bucket[1] == "exits":
            raise SystemExit(3)  # escapes a writer thread: reported, not lost
        results_queue.put((local_proc_idx, []))

    monkeypatch.setattr(writer, "write_preloaded_data", staticmethod(write_preloaded_data))
    multiproc = threaded_bucket_writers(writer.write_preloaded_data_multiproc)
    results: queue.Queue = queue.Queue()
    buckets = [("a.distcp", "exits", ([], [])), ("b.distcp", "interrupted", ([], []))]
    with pytest.raises(KeyboardInterrupt):
        multiproc([], False, 0, buckets, results)
    assert results.empty()
    multiproc([], False, 0, [buckets[0], ("c.distcp", "written", ([], []))], results)
    assert "SystemExit: 3" in str(results.get_nowait())


def test_a_thread_that_cannot_start_leaves_its_bucket_to_the_calling_thread(monkeypatch, caplog):
    """A speed-up falls back on its own failure: a process that refuses a new thread
    (``RuntimeError: can't start new thread``) still writes every bucket, each once, and
    reports them all. Wrong fix caught: letting the refusal fail the save."""
    import threading

    from megatron_ckpt_fixes.speedups.writer_threads import threaded_bucket_writers

    fs = pytest.importorskip("megatron.core.dist_checkpointing.strategies.filesystem_async")
    writer = fs.FileSystemWriterAsync
    if not hasattr(writer, "write_preloaded_data_multiproc"):
        pytest.skip("this megatron-core writes its buckets with threads itself")
    written: list[str] = []

    def write_preloaded_data(transform_list, local_proc_idx, write_bucket, results_queue,
                             count_queue, use_fsync, **kwargs):
        written.append(write_bucket[0])
        results_queue.put((local_proc_idx, []))

    starts = [0]
    real_start = threading.Thread.start

    def start(thread):
        starts[0] += 1
        if starts[0] > 1:
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(writer, "write_preloaded_data", staticmethod(write_preloaded_data))
    monkeypatch.setattr(threading.Thread, "start", start)
    multiproc = threaded_bucket_writers(writer.write_preloaded_data_multiproc)
    results: queue.Queue = queue.Queue()
    buckets = [(f"{name}.distcp", name, ([], [])) for name in "abcd"]
    multiproc([], False, 0, buckets, results)
    assert sorted(written) == [b[0] for b in buckets]
    assert sorted(results.get_nowait()) == [0, 1, 2, 3]
    assert "writing 2 checkpoint file(s) on the saving thread" in caplog.text
