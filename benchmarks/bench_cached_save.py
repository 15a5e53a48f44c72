"""Cost of the fixes on cached-plan saves (structure check, checksums), measured side by side.

Two gloo ranks save a state dict of N small ShardedTensors per rank repeatedly with four
setups, interleaved round by round so they share the machine's conditions:

- upstream uncached:   ``TorchDistSaveShardedStrategy(cached_metadata=False)``, plain megatron-core
- upstream cached:     ``cached_metadata=True``, plain megatron-core (``install(["compat.cpu"])``)
- fixes w/o checksums: ``cached_metadata=True`` after ``install()`` of every feature but checksums
- all fixes:           ``cached_metadata=True`` after ``install()``

Each setup keeps its strategy object across rounds (a warm cache, as in training) and is
warmed with three saves first. As in Megatron-LM under ``--ckpt-assume-constant-structure``,
only the first save validates the sharding (``--validate-every-save``: every save, which is
``dist_checkpointing.save``'s default). The order of the setups alternates from round to round and
every timed save starts after a ``gc.collect()``, so neither position nor a collection left
over from the previous setup favours one of them. A save's time is the slowest rank's.

Reported, per size: the median save time of each setup; two paired per-round ratios (each
round's two saves ran back to back, so the ratio cancels the machine's drift within a run),
each as its median, its quartiles (q1-q3, from 4 rounds on) and its min-max:
all fixes / upstream cached, and all fixes / fixes w/o checksums (what checksums add); and
the cost of each fix measured directly, as a share of the median all-fixes save: the
structure check (signature + agreement) and the checksum work (each item's write through the
checksumming ``_write_item`` minus the plain one, same items, same file system, plus writing
the record on the coordinator; CPU time, see ``_checksum_work``).
Targets: all fixes / upstream cached <= 1.03; structure check and checksums each < 2 % of a
cached save.

    python benchmarks/bench_cached_save.py [--sizes 5000 50000] [--rounds 15 5] [--validate-every-save]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_ckpt_fixes import FEATURES
from megatron_ckpt_fixes._dev.testing import run_ranks

SETUPS = {
    "upstream uncached": (["compat.cpu"], False),
    "upstream cached": (["compat.cpu"], True),
    "fixes w/o checksums": ([f for f in FEATURES if f != "checksums"], True),
    "all fixes": (None, True),
}
WARMUP = 3


@dataclass(frozen=True)
class Spread:
    """A sample's median, quartiles (None under 4 values) and range."""

    median: float
    q1: float | None
    q3: float | None
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        q1 = q3 = None
        if len(values) >= 4:
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(statistics.median(values), q1, q3, min(values), max(values))

    def __str__(self) -> str:
        quartiles = "" if self.q1 is None else f", q1-q3 {self.q1:.3f}-{self.q3:.3f}"
        return f"median {self.median:.3f}{quartiles}, min-max {self.low:.3f}-{self.high:.3f}"


