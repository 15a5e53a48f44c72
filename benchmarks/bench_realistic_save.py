"""The fixes' cost on a real save: a GPT-like sharded state dict of MB tensors, on tmpfs and a disk.

Two gloo ranks (``--ranks``) save the sharded state dict of a GPT-like model: per layer the
QKV, projection and both MLP weights (split between the ranks, as tensor parallelism does)
with their biases and two layer norms (replicated, written once), and Adam's two moments of
each (``--layers`` 8, ``--hidden`` 1024: 240 tensors per rank, MB-sized shards, 1.13 GiB per
save). One command measures each ``--dir`` (default ``/dev/shm`` and ``/var/tmp``) in its own
mode, told by the directory's file system:

- tmpfs: the software's cost, where no disk adds noise; per save its wall time (slowest
  rank) and CPU time (every rank's process, its threads, its forked writers and its async
  worker: the whole process tree, reaped children included; summed over the ranks), and
  each feature alone (``install(["compat.cpu", F])``) against upstream, paired per round:
  ``snapshot`` against upstream's asynchronous save (it acts on asynchronous saves only),
  the others against upstream's cached save; and against the default features, the fixes
  without any speed-up and the default plus the speed-ups applied only when named;
- disk: what a user on that disk sees, beside the disk's own spread (raw write+fsync
  min/median/max over the rounds), and verification from disk and from the page cache.

Setups, each round every one once, in an order reversed from round to round:

- raw write+fsync: each rank writes its tensors' bytes into as many files as megatron-core's
  writer uses, one thread per file, and fsyncs them: what upstream's write pattern can reach;
- raw, early writeback: the same, each tensor handed to the disk once written (the
  ``writeback`` feature's hint): the disk's limit;
- upstream cached: plain megatron-core (``install(["compat.cpu"])``), a kept
  ``TorchDistSaveShardedStrategy(cached_metadata=True)``, megatron-core's fsync;
- all fixes: the same after ``install()``;
- upstream + integrity (disk, where the release has it): upstream cached with
  ``dist_checkpointing.save(..., verify_integrity=True)`` (rank 0 writes a SHA-256 per file);
- upstream async / all fixes async: the same save through megatron-core's persistent worker
  (Megatron-LM's ``--async-save --use-persistent-ckpt-worker``; a worker spawned with the
  setup's features and warmed by one untimed save each round): the whole save (scheduling to
  finalized) and how long the trainer waited (until scheduling returned: with the fixes, the
  snapshot's copy into staging buffers, whose time and memory are printed too).

Controlled (``--no-settle`` drops the page-cache control, to show what it changes): before
each timed save the previous checkpoint is deleted, ``os.sync()`` runs and the bench waits
until the kernel's dirty and writeback pages are back under ``SETTLED_BYTES`` (sync(2) waits
for writeback on Linux; the wait covers what another process dirtied), then a
``gc.collect()`` and a barrier; the dirty bytes each save starts with are printed.

Why two disk verdicts disagreed (1.093 over 5 rounds and 1.332 over 9, the same disk): not
the page cache. Every setup fsyncs its data files, so a save leaves about 1 MiB dirty (its
common state and metadata, the previous delete's journal); measured on 0.16.1, 9 rounds,
with and without the control: 0.1 against 0.7-1.5 MiB dirty at the start of a save, all
fixes / upstream cached 0.781 (0.637-1.023) against 0.864 (0.567-1.549), each inside the
other's spread. What moves the verdict is what the setups share and do not control: the
disk (raw write+fsync of the same bytes 0.77-2.62 s over one run's rounds) and the cores
(on tmpfs, no disk, a loaded 2-core machine moves the same save 1.0-2.5 s), so a paired
median of a few ratios spread 0.6-1.6 lands where the disk or a neighbour happened to be
for one setup's turn. A user's save runs minutes after the previous one was written back
(the settled state the control gives) on a machine the training owns: the verdict of a
quiet machine, with enough rounds, read beside the disk's spread. tmpfs takes the disk
away, not the neighbours: on the same 2-core machine with other benchmarks running, three
tmpfs runs gave wall 0.807, 1.025 and 0.821 (CPU 0.994, 1.057, 0.952), so a verdict within
5 % of 1.0 needs a quiet machine there too; CPU time moves less than wall time (on a disk
it also holds the kernel's I/O work: 0.99 and 1.14 in the two disk runs).

Then, on the disk, on that round's checkpoints, verification, each once from disk (the
files' pages evicted with ``posix_fadvise``) and once from the page cache:
``megatron-ckpt-fixes verify`` (one process), the collective ``verify_checkpoint`` that
``--ckpt-verify-checksums`` runs (each rank checks a share), and upstream's
``load(..., verify_integrity=True)`` check (rank 0 hashes every file). On tmpfs, the CPU
time the checksums add to megatron-core's own file writer (paired writes with and without
the feature). Every checkpoint is deleted once measured.

Targets (printed, each met or not). tmpfs: all fixes / upstream cached <= 1.00 (paired
median, wall); trainer blocked, all fixes async / upstream async <= 1.20 (paired median);
all fixes >= 70 % of raw write+fsync (medians); the writer's CPU time, all fixes / upstream
<= 0.90. Disk: the same three ratios with their spreads, as measured verdicts beside the
disk's spread; verification >= 2x upstream's SHA-256 manifest per GiB, from disk and from
the page cache. ``--ranks 1`` is the case of a GPU node's spare cores.

``--replicas``: instead, the cost of the replica check (feature ``replicas``) beside the save,
each round (in the first ``--dir``): the all-fixes save (cached plan, as above), then the
check alone on the same state dict and a Megatron-like common state (500 args, Adam's param
groups), in each design: at plan time in the steady state of a cached plan (objects and the
common state digested; what every save after the first costs), on every save (the
replicated tensors digested too: the layer norms and row-parallel biases here), and on every
save with every tensor a replica (the state dict declared as data-parallel replicas of one
model, each rank digesting all it holds: the worst case, the same bytes as the save), each
design timed ``REPLICA_REPEATS`` times a round. Printed: each as a share of the all-fixes
save (medians; wall time of the slowest rank and CPU time of the busiest, which other
processes on the machine disturb less), and the digest throughput; target: the plan-time
design <= 2 % of the save.

    python benchmarks/bench_realistic_save.py [--dir /dev/shm --dir /var/tmp] [--rounds N]
        [--layers 8] [--hidden 1024] [--no-settle]
    python benchmarks/bench_realistic_save.py --replicas [--ranks 1|2|4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist
from bench_cached_save import Spread, max_over_ranks, timed

from megatron_ckpt_fixes import FEATURES, FIXES, OPTIONAL_FEATURES, SPEEDUPS
from megatron_ckpt_fixes.speedups import writeback
from megatron_ckpt_fixes._dev.testing import run_ranks


@dataclass(frozen=True)
class Setup:
    """A timed save: its features (``None``: ``install()``), whether megatron-core's integrity
    manifest is asked for, whether it is asynchronous, and the setup it is paired with when
    it is one feature alone."""

    features: list[str] | None
    integrity: bool = False
    asynchronous: bool = False
    baseline: str | None = None


OPTIONAL_SPEEDUPS = [f for f in SPEEDUPS if f in OPTIONAL_FEATURES]
UPSTREAM, ALL, UPSTREAM_ASYNC, ALL_ASYNC = ("upstream cached", "all fixes", "upstream async",
                                            "all fixes async")
INTEGRITY = "upstream + integrity"
SAVES = {UPSTREAM: Setup(["compat.cpu"]), ALL: Setup(None),
         INTEGRITY: Setup(["compat.cpu"], integrity=True),
         UPSTREAM_ASYNC: Setup(["compat.cpu"], asynchronous=True),
         ALL_ASYNC: Setup(None, asynchronous=True)}
#: Each feature alone on tmpfs; ``snapshot`` acts on asynchronous saves only.
ALONE = ("structure", "snapshot", "checksums", "writeback", "writer_threads", "write_results",
         "writer_failures", "replicas")
assert set(ALONE) <= set(FEATURES), set(ALONE) - set(FEATURES)
#: Against the default features: the fixes without any speed-up, and the default plus the
#: speed-ups applied only when named.
NO_SPEEDUPS = "fixes without speed-ups"
OPT_IN = "all fixes + opt-in speed-ups"
FEATURE_SAVES = {**{f"{f} alone": Setup(["compat.cpu", f], asynchronous=f == "snapshot",
                                        baseline=UPSTREAM_ASYNC if f == "snapshot" else UPSTREAM)
                    for f in ALONE},
                 NO_SPEEDUPS: Setup(list(FIXES), baseline=ALL),
                 OPT_IN: Setup([*FEATURES, *OPTIONAL_SPEEDUPS], baseline=ALL)}
TMPFS, DISK = "tmpfs", "disk"
#: The default rounds of each mode: the disk's own spread needs more pairs to show a median.
ROUNDS = {TMPFS: 5, DISK: 9}
#: The asynchronous setups' extra figure: how long the trainer waited (scheduling returned).
BLOCKED = " (trainer blocked)"
RAW = "raw write+fsync"
#: The same raw write, each tensor handed to the disk once written (``writeback``'s hint):
#: the disk's limit for these bytes when the disk need not wait for the last write.
RAW_EARLY = "raw, early writeback"
VERIFIES = ("verify (1 process)", "verify_checkpoint (collective)", "upstream integrity (rank 0)")
WARMUP = 1
GIB = 1 << 30
MIB = 1 << 20
#: A save starts once the kernel's dirty and writeback pages are under this (a quiet
#: machine's background), or after ``SETTLE_TIMEOUT_S`` (what other processes dirty).
SETTLED_BYTES = 32 * MIB
SETTLE_TIMEOUT_S = 20.0


def _layer_shapes(hidden: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, global shape, axis split across ranks or None for replicated)."""
    h = hidden
    return [("qkv.weight", (3 * h, h), 0), ("qkv.bias", (3 * h,), 0),
            ("proj.weight", (h, h), 1), ("proj.bias", (h,), None),
            ("fc1.weight", (4 * h, h), 0), ("fc1.bias", (4 * h,), 0),
            ("fc2.weight", (h, 4 * h), 1), ("fc2.bias", (h,), None),
            ("ln1.weight", (h,), None), ("ln2.weight", (h,), None)]


