"""Benchmark: value-aware ZCH reshard vs a plain DCP load of the same bytes, 4->3 and 3->4.

A managed-collision table of 10 million admitted ids (12 million slots, embedding dim 8,
one optimizer-state row per slot) is saved with DCP at 4 ranks, loaded at 3 (plain positional
DCP load of the same bytes, then the value-aware reshard), saved again at 3 and loaded at 4
the same two ways. After 4 -> 3 -> 4 every rank checks that each of its original ids looks up
bitwise its original rows. Prints, per rank, wall time, CPU time (less sensitive to other load on a shared machine) and peak RSS growth (peak minus the RSS before the load) of both,
and the ratios. A warm-up plain load runs first so both measured loads read from the page cache.

Not a test (no timings are asserted). Run: ``python benchmarks/bench_reshard.py`` (~2-3 min
on 2 cores; ``--ids`` to scale).
"""

from __future__ import annotations

import argparse
import logging
import os
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
    MISS_ID, BlockOwnership, SlotRanges, TableShard, ZchTable, load_mch, mch_state_dict, sharded_rows,
)
from megatron_ckpt_fixes.testing import run_ranks

logger = logging.getLogger("bench_reshard")
# torch 2.13 warns on every ShardedTensor use (the uneven layouts need it); keep the table readable.
warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
DIM = 8
PREFIX, EMB, OPT = "mc.t0", "ebc.t0.weight", "opt.t0.momentum"


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


def save_original(rank: int, world: int, ckpt: str, ids: int, slots: int, hash_size: int) -> None:
    module = ZchTable(SlotRanges.even(slots, world), rank)
    table, rows = original_shard(rank, world, ids, slots, hash_size)
    module.set_table(table)
    module._current_iter_tensor.fill_(1234)
    dcp.save(mch_state_dict(PREFIX, module, rows), checkpoint_id=ckpt)


def plain_load(rank: int, world: int, ckpt: str, slots: int) -> None:
    """What DCP alone does: each rank reads its positional share of every buffer and row."""
    ranges = SlotRanges.even(slots, world)
    start, size = ranges.start(rank), ranges.size(rank)
    state = {f"{PREFIX}.{name}": sharded_rows(torch.empty(size, dtype=torch.int64), start, slots)
             for name in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_counts")}
    state.update({k: sharded_rows(torch.empty(size, DIM), start, slots) for k in (EMB, OPT)})
    dcp.load(state, checkpoint_id=ckpt)


def load_both(rank: int, world: int, ckpt: str, out_ckpt: str | None, ids: int, slots: int,
              hash_size: int, verify: bool) -> dict:
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
    module = ZchTable(ranges, rank)
    rows = {k: torch.zeros(ranges.size(rank), DIM) for k in (EMB, OPT)}
    dist.barrier()
    with PeakRss() as reshard_mem:
        t0, c0 = time.perf_counter(), time.process_time()
        report = load_mch(ckpt, PREFIX, module, rows, ownership=BlockOwnership(hash_size))
        reshard_cpu = time.process_time() - c0
        dist.barrier()
        reshard_s = time.perf_counter() - t0
    wrong = -1
    if verify:  # back at the original world size: rank r owns exactly its original ids
        table, original = original_shard(rank, world, ids, slots, hash_size)
        real = table.ids != MISS_ID
        got = module.remap(table.ids[real]) - ranges.start(rank)
        wrong = int((rows[EMB][got] != original[EMB][table.slots[real] - table.start]).any(1).sum()
                    + (rows[OPT][got] != original[OPT][table.slots[real] - table.start]).any(1).sum())
    if out_ckpt is not None:
        dcp.save(mch_state_dict(PREFIX, module, rows), checkpoint_id=out_ckpt)
    mib = 1 << 20
    return {"plain_s": plain_s, "reshard_s": reshard_s, "plain_cpu": plain_cpu,
            "reshard_cpu": reshard_cpu,
            "plain_peak": (plain_mem.peak - plain_mem.before) / mib,
            "reshard_peak": (reshard_mem.peak - reshard_mem.before) / mib, "base": plain_mem.before / mib,
            "evicted": report.evicted_total, "kept": report.kept_total, "wrong": wrong,
            "counter": int(module._current_iter_tensor)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", type=int, default=10_000_000, help="admitted ids in the table")
    ap.add_argument("--slots", type=int, default=12_000_000, help="slots (embedding rows)")
    ap.add_argument("--hash-size", type=int, default=1 << 40, help="input id space")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        c4, c3 = os.path.join(tmp, "at4"), os.path.join(tmp, "at3")
        common = (args.ids, args.slots, args.hash_size)
        steps = tqdm(total=3, desc="reshard benchmark", unit="run")
        run_ranks(save_original, 4, c4, *common, timeout_s=900)
        steps.update()
        down = [r.value for r in run_ranks(load_both, 3, c4, c3, *common, False, timeout_s=900)]
        steps.update()
        up = [r.value for r in run_ranks(load_both, 4, c3, None, *common, True, timeout_s=900)]
        steps.update()
        steps.close()
    lines = [f"ZCH table: {args.ids:,} ids, {args.slots:,} slots, dim {DIM} (+1 optimizer row "
             f"per slot); torch {torch.__version__}, {os.cpu_count()} CPUs",
             f"{'direction':<9} {'rank':>4} {'DCP load s':>10} {'reshard s':>9} {'time x':>6} "
             f"{'DCP cpu s':>9} {'reshard cpu s':>13} "
             f"{'DCP +peak MiB':>13} {'reshard +peak MiB':>17} {'mem x':>5} {'base MiB':>8}"]
    for name, results in (("4 -> 3", down), ("3 -> 4", up)):
        for rank, r in enumerate(results):
            lines.append(f"{name:<9} {rank:>4} {r['plain_s']:>10.2f} {r['reshard_s']:>9.2f} "
                         f"{r['reshard_s'] / r['plain_s']:>6.2f} {r['plain_cpu']:>9.2f} {r['reshard_cpu']:>13.2f} "
                         f"{r['plain_peak']:>13.0f} "
                         f"{r['reshard_peak']:>17.0f} {r['reshard_peak'] / r['plain_peak']:>5.2f} "
                         f"{r['base']:>8.0f}")
    lines.append(f"4 -> 3: kept {down[0]['kept']:,}, evicted {down[0]['evicted']}; "
                 f"3 -> 4: kept {up[0]['kept']:,}, evicted {up[0]['evicted']}; "
                 f"rows differing from the original after 4 -> 3 -> 4: {sum(r['wrong'] for r in up)}; "
                 f"counter {up[0]['counter']}")
    logger.info("\n".join(lines))


if __name__ == "__main__":
    main()
