"""Cost of the structure check on cached-plan saves, measured side by side in one run.

Two gloo ranks save a state dict of N small ShardedTensors per rank repeatedly with three
setups, interleaved round by round so they share the machine's conditions:

- upstream uncached: ``TorchDistSaveShardedStrategy(cached_metadata=False)``, plain megatron-core
- upstream cached:   ``cached_metadata=True``, plain megatron-core (``install(["compat.cpu"])`` only)
- patched cached:    ``cached_metadata=True`` after ``install()``

Each setup keeps its strategy object across rounds (a warm cache, as in training) and is
warmed with three saves first. The order of the setups alternates from round to round and
every timed save starts after a ``gc.collect()``, so neither position nor a collection left
over from the previous setup favours one of them. Reported: median save time (max over
ranks), the median over rounds of the paired ratio patched/upstream cached (robust to the
machine's drift within a run), and the time of the structure check alone (signature +
agreement) as a share of a cached save.
Targets: patched/upstream cached <= 1.03; check < 2 % of a cached save.

    python benchmarks/bench_cached_save.py [--sizes 5000 50000] [--rounds 15 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from megatron_ckpt_fixes.testing import run_ranks

SETUPS = {
    "upstream uncached": (["compat.cpu"], False),
    "upstream cached": (["compat.cpu"], True),
    "patched cached": (None, True),
}
WARMUP = 3


def _state_dict(n: int, rank: int, ws: int) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {f"layer{i}.weight": ShardedTensor.from_rank_offsets(
        f"layer{i}.weight", torch.full((16,), float(i)), (0, rank, ws)) for i in range(n)}


def _timed(fn) -> float:
    gc.collect()
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _bench(rank: int, ws: int, sizes: list[int], rounds: list[int], root: str) -> dict:
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from tqdm import tqdm

    from megatron_ckpt_fixes.structure import StructureGuard

    results: dict = {}
    counter = iter(range(10**9))

    def save(sd, strategy):
        path = os.path.join(root, f"c{next(counter)}")
        if rank == 0:
            os.makedirs(path)
        dist.barrier()
        dc.save(sd, path, sharded_strategy=strategy)
        return path

    def dropped(path):
        """Each checkpoint is deleted once timed (a 50k-tensor one is ~100 MB in /dev/shm)."""
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)

    for n, n_rounds in zip(sizes, rounds):
        sd = _state_dict(n, rank, ws)
        strategies = {name: TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=cached)
                      for name, (_, cached) in SETUPS.items()}
        times: dict[str, list[float]] = {name: [] for name in SETUPS}

        def use(name):
            megatron_ckpt_fixes.uninstall()
            megatron_ckpt_fixes.install(SETUPS[name][0])

        for name in SETUPS:
            use(name)
            for _ in range(WARMUP):
                dropped(save(sd, strategies[name]))
        order = list(SETUPS)
        for _ in tqdm(range(n_rounds), desc=f"{n} tensors/rank", disable=rank != 0):
            for name in order:
                use(name)
                paths: list[str] = []
                times[name].append(_timed(lambda: paths.append(save(sd, strategies[name]))))
                dropped(paths[0])
            order.reverse()
        megatron_ckpt_fixes.install()
        guard = StructureGuard()
        guard.should_replan(sd, "bench")
        check = [_timed(lambda: guard.should_replan(sd, "bench")) for _ in range(n_rounds)]
        results[n] = {name: statistics.median(t) for name, t in times.items()}
        results[n]["structure check"] = statistics.median(check)
        ratios = sorted(p / u for p, u in zip(times["patched cached"], times["upstream cached"]))
        results[n]["paired ratio"] = statistics.median(ratios)
        results[n]["ratio range"] = (ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4])
        results[n]["rounds"] = n_rounds
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[5000, 50000])
    parser.add_argument("--rounds", type=int, nargs="+", default=[15, 5],
                        help="timed rounds per size (the last value repeats)")
    args = parser.parse_args()
    rounds = (args.rounds + args.rounds[-1:] * len(args.sizes))[:len(args.sizes)]
    root = os.environ.get("MCF_BENCH_DIR") or tempfile.mkdtemp(
        dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        res = run_ranks(_bench, 2, args.sizes, rounds, root, timeout_s=7200,
                        collective_timeout_s=1800)[0].value
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\nmedian save time, 2 gloo ranks (max over ranks); ratio = median of per-round "
          "patched/upstream cached")
    print(f"{'tensors/rank':>12} {'rounds':>6} {'upstream uncached':>18} {'upstream cached':>16} "
          f"{'patched cached':>15} {'ratio':>7} {'ratio IQR':>13} {'check':>8} {'check share':>12}")
    for n, r in res.items():
        share = r["structure check"] / r["patched cached"]
        print(f"{n:>12} {r['rounds']:>6} {r['upstream uncached']:>17.3f}s "
              f"{r['upstream cached']:>15.3f}s {r['patched cached']:>14.3f}s "
              f"{r['paired ratio']:>7.3f} {r['ratio range'][0]:>6.3f}-{r['ratio range'][1]:<6.3f} "
              f"{r['structure check']:>7.3f}s {share:>11.2%}")


if __name__ == "__main__":
    main()