def state_dict(rank: int, ws: int, layers: int, hidden: int) -> dict:
    """Weights and Adam's two moments of a GPT-like decoder, as megatron shards them."""
    from megatron.core.dist_checkpointing import ShardedTensor

    generator = torch.Generator().manual_seed(rank)
    # Replicas hold equal values on every rank (the same draws: every rank walks the same
    # keys), or the replica check refuses the save.
    shared = torch.Generator().manual_seed(ws)
    sd = {}
    for layer in range(layers):
        for name, shape, axis in _layer_shapes(hidden):
            for prefix in ("model", "optimizer.exp_avg", "optimizer.exp_avg_sq"):
                key = f"{prefix}.decoder.layers.{layer}.{name}"
                if axis is None:
                    local = torch.randn(shape, generator=shared)
                    sd[key] = ShardedTensor.from_rank_offsets(key, local, replica_id=rank)
                else:
                    local_shape = list(shape)
                    local_shape[axis] //= ws
                    local = torch.randn(local_shape, generator=generator)
                    sd[key] = ShardedTensor.from_rank_offsets(key, local, (axis, rank, ws))
    return sd


def _tensors(sd: dict) -> list[torch.Tensor]:
    return [t.data for t in sd.values()]


def _raw_write(tensors: list[torch.Tensor], directory: str, rank: int, files: int,
               early: bool = False) -> None:
    """Each file's share of the bytes written by its own thread, then fsynced; ``early``:
    each tensor of at least ``writeback.MIN_BYTES`` handed to the disk once written."""
    def write(part: int) -> None:
        end = 0  # the file's length so far: no tell() per tensor (a syscall), as the save's hint
        with open(os.path.join(directory, f"raw_{rank}_{part}"), "wb") as f:
            for tensor in tensors[part::files]:
                start, end = end, end + f.write(memoryview(tensor.numpy()).cast("B"))
                if early and end - start >= writeback.MIN_BYTES:
                    writeback.start_writeback(f, start, end)
            os.fsync(f.fileno())

    threads = [threading.Thread(target=write, args=(p,)) for p in range(files)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _checksum_work(tensors: list[torch.Tensor], root: str, rank: int,
                   rounds: int) -> tuple[float, float, float, float]:
    """CPU seconds the checksums add to megatron-core's own file writer
    (``FileSystemWriterAsync.write_preloaded_data``, writing all of this rank's tensors into
    one file on the measured disk, fsync included), as the median over ``rounds`` pairs of
    writes with and without the feature: (on the writer's thread, which hashes each piece as
    it writes it: the save's critical path; on the process's other threads, which should
    stay near zero; the process's CPU time with the feature / without it; the same for the
    writer's thread only).
    With the feature torch's own CRC-32 is skipped for the records it checksums, so the
    differences can be negative. CPU time, unlike wall time, is not inflated by other
    processes waiting for the same cores or disk."""
    import queue

    import megatron_ckpt_fixes
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    params = inspect.signature(
        inspect.unwrap(FileSystemWriterAsync.write_preloaded_data)).parameters
    transforms = []
    if "transform_list" in params:
        from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

        transforms = [_StorageWriterTransforms()]
    items = [(WriteItem(MetadataIndex(f"t{i}"), WriteItemType.TENSOR), t)
             for i, t in enumerate(tensors)]
    path = os.path.join(root, f"checksum_work_{rank}.distcp")

    def write(features: list[str]) -> tuple[float, float]:
        megatron_ckpt_fixes.uninstall()
        megatron_ckpt_fixes.install(features)
        results, count = queue.Queue(), queue.Queue()
        count.put(0)
        bucket = (path, os.path.basename(path), ([], items))
        gc.collect()
        thread, process = time.thread_time(), time.process_time()
        FileSystemWriterAsync.write_preloaded_data(transforms, 0, bucket, results, count, True)
        thread, process = time.thread_time() - thread, time.process_time() - process
        os.remove(path)
        return thread, process - thread

    writer, helpers, ratio, thread_ratio = [], [], [], []
    for r in range(rounds):
        order = [["compat.cpu"], ["compat.cpu", "checksums"]]
        timings = {len(f): write(f) for f in (order if r % 2 == 0 else order[::-1])}
        writer.append(timings[2][0] - timings[1][0])
        helpers.append(timings[2][1] - timings[1][1])
        ratio.append(sum(timings[2]) / sum(timings[1]))
        thread_ratio.append(timings[2][0] / timings[1][0])
    megatron_ckpt_fixes.uninstall()
    return (statistics.median(writer), statistics.median(helpers), statistics.median(ratio),
            statistics.median(thread_ratio))


def _evict(directory: str) -> None:
    """Drop the files' pages from the page cache (they are clean: fsynced)."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _size(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))


def _integrity_kwarg() -> str | None:
    """The name of ``dist_checkpointing.save``'s integrity-manifest flag, if any."""
    from megatron.core import dist_checkpointing as dc

    params = inspect.signature(dc.save).parameters
    return next((n for n in ("verify_integrity", "save_integrity") if n in params), None)


def fs_type(directory: str) -> str:
    """The file system type of the mount holding ``directory`` (from ``/proc/mounts``)."""
    path = os.path.realpath(directory)
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount, fstype = line.split()[:3]
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def mode_of(directory: str) -> str:
    """tmpfs where no disk is behind the files, disk otherwise."""
    return TMPFS if fs_type(directory) in ("tmpfs", "ramfs") else DISK


def _dirty_bytes() -> int:
    """The kernel's dirty and under-writeback page-cache bytes (``/proc/meminfo``)."""
    fields = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields["Dirty"] + fields["Writeback"]


def _settle() -> float:
    """``os.sync()``, then wait until the dirty and writeback pages are under
    ``SETTLED_BYTES`` (or ``SETTLE_TIMEOUT_S``): so that no save pays for the pages the one
    before it (or its delete) left. Seconds waited."""
    start = time.perf_counter()
    os.sync()
    while (_dirty_bytes() > SETTLED_BYTES
           and time.perf_counter() - start < SETTLE_TIMEOUT_S):
        time.sleep(0.01)
    return time.perf_counter() - start


def _cpu_tree() -> float:
    """CPU seconds of this process, its live descendants (megatron-core's persistent async
    worker, its forked writers) and every child they have reaped (0.16's per-save writer
    processes): ``getrusage``'s self and children, read for the whole tree."""
    total = 0.0
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            t = process.cpu_times()
        except psutil.NoSuchProcess:  # reaped meanwhile: counted in its parent's children
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _setups(mode: str, integrity: str | None) -> dict[str, Setup]:
    """The timed saves of a mode: on tmpfs each feature alone too, on the disk upstream's
    integrity manifest where the release has it."""
    saves = {n: s for n, s in SAVES.items() if not s.integrity or (integrity and mode == DISK)}
    return {**saves, **FEATURE_SAVES} if mode == TMPFS else saves


def _bench(rank: int, ws: int, layers: int, hidden: int, rounds: int, root: str, mode: str,
           settle: bool) -> dict:
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from tqdm import tqdm

    from megatron_ckpt_fixes.fixes import snapshot
    from megatron_ckpt_fixes.fixes.checksums import verify_checkpoint
    from megatron_ckpt_fixes.tools.cli.checks import verify

    integrity = _integrity_kwarg()
    saves = _setups(mode, integrity)
    sd = state_dict(rank, ws, layers, hidden)
    tensors = _tensors(sd)
    strategies = {name: TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
                  for name in saves}
    files = strategies[ALL].thread_count
    counter = iter(range(10**9))
    dirty: dict[str, list[int]] = {}  # bytes dirty or under writeback as each save started
    waits: list[float] = []  # the page-cache control's wait before each timed save

    def fresh() -> str:
        path = os.path.join(root, f"c{next(counter)}")
        if rank == 0:
            os.makedirs(path)
        dist.barrier()
        return path

    def drop(path: str) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
        dist.barrier()

    def use(name: str) -> None:
        megatron_ckpt_fixes.uninstall()
        megatron_ckpt_fixes.install(saves[name].features)

    def save(name: str, path: str) -> None:
        kwargs = {integrity: True} if saves[name].integrity else {}
        dc.save(sd, path, sharded_strategy=strategies[name], validate_access_integrity=False,
                **kwargs)

    mcore = ({"async_strategy": "mcore"}
             if "async_strategy" in inspect.signature(dc.save).parameters else {})

    def save_async(name: str, path: str, queue: AsyncCallsQueue) -> float:
        """An asynchronous save through the persistent worker; how long the trainer waited."""
        start = time.perf_counter()
        queue.schedule_async_request(dc.save(sd, path, sharded_strategy=strategies[name],
                                             validate_access_integrity=False,
                                             async_sharded_save=True, **mcore))
        blocked = time.perf_counter() - start
        queue.maybe_finalize_async_calls(blocking=True)
        return blocked

    def measured(name: str, fn) -> tuple[float, float]:
        """(wall, slowest rank; CPU of every rank's process tree, summed) of ``fn``, after
        the page-cache control (unless ``--no-settle``), a ``gc.collect()`` and a barrier."""
        if rank == 0:
            if settle:
                waits.append(_settle())
            dirty.setdefault(name, []).append(_dirty_bytes())
        cpu = _cpu_tree()
        wall = timed(fn)
        cpu = torch.tensor([_cpu_tree() - cpu], dtype=torch.float64)
        dist.all_reduce(cpu)
        return wall, cpu.item()

    def timed_async(name: str, path: str) -> tuple[float, float, float]:
        """(whole save, CPU, trainer blocked) in a worker spawned with ``name``'s features
        (megatron-core 0.19+ keeps one worker per process) after one untimed save."""
        queue = AsyncCallsQueue(persistent=True)
        warm = fresh()
        save_async(name, warm, queue)
        drop(warm)
        blocked: list[float] = []
        whole, cpu = measured(name, lambda: blocked.append(save_async(name, path, queue)))
        queue.close()
        return whole, cpu, max_over_ranks(blocked[0])

    def verify_one(name: str, kept: dict[str, str], cold: bool) -> float:
        megatron_ckpt_fixes.uninstall()
        megatron_ckpt_fixes.install(["compat.cpu"])
        path = kept[INTEGRITY if name == VERIFIES[2] else ALL]
        if cold and rank == 0:
            _evict(path)
        if name == VERIFIES[0]:
            def run() -> None:
                if rank == 0:
                    report = verify(path)
                    assert not report.problems and report.checksums.status == "verified", report
        elif name == VERIFIES[1]:
            def run() -> None:
                assert verify_checkpoint(path).status == "verified"
        else:
            from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

            def run() -> None:
                verify_integrity_manifest(path)
        return timed(run)

    for name in saves:  # warm every strategy's plan cache, as in training
        use(name)
        for _ in range(WARMUP):
            path = fresh()
            if saves[name].asynchronous:
                timed_async(name, path)
            else:
                save(name, path)
            drop(path)
    dirty.clear()
    waits.clear()
    times: dict[str, list[float]] = {name: [] for name in [RAW, RAW_EARLY, *saves]}
    times.update({name + BLOCKED: [] for name in saves if saves[name].asynchronous})
    cpus: dict[str, list[float]] = {name: [] for name in [RAW, RAW_EARLY, *saves]}
    copies: list[tuple[float, int, float]] = []  # the snapshot's (copy time, bytes, copy CPU)
    verifies = ([v for v in VERIFIES if integrity or v != VERIFIES[2]] if mode == DISK
                else [])
    speeds: dict[tuple[str, bool], list[float]] = {(v, c): [] for v in verifies
                                                   for c in (True, False)}
    order = [RAW, RAW_EARLY, *saves]
    for _ in tqdm(range(rounds), desc=f"{mode} rounds", disable=rank != 0):
        kept: dict[str, str] = {}
        for name in order:
            path = fresh()
            if name in (RAW, RAW_EARLY):
                wall, cpu = measured(name, lambda: _raw_write(tensors, path, rank, files,
                                                              early=name == RAW_EARLY))
            elif saves[name].asynchronous:
                use(name)
                wall, cpu, blocked = timed_async(name, path)
                times[name + BLOCKED].append(blocked)
                if name == ALL_ASYNC:
                    stats = snapshot.stats()
                    copies.append((max_over_ranks(stats.last_copy_s), stats.last_bytes,
                                   max_over_ranks(stats.last_copy_cpu_s)))
            else:
                use(name)
                wall, cpu = measured(name, lambda: save(name, path))
            times[name].append(wall)
            cpus[name].append(cpu)
            if verifies and name in (ALL, INTEGRITY):
                kept[name] = path
            else:
                drop(path)
        if verifies:
            size = _size(kept[ALL]) if rank == 0 else 0
            sizes = [0] * ws
            dist.all_gather_object(sizes, size)
            for cold in (True, False):
                for name in verifies if cold else reversed(verifies):
                    speeds[(name, cold)].append(max(sizes) / GIB / verify_one(name, kept, cold))
            for path in kept.values():
                drop(path)
            verifies.reverse()
        order.reverse()
    megatron_ckpt_fixes.uninstall()

    def paired(values: dict[str, list[float]], a: str, b: str) -> Spread:
        return Spread.of([x / y for x, y in zip(values[a], values[b])])

    pairs = {f"{ALL} / {UPSTREAM}": (ALL, UPSTREAM),
             f"{ALL_ASYNC} / {UPSTREAM_ASYNC}": (ALL_ASYNC, UPSTREAM_ASYNC),
             **({f"{INTEGRITY} / {UPSTREAM}": (INTEGRITY, UPSTREAM)} if INTEGRITY in saves
                else {}),
             **{f"{name} / {s.baseline}": (name, s.baseline)
                for name, s in saves.items() if s.baseline}}
    result = {
        "mode": mode, "settle": settle, "integrity": integrity, "rounds": rounds,
        "times": times, "cpus": cpus,
        "wall": {label: paired(times, a, b) for label, (a, b) in pairs.items()},
        "cpu": {label: paired(cpus, a, b) for label, (a, b) in pairs.items()},
        "blocked": paired(times, ALL_ASYNC + BLOCKED, UPSTREAM_ASYNC + BLOCKED),
        "dirty": {name: statistics.median(d) for name, d in dirty.items()},
        "waits": Spread.of(waits) if waits else None,
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "tensors": len(tensors), "files": files,
        "snapshot copy": (statistics.median(c[0] for c in copies), copies[-1][1],
                          snapshot.stats().bytes_allocated,
                          statistics.median(c[2] for c in copies)),
        "verify": {key: statistics.median(v) for key, v in speeds.items()}}
    if mode == TMPFS:
        result["checksum work"] = [max_over_ranks(w) for w in _checksum_work(
            tensors, root, rank, max(rounds, 5))]
    return result


def _common_state() -> dict:
    """A common state the size of Megatron-LM's: its args, the step, Adam's param groups."""
    return {"args": {f"arg_{i}": (i, f"value {i}", float(i)) for i in range(500)},
            "iteration": 1000, "checkpoint_version": 3.0,
            "optimizer": {"param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8,
                                            "weight_decay": 0.1, "params": list(range(200))}
                                           for _ in range(2)]}}


