"""What checking the bytes a load reads costs: megatron-core loads with and without it.

Two gloo ranks (``--ranks``) save the GPT-like sharded state dict of
``bench_realistic_save.py`` once, with ``install()`` (every item gets a checksum), to
``--dir``; then each round loads it twice into the same template, once with ``install()``
(``checksums.reader``: every item read once into memory, hashed with the record's algorithm,
deserialized from that buffer) and once with every feature but checksums (upstream's reader:
torch.load straight from the file), in an order that alternates from round to round, each
load after a ``gc.collect()`` and a barrier; a load's time is the slowest rank's. Each pair
runs from the page cache and from disk (the files' pages evicted with ``posix_fadvise``
before each load). Every loaded value is compared with the saved one once.

Printed: median and fastest load time per setup, the paired per-round ratio checked /
unchecked (median, min-max), and the largest item: the extra memory the check holds (one
buffer per load, as large as the largest item it reads).

    python benchmarks/bench_verified_load.py [--layers 8] [--hidden 1024] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import statistics
import tempfile

import torch
import torch.distributed as dist
from bench_cached_save import Spread, timed
from bench_realistic_save import GIB, _evict, state_dict

from megatron_ckpt_fixes import FEATURES
from megatron_ckpt_fixes._dev.testing import run_ranks

LOADS = {"checked (all fixes)": None,
         "unchecked (fixes w/o checksums)": [f for f in FEATURES if f != "checksums"]}


def _bench(rank: int, ws: int, layers: int, hidden: int, rounds: int, root: str) -> dict:
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.mapping import is_main_replica
    from tqdm import tqdm

    from megatron_ckpt_fixes.fixes.checksums import read_record

    sd = state_dict(rank, ws, layers, hidden)
    path = os.path.join(root, "ckpt")
    if rank == 0:
        os.makedirs(path)
    dist.barrier()
    megatron_ckpt_fixes.install()
    dc.save(sd, path)
    template = {key: dataclasses.replace(sh, data=torch.empty_like(sh.data))
                for key, sh in sd.items()}

    def load(name: str, cold: bool) -> float:
        megatron_ckpt_fixes.uninstall()
        megatron_ckpt_fixes.install(LOADS[name])
        if cold and rank == 0:
            _evict(path)
        gc.collect()
        return timed(lambda: dc.load(template, path))

    loaded = dc.load(template, path)  # exact where this rank's value is the one saved
    assert all(torch.equal(loaded[k], sh.data) for k, sh in sd.items()
               if is_main_replica(sh.replica_id)), "a value did not load exactly"
    times = {(name, cold): [] for name in LOADS for cold in (True, False)}
    order = list(LOADS)
    for _ in tqdm(range(rounds), desc="rounds", disable=rank != 0):
        for cold in (True, False):
            for name in order:
                times[(name, cold)].append(load(name, cold))
        order.reverse()
    megatron_ckpt_fixes.uninstall()
    record = read_record(path)
    checked, unchecked = LOADS
    return {"rounds": rounds, "bytes": sum(sh.data.numel() * sh.data.element_size()
                                           for sh in sd.values()),
            "tensors": len(sd), "algorithm": record.algorithm,
            "largest item": max(length for length, _ in record.checksums.values()),
            "median": {k: statistics.median(v) for k, v in times.items()},
            "fastest": {k: min(v) for k, v in times.items()},
            "ratio": {cold: Spread.of([a / b for a, b in zip(times[(checked, cold)],
                                                             times[(unchecked, cold)])])
                      for cold in (True, False)}}


def _print(r: dict, args: argparse.Namespace) -> None:
    from importlib.metadata import version

    print(f"\n{args.ranks} gloo ranks, {args.layers} layers, hidden {args.hidden}: "
          f"{r['tensors']} tensors and {r['bytes'] / GIB:.3f} GiB per rank, {r['rounds']} "
          f"rounds, megatron-core {version('megatron-core')}, in {args.dir}; the record's "
          f"algorithm: {r['algorithm']}")
    for cold in (True, False):
        where = "from disk" if cold else "page cache"
        print(f"  {where}: load time (slowest rank), median; fastest round")
        for name in LOADS:
            print(f"    {name:32s} {r['median'][(name, cold)]:.3f} s;  "
                  f"{r['fastest'][(name, cold)]:.3f} s")
        spread = r["ratio"][cold]
        print(f"    checked / unchecked, paired per round: median {spread.median:.3f}, "
              f"min-max {spread.low:.3f}-{spread.high:.3f}")
    print(f"  extra memory while a load runs: one buffer as large as the largest item, "
          f"{r['largest item'] / (1 << 20):.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", default=os.environ.get("MCF_BENCH_DIR", "/var/tmp"),
                        help="a directory on the disk to measure (not a tmpfs)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="mcf-bench-", dir=args.dir)
    try:
        result = run_ranks(_bench, args.ranks, args.layers, args.hidden, args.rounds, root,
                           timeout_s=7200, collective_timeout_s=1800)[0].value
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _print(result, args)


if __name__ == "__main__":
    main()
