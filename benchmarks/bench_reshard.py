"""Benchmark: value-aware ZCH reshard against a plain DCP load of the same bytes, N -> M ranks.

The claims (issue 24): loading a managed-collision table at another world size by value
costs at most 1.5x a plain DCP load of it, and its extra memory follows the local shard
(each rank reads only the rows it serves, by byte range, never a whole saved chunk). Two
tables:

* default: a generic key -> slot table (``--ids`` 10 M ids in ``--slots`` 12 M slots,
  ``--dim`` 8, one optimizer row per slot) loaded with ``reshard.load_table``;
* ``--torchrec``: the TorchRec model of the tests (``tests/functional/torchrec_model.py``:
  a ``ManagedCollisionEmbeddingCollection``, DistanceLFU metadata, DMP row-wise, fused CPU
  kernel, exact Adagrad) at ``--slots`` 3 M slots, dim 16, 80 % filled, loaded with
  ``reshard.torchrec_dmp.load`` against a plain ``dcp.load`` of ``{"model", "optim"}``.
  Its state is filled directly (ids from each rank's routing block, a random slot
  permutation, random rows and momentum): training to this size would take hours.

For each direction (``--directions 4:3,3:4``) the table is saved at N ranks; then one spawn
of M ranks runs a warm-up plain load (page cache and code paths) and ``--repeats`` rounds
of: a plain DCP load (positional: what DCP alone reads), the floor (this rank's shard bytes
through ``all_to_all_single`` on the same gloo group, in 64 MiB pieces) and the reshard,
the two loads alternating in order. Each timed step runs between two barriers: its wall
time is the slowest rank's. Also printed: CPU seconds of all ranks, peak RSS growth per rank
(sampled every 2 ms; the destination tensors exist before; mapped pages of the checkpoint
count, as RSS counts them) against the bytes of the rank's local shard (every buffer and
row tensor of the table) and of the whole table, and the share of the checkpoint in the
page cache before each timed load (``fincore``); garbage is collected before each step.
When two directions load the same saved world size at two world sizes (``3:2,3:4``), a line
compares their extra peaks (the memory target: at 4 ranks at most 0.6x the one at 2).
RSS growth undercounts memory that the heap still held from an earlier step (glibc keeps
freed blocks resident and its mmap threshold grows), so it depends on what ran before;
``--fresh-memory`` fixes glibc's threshold at 128 KiB in the ranks (``MALLOC_MMAP_THRESHOLD_``):
every large allocation then maps fresh pages and unmaps them when freed, and +peak counts
every byte alive at the peak (timings then include every first touch, for both loads).
Cells are the median over the rounds and the range. After the first reshard each rank checks sampled ids it serves now: their
rows and optimizer rows bitwise the saved ones (the tests check every id).

Not a test (no timings are asserted). ``--profile`` adds each rank's CPU profile of the
first reshard. Run: ``python benchmarks/bench_reshard.py [--torchrec]`` (a few minutes on 2
cores; with ``--torchrec --slots 30000000`` about 3 GiB per rank at the peak, 9-11 GiB in
all).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import logging
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron_ckpt_fixes.reshard import (
    MISS_ID, BlockOwnership, Column, LocalTable, SlotRanges, TableShard, load_table, table_state_dict,
)
from megatron_ckpt_fixes._dev.testing import run_ranks

# The TorchRec model is the tests' own builder (one model, one place); spawned ranks import it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "functional"))

logger = logging.getLogger("bench_reshard")
# torch 2.13 warns on every ShardedTensor use (the uneven layouts need it); keep the output readable.
warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
MIB = 1 << 20
SAMPLE = 2000  # ids per saved rank whose rows are compared after the first reshard
FLOOR_PIECE = 64 * MIB
PREFIX, EMB, OPT = "mc.t0", "ebc.t0.weight", "opt.t0.momentum"
IDS, SLOTS, COUNTS = (f"{PREFIX}._mch_sorted_raw_ids", f"{PREFIX}._mch_remapped_ids_mapping",
                      f"{PREFIX}._mch_counts")


@dataclass(frozen=True)
class Config:
    torchrec: bool
    slots: int
    ids: int  # admitted ids (all ranks)
    dim: int
    hash_size: int

    def owner(self, ids: torch.Tensor, world: int) -> torch.Tensor:
        """The rank that serves each id at ``world`` ranks (TorchRec's routing or its rule)."""
        if self.torchrec:
            import torchrec_model as tm
            from megatron_ckpt_fixes.integrations.torchrec import TorchRecRouting

            return TorchRecRouting(self.hash_size, tm.BUCKETS).owner(ids, world)
        return BlockOwnership(self.hash_size).owner(ids, world)


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


def cache_resident(path: str) -> float | None:
    """Share of the checkpoint's bytes in the page cache (``fincore``); None if unknown."""
    files = [str(p) for p in Path(path).iterdir() if p.is_file()]
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES,SIZE", *files],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    pairs = [tuple(map(int, line.split())) for line in out.splitlines() if line.strip()]
    return sum(r for r, _ in pairs) / max(sum(s for _, s in pairs), 1)


def timed(step: Callable[[], Any]) -> tuple[dict, Any]:
    """Run one collective step between barriers: wall (this rank's view of the slowest), CPU,
    page faults (fresh memory touched: the main cost of a load from the page cache), peak
    RSS growth."""
    gc.collect()  # a collection of the previous step's garbage is not this step's cost
    dist.barrier()
    with PeakRss() as mem:
        t0, c0, f0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        value = step()
        cpu = time.process_time() - c0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        dist.barrier()
        wall = time.perf_counter() - t0
    return {"wall": wall, "cpu": cpu, "faults": faults, "peak": mem.peak - mem.before}, value


def all_to_all_floor(nbytes: int) -> None:
    """``nbytes`` through all_to_all_single on every rank (the largest rank's shard: every rank
    runs the same exchanges), split evenly over the ranks."""
    world = dist.get_world_size()
    largest = torch.tensor([nbytes], dtype=torch.int64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    nbytes = int(largest)
    piece = max(world, min(FLOOR_PIECE, nbytes) // world * world)
    send, recv = torch.ones(piece, dtype=torch.uint8), torch.empty(piece, dtype=torch.uint8)
    for _ in range(-(-nbytes // piece)):
        dist.all_to_all_single(recv, send)


# ---- the generic table ------------------------------------------------------------------

def _generic_table(cfg: Config, ranges: SlotRanges, rank: int) -> LocalTable:
    """This rank's tensors of the table (empty: ids all MISS_ID, rows zero)."""
    start, size = ranges.start(rank), ranges.size(rank)
    return LocalTable(PREFIX, start, Column(IDS, torch.full((size,), MISS_ID, dtype=torch.int64)),
                      Column(SLOTS, torch.arange(start, start + size)),
                      {"counts": Column(COUNTS, torch.zeros(size, dtype=torch.int64))},
                      [Column(k, torch.zeros(size, cfg.dim)) for k in (EMB, OPT)])


class BenchTable:
    """One rank's table at one world size, as each benchmark measures it."""

    def state(self) -> dict:
        """What ``dcp.save``/``dcp.load`` take (the table's tensors, in place)."""
        raise NotImplementedError

    def save(self, ckpt: str) -> None:
        dcp.save(self.state(), checkpoint_id=ckpt)

    def plain(self, ckpt: str) -> None:
        """A plain positional DCP load: what DCP alone reads."""
        dcp.load(self.state(), checkpoint_id=ckpt)

    def after_plain(self) -> None:
        """Undo what a plain load breaks for the next step (untimed)."""

    def check_state(self) -> None:
        """The owner's own validation after a reshard."""


class GenericTable(BenchTable):
    """The generic table at one world size: this rank's ``LocalTable``."""

    def __init__(self, cfg: Config, rank: int, world: int) -> None:
        self.cfg, self.ranges = cfg, SlotRanges.even(cfg.slots, world)
        self.table = _generic_table(cfg, self.ranges, rank)

    def lookup(self) -> tuple[TableShard, torch.Tensor, torch.Tensor]:
        t = self.table
        return TableShard(t.start, t.ids.local, t.slots.local), t.rows[0].local, t.rows[1].local

    def fill(self, rank: int, world: int, g: torch.Generator, ids: torch.Tensor) -> None:
        t, k, size = self.table, int(ids.numel()), self.table.size
        t.ids.local[:k] = ids
        perm = t.start + torch.randperm(size - 1, generator=g)
        t.slots.local.copy_(torch.cat([perm[:k], perm[k:].sort().values, torch.tensor([t.start + size - 1])]))
        t.metadata["counts"].local[:k] = torch.randint(1, 1 << 20, (k,), generator=g)
        for col in t.rows:
            col.local.copy_(torch.randn(col.local.shape, generator=g))

    def state(self) -> dict:
        return table_state_dict(self.table, self.cfg.slots)

    def reshard(self, ckpt: str) -> tuple[int, int]:
        report = load_table(ckpt, self.table, ownership=BlockOwnership(self.cfg.hash_size))
        return report.kept_total, report.evicted_total

    def shard_bytes(self) -> int:
        return sum(c.local.nbytes for c in (*self.table.buffers(), *self.table.rows))


class TorchRecTable(BenchTable):
    """The TorchRec model of the tests at one world size (``--torchrec``)."""

    def __init__(self, cfg: Config, rank: int, world: int) -> None:
        import torchrec_model as tm

        self.tm = tm
        self.model = tm.build(world, 0, cfg.slots, cfg.dim, cfg.hash_size)
        self.mc = tm.mc_module(self.model)
        # A plain positional load writes the saved output segments; the value-aware load
        # keeps the model's own. Restored after each plain load (untimed) so that TorchRec's
        # validate_state in the check after the reshard sees the model's.
        self.segments = self.mc._output_segments_tensor.clone()

    def lookup(self) -> tuple[TableShard, torch.Tensor, torch.Tensor]:
        weight, momentum = self.tm.table_rows(self.model)
        mc = self.mc
        return TableShard(mc._output_global_offset, mc._mch_sorted_raw_ids, mc._mch_remapped_ids_mapping), \
            weight, momentum

    @torch.no_grad()
    def fill(self, rank: int, world: int, g: torch.Generator, ids: torch.Tensor) -> None:
        mc, k = self.mc, int(ids.numel())
        size, start = mc.output_size(), mc._output_global_offset
        mc._mch_sorted_raw_ids[:k] = ids
        perm = start + torch.randperm(size - 1, generator=g)
        mc._mch_remapped_ids_mapping.copy_(torch.cat([perm[:k], perm[k:].sort().values,
                                                      torch.tensor([start + size - 1])]))
        mc._mch_counts[:k] = torch.randint(1, 1 << 20, (k,), generator=g)
        mc._mch_last_access_iter[:k] = torch.randint(0, 1000, (k,), generator=g)
        mc._current_iter_tensor.fill_(1000)
        for rows in self.tm.table_rows(self.model):
            rows.copy_(torch.rand(rows.shape, generator=g))

    def state(self) -> dict:
        return self.tm.state_dict(self.model)

    def after_plain(self) -> None:
        self.mc._output_segments_tensor.copy_(self.segments)

    def reshard(self, ckpt: str) -> tuple[int, int]:
        from megatron_ckpt_fixes.integrations.torchrec import load

        report = next(iter(load(self.state(), ckpt, self.model).values()))
        return report.kept_total, report.evicted_total

    def check_state(self) -> None:
        self.model.load_state_dict(self.state()["model"])  # TorchRec's validate_state passes

    def shard_bytes(self) -> int:
        mc = self.mc
        buffers = [mc._mch_sorted_raw_ids, mc._mch_remapped_ids_mapping, *mc._mch_metadata.values()]
        return sum(t.nbytes for t in (*buffers, *self.tm.table_rows(self.model)))


def _table(cfg: Config, rank: int, world: int) -> BenchTable:
    torch.set_num_threads(1)
    return TorchRecTable(cfg, rank, world) if cfg.torchrec else GenericTable(cfg, rank, world)


def save_job(rank: int, world: int, ckpt: str, cfg: Config) -> dict:
    """Fill this rank's table like a trained one (ids from its routing block) and save it;
    returns sampled ids with their rows (Python values: exact, and no shared memory)."""
    table = _table(cfg, rank, world)
    g = torch.Generator().manual_seed(rank)
    shard, _, _ = table.lookup()
    k = min(cfg.ids // world, shard.size - 1)
    block = -(-cfg.hash_size // world)
    stride = block // k
    ids = rank * block + torch.arange(k) * stride + torch.randint(0, stride, (k,), generator=g)
    with torch.no_grad():
        table.fill(rank, world, g, ids)
    table.save(ckpt)
    shard, emb, opt = table.lookup()
    pick = torch.randperm(k, generator=g)[:SAMPLE]
    local = shard.slots[pick] - shard.start
    return {"ids": ids[pick].tolist(), "emb": emb[local].tolist(), "opt": opt[local].tolist()}


def _check(table: BenchTable, cfg: Config, rank: int, world: int, samples: Sequence[dict]) -> tuple[int, int]:
    """Sampled ids this rank serves now: found, with their saved rows bitwise. (checked, wrong)"""
    table.check_state()
    shard, emb, opt = table.lookup()
    checked = wrong = 0
    for sample in samples:
        ids = torch.tensor(sample["ids"])
        mine = (cfg.owner(ids, world) == rank).nonzero().squeeze(1)
        local = shard.lookup(ids[mine]) - shard.start
        for j, i in enumerate(mine.tolist()):
            checked += 1
            slot = int(local[j])
            wrong += int(slot == shard.size - 1 or emb[slot].tolist() != sample["emb"][i]
                         or opt[slot].tolist() != sample["opt"][i])
    return checked, wrong


def load_job(rank: int, world: int, ckpt: str, cfg: Config, samples: Sequence[dict], repeats: int,
             profile: bool) -> dict:
    """A warm-up plain load, then ``repeats`` rounds of plain load, floor and reshard."""
    table = _table(cfg, rank, world)
    table.plain(ckpt)  # warm-up: page cache and code paths, for both loads
    table.after_plain()
    shard = table.shard_bytes()
    rounds, checked, wrong, kept, evicted, profile_text = [], 0, 0, 0, 0, ""
    for r in range(repeats):
        resident: dict[str, float | None] = {}
        results: dict[str, dict] = {}
        for what in (("plain", "reshard") if r % 2 == 0 else ("reshard", "plain")):
            resident[what] = cache_resident(ckpt) if rank == 0 else None
            if what == "plain":
                results["plain"], _ = timed(lambda: table.plain(ckpt))
                table.after_plain()
            else:
                prof = cProfile.Profile(time.process_time) if profile and r == 0 else None
                results["reshard"], (kept, evicted) = timed(
                    lambda: prof.runcall(table.reshard, ckpt) if prof else table.reshard(ckpt))
                if prof:
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
                    profile_text = text.getvalue()
                if r == 0:
                    checked, wrong = _check(table, cfg, rank, world, samples)
        results["floor"], _ = timed(lambda: all_to_all_floor(shard))
        rounds.append({"results": results, "resident": resident})
    return {"rounds": rounds, "shard": shard, "checked": checked, "wrong": wrong, "kept": kept,
            "evicted": evicted, "profile": profile_text}


# ---- summary ----------------------------------------------------------------------------

def _cell(values: Sequence[float], fmt: str) -> str:
    med = statistics.median(values)
    return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def summarize(name: str, direction: str, per_rank: list[dict]) -> tuple[str, list[str], float]:
    """One table row (median and range over the rounds), the notes for a direction, and the
    median extra peak of the reshard in bytes (the largest rank's)."""
    rounds = len(per_rank[0]["rounds"])

    def over(step: str, key: str, agg: Callable[[list[float]], float]) -> list[float]:
        return [agg([r["rounds"][i]["results"][step][key] for r in per_rank]) for i in range(rounds)]

    plain, ours, floor = over("plain", "wall", max), over("reshard", "wall", max), over("floor", "wall", max)
    shard = max(r["shard"] for r in per_rank)
    peak = [max(r["rounds"][i]["results"]["reshard"]["peak"] / r["shard"] for r in per_rank)
            for i in range(rounds)]
    peak_bytes = [max(r["rounds"][i]["results"]["reshard"]["peak"] for r in per_rank) for i in range(rounds)]
    table = sum(r["shard"] for r in per_rank)
    plain_peak = [max(r["rounds"][i]["results"]["plain"]["peak"] / r["shard"] for r in per_rank)
                  for i in range(rounds)]
    row = (f"| {name} | {direction} | {_cell(plain, '.2f')} | {_cell(ours, '.2f')} | "
           f"{_cell([o / p for o, p in zip(ours, plain)], '.2f')} | {_cell(floor, '.2f')} | "
           f"{_cell(over('plain', 'cpu', sum), '.2f')} → {_cell(over('reshard', 'cpu', sum), '.2f')} | "
           f"{_cell(over('plain', 'faults', sum), ',.0f')} → {_cell(over('reshard', 'faults', sum), ',.0f')} | "
           f"{_cell(plain_peak, '.2f')} | {_cell(peak, '.2f')} | {_cell([p / MIB for p in peak_bytes], '.1f')} | "
           f"{shard / MIB:.0f} | {table / MIB:.0f} |")
    resident = [v for r in per_rank[0]["rounds"] for v in r["resident"].values() if v is not None]
    cache = (f"{min(resident):.0%}-{max(resident):.0%} of the checkpoint in the page cache before the "
             f"timed loads" if resident else "page cache residency unknown (no fincore)")
    first = per_rank[0]
    notes = [f"{direction}: {rounds} rounds; {cache}; kept {first['kept']:,}, evicted {first['evicted']}; "
             f"sampled ids checked {sum(r['checked'] for r in per_rank):,}, rows or optimizer rows "
             f"differing: {sum(r['wrong'] for r in per_rank)}; reshard +peak / whole table "
             f"{_cell([p / table for p in peak_bytes], '.2f')}"]
    notes += [f"{direction} rank {rank} CPU profile of the first reshard:\n{r['profile']}"
              for rank, r in enumerate(per_rank) if r["profile"]]
    return row, notes, statistics.median(peak_bytes)


def peak_scaling(peaks: dict[tuple[int, int], float]) -> list[str]:
    """The same table (saved at N) loaded at two world sizes: how the reshard's extra peak
    per rank follows the local shard (ideal: the ratio of the world sizes)."""
    out = []
    for (saved, small), low in sorted(peaks.items()):
        for (saved2, large), high in sorted(peaks.items()):
            if saved2 == saved and large > small and low > 0:
                out.append(f"+peak scaling, saved at {saved}: at {large} ranks {high / MIB:.1f} MiB / at {small} "
                           f"ranks {low / MIB:.1f} MiB = {high / low:.2f} (the shard: {small / large:.2f})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torchrec", action="store_true",
                    help="the real TorchRec model (needs scripts/install_torchrec_cpu.sh)")
    ap.add_argument("--slots", type=int, help="slots (embedding rows): default 12 M, --torchrec 3 M")
    ap.add_argument("--ids", type=int, help="admitted ids: default 10 M, --torchrec 80%% of the slots")
    ap.add_argument("--dim", type=int, help="embedding dim: default 8, --torchrec 16")
    ap.add_argument("--hash-size", type=int, default=1 << 40, help="input id space")
    ap.add_argument("--directions", default="4:3,3:4", help="saved:loaded world sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per direction")
    ap.add_argument("--profile", action="store_true", help="print each rank's CPU profile of the first reshard")
    ap.add_argument("--fresh-memory", action="store_true",
                    help="glibc's mmap threshold fixed at 128 KiB in the ranks: +peak counts every live byte")
    args = ap.parse_args()
    if args.fresh_memory:  # read by glibc when each rank's process starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    slots = args.slots or (3_000_000 if args.torchrec else 12_000_000)
    ids = args.ids or (int(0.8 * slots) if args.torchrec else 10_000_000)
    cfg = Config(args.torchrec, slots, ids, args.dim or (16 if args.torchrec else 8), args.hash_size)
    name = f"TorchRec, {slots / 1e6:g} M slots" if cfg.torchrec else f"generic, {ids / 1e6:g} M ids"
    rows, notes, peaks = [], [], {}
    for direction in args.directions.split(","):
        saved, loaded = (int(w) for w in direction.split(":"))
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            ckpt = os.path.join(tmp, f"at{saved}")
            samples = [r.value for r in run_ranks(save_job, saved, ckpt, cfg, timeout_s=1800)]
            per_rank = [r.value for r in run_ranks(load_job, loaded, ckpt, cfg, samples, args.repeats,
                                                   args.profile, timeout_s=1800)]
        row, more, peaks[(saved, loaded)] = summarize(name, f"{saved} → {loaded}", per_rank)
        rows.append(row)
        notes += more
    what = (f"TorchRec MC-EC: {slots:,} slots, dim {cfg.dim}, {ids:,} ids, exact Adagrad; DMP row-wise "
            "fused" if cfg.torchrec else f"generic table: {ids:,} ids, {slots:,} slots, dim {cfg.dim} "
            "(+1 optimizer row per slot)")
    logger.info("\n".join([
        f"{what}; torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
        f"{', '.join(f'{v:.1f}' for v in os.getloadavg())} at the end"
        f"{'; --fresh-memory' if args.fresh_memory else ''}",
        "cells: median (min-max) over the rounds; times: the slowest rank; +peak: the largest rank",
        "| table | direction | plain DCP load s | reshard s | time × DCP | all_to_all floor s | "
        "CPU s (all ranks) DCP → reshard | page faults (all ranks) DCP → reshard | DCP +peak / shard | "
        "reshard +peak / shard | reshard +peak MiB | shard MiB | table MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|", *rows, *peak_scaling(peaks), *notes]))


if __name__ == "__main__":
    main()