def _as_replicas(sd: dict) -> dict:
    """The same local tensors declared as data-parallel replicas of one model (equal on
    every rank: values from one seed)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    generator = torch.Generator().manual_seed(0)
    rank = dist.get_rank()
    return {key: ShardedTensor.from_rank_offsets(key, torch.randn(t.data.shape,
                                                                  generator=generator),
                                                 replica_id=rank)
            for key, t in sd.items()}


#: Timed checks of each design per round (each a few ms: one save's disk noise is larger).
REPLICA_REPEATS = 5
REPLICA_DESIGNS = ("plan time, steady state (cached plan)", "every save (tensors digested)",
                   "every save, every tensor a replica")


def _bench_replicas(rank: int, ws: int, layers: int, hidden: int, rounds: int,
                    root: str) -> dict:
    """The replica check's designs beside the all-fixes save (see the module docstring)."""
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megatron_ckpt_fixes.fixes.replicas.exchange import check_replicas

    megatron_ckpt_fixes.install()
    sd = state_dict(rank, ws, layers, hidden)
    replicas = _as_replicas(sd)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    common = _common_state()
    designs = {REPLICA_DESIGNS[0]: (sd, True), REPLICA_DESIGNS[1]: (sd, False),
               REPLICA_DESIGNS[2]: (replicas, False)}
    times: dict[str, list[float]] = {"all fixes": [], **{d: [] for d in designs}}

    def save() -> None:
        path = os.path.join(root, "c")
        if rank == 0:
            os.makedirs(path)
        dist.barrier()
        times["all fixes"].append(timed(lambda: dc.save({**sd, "common": common}, path,
                                                        sharded_strategy=strategy,
                                                        validate_access_integrity=False)))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)

    save()  # warms the plan cache and checks the tensors once, as a first save does
    times["all fixes"].clear()
    cpu: dict[str, list[float]] = {d: [] for d in designs}
    for r in range(rounds):
        save()
        for name in (list(designs) if r % 2 == 0 else list(designs)[::-1]):
            state, cached = designs[name]
            check_replicas(state, lambda: common, root, cached)  # the layout it is checked on
            for _ in range(REPLICA_REPEATS):
                spent: list[float] = []

                def check() -> None:
                    started = time.process_time()
                    check_replicas(state, lambda: common, root, cached)
                    spent.append(time.process_time() - started)

                times[name].append(timed(check))
                cpu[name].append(max_over_ranks(spent[0]))
    megatron_ckpt_fixes.uninstall()
    return {"median": {name: statistics.median(t) for name, t in times.items()},
            "cpu": {name: statistics.median(t) for name, t in cpu.items()},
            "bytes": sum(t.data.numel() * t.data.element_size() for t in sd.values())}


