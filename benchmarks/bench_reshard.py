"""Benchmark: value-aware ZCH reshard vs a plain DCP load of the same bytes, 4->3 and 3->4.

A managed-collision table of 10 million admitted ids (12 million slots, embedding dim 8,
one optimizer-state row per slot) is saved with DCP at 4 ranks, loaded at 3 (plain positional
DCP load of the same bytes, then the value-aware reshard), saved again at 3 and loaded at 4
the same two ways. After 4 -> 3 -> 4 every rank checks that each of its original ids looks up
bitwise its original rows. Prints, per rank, wall time, CPU time (less sensitive to other
load on a shared machine) and peak RSS growth (peak minus the RSS before the load) of both,
the bytes of the rank's local shard (every buffer and row tensor), and the ratios: reshard
time / DCP time, reshard peak growth / local shard bytes. A warm-up plain load runs first so
both measured loads read from the page cache. ``--profile`` adds rank 0's cProfile of one
reshard (where the seconds go).

Not a test (no timings are asserted). Run: ``python benchmarks/bench_reshard.py`` (~2-3 min
on 2 cores; ``--ids``/``--slots`` to scale).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import tempfile
import threading
import time
import warnings

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tqdm import tqdm

from megatron_ckpt_fixes.reshard import (
    MISS_ID, BlockOwnership, Column, LocalTable, SlotRanges, TableShard, load_table, table_state_dict,
)
from megatron_ckpt_fixes.testing import run_ranks

logger = logging.getLogger("bench_reshard")
# torch 2.13 warns on every ShardedTensor use (the uneven layouts need it); keep the table readable.
warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
DIM = 8
PREFIX, EMB, OPT = "mc.t0", "ebc.t0.weight", "opt.t0.momentum"
IDS, SLOTS, COUNTS = (f"{PREFIX}._mch_sorted_raw_ids", f"{PREFIX}._mch_remapped_ids_mapping",
                      f"{PREFIX}._mch_counts")


class PeakRss:
    """Peak resident memory of this process while the block runs (sampled every 2 ms)."""

    def __enter__(self) -> "PeakRss":
        self._proc, self._stop = psutil.Process(), threading.Event()
        self.before = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def original_shard(rank: int, world: int, ids_total: int, slots_total: int, hash_size: int
                   ) -> tuple[TableShard, dict[str, torch.Tensor]]:
    """Saved rank ``rank``'s trained state: distinct sorted ids from its value block."""
    g = torch.Generator().manual_seed(rank)
    ranges = SlotRanges.even(slots_total, world)
    start, size = ranges.start(rank), ranges.size(rank)
    k = ids_total // world
    block = -(-hash_size // world)
    stride = block // k
    ids = rank * block + torch.arange(k) * stride + torch.randint(0, stride, (k,), generator=g)
    perm = start + torch.randperm(size - 1, generator=g)
    slots = torch.cat([perm[:k], perm[k:].sort().values, torch.tensor([start + size - 1])])
    del perm
    all_ids = torch.cat([ids, torch.full((size - k,), MISS_ID, dtype=torch.int64)])
    counts = torch.cat([torch.randint(1, 1 << 20, (k,), generator=g), torch.zeros(size - k, dtype=torch.int64)])
    rows = {EMB: torch.randn(size, DIM, generator=g), OPT: torch.randn(size, DIM, generator=g)}
    return TableShard(start, all_ids, slots, {"counts": counts}), rows


def local_table(ranges: SlotRanges, rank: int) -> LocalTable:
    """This rank's tensors of the table (empty: ids all MISS_ID, rows zero)."""
    start, size = ranges.start(rank), ranges.size(rank)
    return LocalTable(PREFIX, start, Column(IDS, torch.full((size,), MISS_ID, dtype=torch.int64)),
                      Column(SLOTS, torch.arange(start, start + size)),
                      {"counts": Column(COUNTS, torch.zeros(size, dtype=torch.int64))},
                      [Column(k, torch.zeros(size, DIM)) for k in (EMB, OPT)])


def local_bytes(table: LocalTable) -> int:
    """Bytes of this rank's shard of the table: every buffer and row tensor."""
    return sum(c.local.numel() * c.local.element_size() for c in (*table.buffers(), *table.rows))


def save_original(rank: int, world: int, ckpt: str, ids: int, slots: int, hash_size: int) -> None:
    ranges = SlotRanges.even(slots, world)
    table = local_table(ranges, rank)
    shard, rows = original_shard(rank, world, ids, slots, hash_size)
    for col, src in ((table.ids, shard.ids), (table.slots, shard.slots),
                     (table.metadata["counts"], shard.metadata["counts"]),
                     (table.rows[0], rows[EMB]), (table.rows[1], rows[OPT])):
        col.local.copy_(src)
    dcp.save(table_state_dict(table, slots), checkpoint_id=ckpt)


def plain_load(rank: int, world: int, ckpt: str, slots: int) -> None:
    """What DCP alone does: each rank reads its positional share of every buffer and row."""
    table = local_table(SlotRanges.even(slots, world), rank)
    dcp.load(table_state_dict(table, slots), checkpoint_id=ckpt)


def load_both(rank: int, world: int, ckpt: str, out_ckpt: str | None, ids: int, slots: int,
              hash_size: int, verify: bool, profile: bool = False) -> dict:
    """Plain DCP load, then the value-aware reshard, measured one after the other."""
    torch.set_num_threads(1)
    plain_load(rank, world, ckpt, slots)  # warm-up: page cache and code paths, for both runs
    dist.barrier()
    with PeakRss() as plain_mem:
        t0, c0 = time.perf_counter(), time.process_time()
        plain_load(rank, world, ckpt, slots)
        plain_cpu = time.process_time() - c0
        dist.barrier()
        plain_s = time.perf_counter() - t0
    ranges = SlotRanges.even(slots, world)
    table = local_table(ranges, rank)
    dist.barrier()
    profiler = cProfile.Profile() if profile else None
    with PeakRss() as reshard_mem:
        t0, c0 = time.perf_counter(), time.process_time()
        if profiler:
            profiler.enable()
        report = load_table(ckpt, table, ownership=BlockOwnership(hash_size))
        if profiler:
            profiler.disable()
        reshard_cpu = time.process_time() - c0
        dist.barrier()
        reshard_s = time.perf_counter() - t0
    wrong = -1
    if verify:  # back at the original world size: rank r owns exactly its original ids
        shard, original = original_shard(rank, world, ids, slots, hash_size)
        real = shard.ids != MISS_ID
        now = TableShard(table.start, table.ids.local, table.slots.local)
        got = now.lookup(shard.ids[real]) - ranges.start(rank)
        at = shard.slots[real] - shard.start
        wrong = int((table.rows[0].local[got] != original[EMB][at]).any(1).sum()
                    + (table.rows[1].local[got] != original[OPT][at]).any(1).sum())
    if out_ckpt is not None:
        dcp.save(table_state_dict(table, slots), checkpoint_id=out_ckpt)
    mib = 1 << 20
    return {"plain_s": plain_s, "reshard_s": reshard_s, "plain_cpu": plain_cpu,
            "reshard_cpu": reshard_cpu,
            "plain_peak": (plain_mem.peak - plain_mem.before) / mib,
            "reshard_peak": (reshard_mem.peak - reshard_mem.before) / mib, "base": plain_mem.before / mib,
            "evicted": report.evicted_total, "kept": report.kept_total, "wrong": wrong,
            "shard": local_bytes(table) / mib, "profile": _top(profiler) if profiler and rank == 0 else ""}


def _top(profiler: cProfile.Profile, n: int = 18) -> str:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(n)
    return text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", type=int, default=10_000_000, help="admitted ids in the table")
    ap.add_argument("--slots", type=int, default=12_000_000, help="slots (embedding rows)")
    ap.add_argument("--hash-size", type=int, default=1 << 40, help="input id space")
    ap.add_argument("--profile", action="store_true", help="print rank 0's cProfile of each reshard")
    ap.add_argument("--torchrec", action="store_true",
                    help="the real TorchRec model instead (4 -> 3; needs scripts/install_torchrec_cpu.sh)")
    ap.add_argument("--zch", type=int, default=3_000_000, help="--torchrec: slots of the MC table")
    ap.add_argument("--dim", type=int, default=16, help="--torchrec: embedding dim")
    ap.add_argument("--fill", type=float, default=0.8, help="--torchrec: admitted ids / slots")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.torchrec:
        return torchrec_main(args)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        c4, c3 = os.path.join(tmp, "at4"), os.path.join(tmp, "at3")
        common = (args.ids, args.slots, args.hash_size)
        steps = tqdm(total=3, desc="reshard benchmark", unit="run")
        run_ranks(save_original, 4, c4, *common, timeout_s=900)
        steps.update()
        down = [r.value for r in run_ranks(load_both, 3, c4, c3, *common, False, args.profile,
                                           timeout_s=900)]
        steps.update()
        up = [r.value for r in run_ranks(load_both, 4, c3, None, *common, True, args.profile,
                                         timeout_s=900)]
        steps.update()
        steps.close()
    lines = [f"ZCH table: {args.ids:,} ids, {args.slots:,} slots, dim {DIM} (+1 optimizer row "
             f"per slot); torch {torch.__version__}, {os.cpu_count()} CPUs",
             f"{'direction':<9} {'rank':>4} {'DCP load s':>10} {'reshard s':>9} {'time x':>6} "
             f"{'DCP cpu s':>9} {'reshard cpu s':>13} {'DCP +peak MiB':>13} {'reshard +peak MiB':>17} "
             f"{'shard MiB':>9} {'+peak/shard':>11}"]
    for name, results in (("4 -> 3", down), ("3 -> 4", up)):
        for rank, r in enumerate(results):
            lines.append(f"{name:<9} {rank:>4} {r['plain_s']:>10.2f} {r['reshard_s']:>9.2f} "
                         f"{r['reshard_s'] / r['plain_s']:>6.2f} {r['plain_cpu']:>9.2f} "
                         f"{r['reshard_cpu']:>13.2f} {r['plain_peak']:>13.0f} {r['reshard_peak']:>17.0f} "
                         f"{r['shard']:>9.0f} {r['reshard_peak'] / r['shard']:>11.2f}")
    lines.append(f"4 -> 3: kept {down[0]['kept']:,}, evicted {down[0]['evicted']}; "
                 f"3 -> 4: kept {up[0]['kept']:,}, evicted {up[0]['evicted']}; "
                 f"rows differing from the original after 4 -> 3 -> 4: {sum(r['wrong'] for r in up)}")
    for name, results in (("4 -> 3", down), ("3 -> 4", up)):
        if results[0]["profile"]:
            lines.append(f"rank 0 profile, {name}:\n{results[0]['profile']}")
    logger.info("\n".join(lines))


def torchrec_main(args: argparse.Namespace) -> None:
    import reshard_torchrec as rt

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        ckpt = os.path.join(tmp, "at4")
        steps = tqdm(total=2, desc="torchrec reshard benchmark", unit="run")
        samples = [r.value for r in run_ranks(rt.fill_and_save, 4, ckpt, args.zch, args.dim, args.fill,
                                              timeout_s=900)]
        steps.update()
        down = [r.value for r in run_ranks(rt.load_both, 3, ckpt, args.zch, args.dim, samples, PeakRss,
                                           timeout_s=900)]
        steps.update()
        steps.close()
    lines = [f"TorchRec MC-EC: {args.zch:,} slots, dim {args.dim}, {args.fill:.0%} filled, exact Adagrad "
             f"momentum; DMP row-wise fused; torch {torch.__version__}, {os.cpu_count()} CPUs",
             f"{'direction':<9} {'rank':>4} {'DCP load s':>10} {'reshard s':>9} {'time x':>6} "
             f"{'DCP +peak MiB':>13} {'reshard +peak MiB':>17} {'shard MiB':>9} {'+peak/shard':>11}"]
    for rank, r in enumerate(down):
        lines.append(f"{'4 -> 3':<9} {rank:>4} {r['plain_s']:>10.2f} {r['reshard_s']:>9.2f} "
                     f"{r['reshard_s'] / r['plain_s']:>6.2f} {r['plain_peak']:>13.0f} {r['reshard_peak']:>17.0f} "
                     f"{r['shard']:>9.0f} {r['reshard_peak'] / r['shard']:>11.2f}")
    lines.append(f"kept {down[0]['kept']:,}, evicted {down[0]['evicted']}; sampled ids checked "
                 f"{sum(r['checked'] for r in down):,}, rows or momentum differing: {sum(r['wrong'] for r in down)}")
    logger.info("\n".join(lines))


if __name__ == "__main__":
    main()