def _state_dict(n: int, rank: int, ws: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {f"layer{i}.weight": ShardedTensor.from_rank_offsets(
        f"layer{i}.weight", torch.full((16,), float(i)), (0, rank, ws)) for i in range(n)}


def max_over_ranks(seconds: float) -> float:
    elapsed = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def timed(fn) -> float:
    gc.collect()
    dist.barrier()
    start = time.perf_counter()
    fn()
    return max_over_ranks(time.perf_counter() - start)


def _checksum_work(n: int, rank: int, root: str, rounds: int) -> float:
    """The extra time the checksums feature puts on a save of ``n`` tensors per rank: every
    item written through the checksumming ``_write_item`` minus the plain one (the same
    items into a file on the same file system, alternating which goes first, the garbage
    collector off as in megatron-core's writer), plus the coordinator's record of every
    rank's results. CPU time of this process: the work is CPU-bound (the file is in
    /dev/shm), and unlike wall time it is not inflated by other processes on the machine."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from megatron_ckpt_fixes.fixes.checksums.record import write_record
    from megatron_ckpt_fixes.fixes.checksums.writer import checksummed_write_item, record_of

    plain = filesystem_async._write_item  # megatron-core's own (uninstalled in this setup)
    wrapped = checksummed_write_item(plain)
    kwargs = {}
    if "serialization_format" in inspect.signature(plain).parameters:
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        kwargs["serialization_format"] = SerializationFormat.TORCH_SAVE
    transforms = [_StorageWriterTransforms()] if "transforms" in inspect.signature(
        plain).parameters else []
    items = [(WriteItem(MetadataIndex(f"layer{i}.weight", torch.Size([rank * 16])),
                        WriteItemType.SHARD), torch.full((16,), float(i))) for i in range(n)]
    path = os.path.join(root, f"checksum_work_{rank}.distcp")

    def write(fn):
        with open(path, "wb") as stream:
            return [fn(*transforms, stream, t, item, os.path.basename(path), **kwargs)
                    for item, t in items]

    extra = []
    for r in range(rounds):
        order = (plain, wrapped) if r % 2 == 0 else (wrapped, plain)
        times = {}
        for fn in order:
            gc.collect()
            gc.disable()  # as in megatron-core's writer (write_preloaded_data is _disable_gc'd)
            start = time.process_time()
            write(fn)
            times[fn] = time.process_time() - start
            gc.enable()
        extra.append(times[wrapped] - times[plain])
    all_results = [None] * dist.get_world_size()
    dist.all_gather_object(all_results, write(wrapped))
    start = time.process_time()
    if rank == 0:
        write_record(root, record_of(all_results, "bench")[0])
    record_s = time.process_time() - start
    os.remove(path)
    return max_over_ranks(statistics.median(extra) + record_s)


def _bench(rank: int, ws: int, sizes: list[int], rounds: list[int], root: str,
           validate_every_save: bool) -> dict:
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from tqdm import tqdm

    from megatron_ckpt_fixes.fixes.structure import StructureGuard

    results: dict = {}
    counter = iter(range(10**9))

    def save(sd, strategy, validate=validate_every_save):
        path = os.path.join(root, f"c{next(counter)}")
        if rank == 0:
            os.makedirs(path)
        dist.barrier()
        dc.save(sd, path, sharded_strategy=strategy, validate_access_integrity=validate)
        return path

    def dropped(path):
        """Each checkpoint is deleted once timed (a 50k-tensor one is ~100 MB in /dev/shm)."""
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)

    def use(name):
        megatron_ckpt_fixes.uninstall()
        megatron_ckpt_fixes.install(SETUPS[name][0])

    for n, n_rounds in zip(sizes, rounds):
        sd = _state_dict(n, rank, ws)
        strategies = {name: TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=cached)
                      for name, (_, cached) in SETUPS.items()}
        times: dict[str, list[float]] = {name: [] for name in SETUPS}
        for name in SETUPS:
            use(name)
            for i in range(WARMUP):
                dropped(save(sd, strategies[name], validate=i == 0 or validate_every_save))
        order = list(SETUPS)
        for _ in tqdm(range(n_rounds), desc=f"{n} tensors/rank", disable=rank != 0):
            for name in order:
                use(name)
                paths: list[str] = []
                times[name].append(timed(lambda: paths.append(save(sd, strategies[name]))))
                dropped(paths[0])
            order.reverse()
        megatron_ckpt_fixes.install()
        guard = StructureGuard()
        guard.should_replan(sd, "bench")
        check = [timed(lambda: guard.should_replan(sd, "bench")) for _ in range(n_rounds)]
        megatron_ckpt_fixes.uninstall()
        megatron_ckpt_fixes.install(["compat.cpu"])
        result = {"rounds": n_rounds,
                  "median": {name: statistics.median(t) for name, t in times.items()},
                  "structure check": statistics.median(check),
                  "checksum work": _checksum_work(n, rank, root, max(n_rounds, 5))}
        result["all fixes / upstream cached"] = Spread.of(
            [a / u for a, u in zip(times["all fixes"], times["upstream cached"])])
        result["all fixes / fixes w/o checksums"] = Spread.of(
            [a / b for a, b in zip(times["all fixes"], times["fixes w/o checksums"])])
        results[n] = result
    return results


def _print(n: int, r: dict) -> None:
    print(f"\n{n} tensors/rank, {r['rounds']} rounds: median save time, 2 gloo ranks "
          "(slowest rank)")
    print("  " + ", ".join(f"{name} {r['median'][name]:.3f}s" for name in SETUPS))
    print("  paired per-round ratios:")
    for ratio in ("all fixes / upstream cached", "all fixes / fixes w/o checksums"):
        print(f"    {ratio}: {r[ratio]}")
    base = r["median"]["all fixes"]
    print(f"  direct cost, share of the median all-fixes save: structure check "
          f"{r['structure check']:.3f}s = {r['structure check'] / base:.2%}; checksums "
          f"{r['checksum work']:.3f}s = {r['checksum work'] / base:.2%}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[5000, 50000])
    parser.add_argument("--rounds", type=int, nargs="+", default=[15, 5],
                        help="timed rounds per size (the last value repeats)")
    parser.add_argument("--validate-every-save", action="store_true",
                        help="validate the sharding on every save (dist_checkpointing.save's "
                             "default) instead of on the first save only, as Megatron-LM does "
                             "under --ckpt-assume-constant-structure")
    args = parser.parse_args()
    rounds = (args.rounds + args.rounds[-1:] * len(args.sizes))[:len(args.sizes)]
    base = os.environ.get("MCF_BENCH_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    for n, n_rounds in zip(args.sizes, rounds):  # a process group per size: printed when done
        root = tempfile.mkdtemp(dir=base)
        try:
            res = run_ranks(_bench, 2, [n], [n_rounds], root, args.validate_every_save,
                            timeout_s=7200,
                            collective_timeout_s=1800)[0].value
        finally:
            shutil.rmtree(root, ignore_errors=True)
        _print(n, res[n])


if __name__ == "__main__":
    main()