def _print_replicas(r: dict, args: argparse.Namespace, world: int) -> None:
    from importlib.metadata import version

    median = r["median"]
    base = median["all fixes"]
    print(f"\n{world} gloo rank(s), {args.layers} layers, hidden {args.hidden}: "
          f"{r['bytes'] / GIB:.3f} GiB per rank, {args.rounds} rounds, megatron-core "
          f"{version('megatron-core')}, in {args.dir}")
    print(f"  all-fixes save (cached plan, the check included): {base:.3f} s (median, "
          "slowest rank)")
    print("  the replica check alone (median of all timed checks), share of that save: wall "
          "(slowest rank); CPU (the busiest rank)")
    for name in REPLICA_DESIGNS:
        cpu = r["cpu"][name]
        print(f"    {name:40s} {median[name] * 1e3:8.2f} ms  {median[name] / base:7.2%};  "
              f"{cpu * 1e3:8.2f} ms  {cpu / base:7.2%}")
    if world > 1:  # one rank shares nothing: the check returns at once
        print(f"  digest throughput, every tensor a replica: "
              f"{r['bytes'] / GIB / median[REPLICA_DESIGNS[2]]:.2f} GiB/s per rank")
    share = median[REPLICA_DESIGNS[0]] / base
    print(f"  target: {'met    ' if share <= 0.02 else 'NOT MET'} plan-time design / save "
          f"{share:.2%} (target <= 2 %)")


def _print(r: dict, args: argparse.Namespace, directory: str) -> None:
    from importlib.metadata import version

    mode, times, cpus = r["mode"], r["times"], r["cpus"]
    print(f"\n== {mode}: {directory} ({fs_type(directory)}), {args.ranks} gloo rank(s), "
          f"{args.layers} layers, hidden {args.hidden}: {r['tensors']} tensors and "
          f"{r['bytes'] / GIB:.3f} GiB per rank ({r['files']} file(s) each), {r['rounds']} "
          f"rounds, megatron-core {version('megatron-core')}")
    control = (f"os.sync() and a wait until dirty+writeback pages < {SETTLED_BYTES // MIB} "
               f"MiB (wait {r['waits']} s)" if r["settle"] else "NO page-cache control "
               "(--no-settle): each save starts with what the one before it and its delete "
               "left dirty")
    print(f"  controlled: setups interleaved, order reversed each round; before each timed "
          f"save the previous checkpoint deleted, {control}, gc.collect() and a barrier")
    raw = statistics.median(times[RAW])
    print("  per save: wall s (slowest rank) median (min-max), share of raw write+fsync "
          "(medians); CPU s (all ranks' process trees) median; dirty+writeback MiB at start")
    for name, walls in times.items():
        spread = Spread.of(walls)
        line = (f"    {name:40s} {spread.median:6.3f} ({spread.low:.3f}-{spread.high:.3f})")
        if name in cpus:
            line += (f" {raw / spread.median:6.1%};  CPU {statistics.median(cpus[name]):6.3f}"
                     f";  {r['dirty'][name] / MIB:6.1f}")
        print(line)
    if not r["integrity"] and mode == DISK:
        print(f"    {INTEGRITY}: -, this megatron-core release has no integrity manifest "
              "(dist_checkpointing.save(..., verify_integrity=True) is 0.19's)")
    print("  paired per-round ratios, wall; CPU (median, q1-q3 from 4 rounds, min-max):")
    for label, wall in r["wall"].items():
        print(f"    {label}:\n      wall {wall}\n      CPU  {r['cpu'][label]}")
    print(f"    trainer blocked, {ALL_ASYNC} / {UPSTREAM_ASYNC}: {r['blocked']}")
    copy_s, copy_bytes, staging, copy_cpu = r["snapshot copy"]
    print(f"  snapshot copy of an async save ({ALL_ASYNC}): {copy_s * 1e3:.1f} ms "
          f"({copy_cpu * 1e3:.1f} ms CPU) for {copy_bytes / GIB:.3f} GiB per rank (median, "
          f"slowest rank), staging buffers {staging / GIB:.3f} GiB per rank")
    if mode == TMPFS:
        writer, helpers, _, _ = r["checksum work"]
        base = statistics.median(times[ALL])
        print(f"  checksum work in megatron-core's file writer, CPU time (slowest rank, median "
              f"of paired writes), share of the all-fixes save: on the writer's thread "
              f"{writer * 1e3:+.1f} ms = {writer / base:+.2%}; on other threads "
              f"{helpers * 1e3:+.1f} ms = {helpers / base:+.2%} (negative: torch's CRC-32 "
              f"skipped costs more than the checksum)")
    if r["verify"]:
        print("  verification, GiB of checkpoint per second (median):")
        for (name, cold), speed in sorted(r["verify"].items(),
                                          key=lambda kv: (not kv[0][1], kv[0][0])):
            print(f"    {'from disk ' if cold else 'page cache'}  {name:32s} {speed:6.2f} GiB/s")
        if not r["integrity"]:
            print("    upstream integrity (rank 0): -, the release has no integrity manifest")
    _print_targets(r)


def _print_targets(r: dict) -> None:
    """Each target of issue 33 with the figure it is judged on, met or not; on the disk as
    a measured verdict beside the disk's own spread."""
    times, disk = r["times"], r["mode"] == DISK

    def line(what: str, value: float, target: float, higher: bool, spread: str = "") -> None:
        met = value >= target if higher else value <= target
        verdict = ("met    " if met else "NOT MET") + (" (measured)" if disk else "")
        sign = ">=" if higher else "<="
        print(f"    {verdict} {what}: {value:.4f} (target {sign} {target}){spread}")

    raw = Spread.of(times[RAW])
    print(f"  targets ({r['mode']}):" + (
        f" the disk's own spread, raw write+fsync of the same bytes: min {raw.low:.3f} s, "
        f"median {raw.median:.3f} s, max {raw.high:.3f} s ({raw.high / raw.low:.2f}x)"
        if disk else ""))
    wall = r["wall"][f"{ALL} / {UPSTREAM}"]
    line(f"{ALL} / {UPSTREAM}, wall (paired median)", wall.median, 1.00, False,
         f"; spread {wall.low:.3f}-{wall.high:.3f}" if disk else "")
    blocked = r["blocked"]
    line(f"trainer blocked, {ALL_ASYNC} / {UPSTREAM_ASYNC} (paired median)", blocked.median,
         1.20, False, f"; spread {blocked.low:.3f}-{blocked.high:.3f}" if disk else "")
    ours = statistics.median(times[ALL])
    shares = [raw_s / ours for raw_s in (raw.low, raw.high)]
    line(f"{ALL} / {RAW} bandwidth, raw / save (medians)", raw.median / ours, 0.70, True,
         f"; with the raw write's min-max {shares[0]:.3f}-{shares[1]:.3f}" if disk else "")
    if not disk:
        line("writer CPU time, all fixes / upstream", r["checksum work"][2], 0.90, False)
    if r["integrity"] and r["verify"]:
        for cold in (True, False):
            ours = r["verify"][(VERIFIES[1], cold)]
            line(f"verification / upstream's SHA-256 manifest per GiB, "
                 f"{'from disk' if cold else 'page cache'}",
                 ours / r["verify"][(VERIFIES[2], cold)], 2.0, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"timed rounds of each directory (default {ROUNDS[TMPFS]} on "
                             f"tmpfs, {ROUNDS[DISK]} on a disk; replicas: 5)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--replicas", action="store_true",
                        help="measure the replica check's designs beside the save instead")
    parser.add_argument("--no-settle", dest="settle", action="store_false",
                        help="no page-cache control: each save starts with what the one "
                             "before it left dirty (to measure what the control changes)")
    parser.add_argument("--dir", action="append",
                        help="a directory to measure, repeatable; its mode (tmpfs or disk) "
                             "follows its file system (default /dev/shm and MCF_BENCH_DIR "
                             "or /var/tmp); each checkpoint is deleted once measured")
    args = parser.parse_args()
    args.dir = args.dir or ["/dev/shm", os.environ.get("MCF_BENCH_DIR", "/var/tmp")]
    if args.replicas:
        args.dir, args.rounds = args.dir[0], args.rounds or 5
        root = tempfile.mkdtemp(prefix="mcf-bench-", dir=args.dir)
        try:
            result = run_ranks(_bench_replicas, args.ranks, args.layers, args.hidden,
                               args.rounds, root, timeout_s=7200,
                               collective_timeout_s=1800)[0].value
        finally:
            shutil.rmtree(root, ignore_errors=True)
        _print_replicas(result, args, args.ranks)
        return
    for directory in args.dir:
        mode = mode_of(directory)
        root = tempfile.mkdtemp(prefix="mcf-bench-", dir=directory)
        try:
            result = run_ranks(_bench, args.ranks, args.layers, args.hidden,
                               args.rounds or ROUNDS[mode], root, mode, args.settle,
                               timeout_s=7200, collective_timeout_s=1800)[0].value
        finally:
            shutil.rmtree(root, ignore_errors=True)
        _print(result, args, directory)

if __name__ == "__main__":
    main()
