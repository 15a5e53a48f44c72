"""Structure changes after a warm plan cache, run on real gloo ranks.

Every scenario saves the *base* structure ``WARM_SAVES`` times with one strategy object (so
megatron-core's cache is fully warm: from the third save on no planning collective runs),
then saves a *changed* structure, once or twice, and loads the last checkpoint back with a
template of the changed structure. The outcome records where it went wrong, if anywhere:
the save, the load, the loaded values, or the checkpoint's own metadata.

One spec drives the saved values, the load template and the expected metadata, so the
comparison is exact (every element, dtype and shape).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import shared_temp_dir

WARM_SAVES = 3


@dataclass(frozen=True)
class TSpec:
    """One ShardedTensor held by this rank."""

    key: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    replica_id: int = 0

    def values(self, save_idx: int) -> torch.Tensor:
        """Distinct per key, position and save, so stale or misplaced data shows."""
        numel = 1
        for d in self.local_shape:
            numel *= d
        base = sum(map(ord, self.key)) * 1000 + save_idx * 100_000
        flat_offset = self.offset[0] * (self.global_shape[1] if len(self.global_shape) > 1 else 1)
        t = torch.arange(numel, dtype=torch.float64) + base + flat_offset
        return t.reshape(self.local_shape).to(self.dtype)

    def sharded(self, data: torch.Tensor):
        from megatron.core.dist_checkpointing import ShardedTensor

        return ShardedTensor(
            self.key, data, self.dtype, self.local_shape, self.global_shape, self.offset,
            axis_fragmentations=tuple(g // l for g, l in zip(self.global_shape, self.local_shape)),
            replica_id=self.replica_id,
        )


@dataclass(frozen=True)
class OSpec:
    """One ShardedObject held by this rank."""

    key: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]

    def payload(self, save_idx: int) -> dict:
        return {"key": self.key, "offset": self.offset, "save": save_idx}


@dataclass(frozen=True)
class Layout:
    tensors: tuple[TSpec, ...]
    objects: tuple[OSpec, ...] = ()

    def state_dict(self, save_idx: int | None) -> dict:
        """Save dict (``save_idx`` given) or load template (None)."""
        from megatron.core.dist_checkpointing import ShardedObject

        sd: dict = {}
        for t in self.tensors:
            data = t.values(save_idx) if save_idx is not None else torch.full(
                t.local_shape, -1, dtype=t.dtype)
            sd[t.key] = t.sharded(data)
        for o in self.objects:
            sd[o.key] = ShardedObject(o.key, o.payload(save_idx) if save_idx is not None else None,
                                      o.shape, o.offset)
        return sd

    def without(self, key: str) -> "Layout":
        return Layout(tuple(t for t in self.tensors if t.key != key),
                      tuple(o for o in self.objects if o.key != key))

    def with_tensor(self, key: str, **changes) -> "Layout":
        return Layout(tuple(replace(t, **changes) if t.key == key else t for t in self.tensors),
                      self.objects)


def base_layout(rank: int, ws: int) -> Layout:
    tensors = [
        TSpec("w", (4 * ws, 4), (4, 4), (4 * rank, 0)),
        TSpec("b", (3,), (3,), (0,), replica_id=rank),  # replicated, main copy on rank 0
    ]
    if rank == ws - 1:
        tensors.append(TSpec("solo", (2, 2), (2, 2), (0, 0)))  # held by the last rank only
    return Layout(tuple(tensors), (OSpec("obj", (ws,), (rank,)),))


def _last(rank: int, ws: int) -> bool:
    return rank == ws - 1


#: name -> (rank, ws, base layout) -> changed layout
CHANGES: dict[str, Callable[[int, int, Layout], Layout]] = {
    "unchanged": lambda r, ws, l: l,  # control: the cached fast path itself is exact
    "add_object_all": lambda r, ws, l: Layout(
        l.tensors, l.objects + (OSpec("rerun_state_machine_state", (ws,), (r,)),)),
    "add_object_one_rank": lambda r, ws, l: Layout(
        l.tensors, l.objects + ((OSpec("late_obj", (1,), (0,)),) if _last(r, ws) else ())),
    "add_tensor_all": lambda r, ws, l: Layout(
        l.tensors + (TSpec("new", (2 * ws, 3), (2, 3), (2 * r, 0)),), l.objects),
    "add_tensor_one_rank": lambda r, ws, l: Layout(
        l.tensors + ((TSpec("new_solo", (5,), (5,), (0,)),) if _last(r, ws) else ()), l.objects),
    "shape_all": lambda r, ws, l: l.with_tensor("w", global_shape=(4 * ws, 6), local_shape=(4, 6)),
    "shape_one_rank": lambda r, ws, l: (
        l.with_tensor("solo", global_shape=(3, 2), local_shape=(3, 2)) if _last(r, ws) else l),
    "swap_slices": lambda r, ws, l: l.with_tensor("w", offset=(4 * (ws - 1 - r), 0)),
    "remove_all": lambda r, ws, l: l.without("b"),
    "remove_one_rank": lambda r, ws, l: l.without("solo") if _last(r, ws) else l,
    "dtype_all": lambda r, ws, l: l.with_tensor("w", dtype=torch.float64),
    "dtype_one_rank": lambda r, ws, l: (
        l.with_tensor("solo", dtype=torch.bfloat16) if _last(r, ws) else l),
}


@dataclass
class Outcome:
    """What happened to the changed structure; all fields empty/True means exact."""

    save_error: str | None = None
    load_error: str | None = None
    wrong_values: list[str] = field(default_factory=list)
    wrong_metadata: list[str] = field(default_factory=list)
    #: Per save, whether megatron-core's cached plan was validated for reuse after it (the
    #: next save then takes the fast path, with no planning collective).
    plan_reuse: list[bool] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not (self.save_error or self.load_error or self.wrong_values or self.wrong_metadata)


def _err(exc: BaseException) -> str:
    """The error as a line per cause (DCP's CheckpointException: one per failing rank)."""
    from torch.distributed.checkpoint import CheckpointException

    if isinstance(exc, CheckpointException) and exc.failures:
        return "; ".join(f"{type(exc).__name__} rank {rank}: {type(e).__name__}: {e}"
                         for rank, (e, _tb) in sorted(exc.failures.items()))[:2000]
    return f"{type(exc).__name__}: {exc}"[:2000]


def _compare(layout: Layout, loaded: dict, save_idx: int) -> list[str]:
    wrong = []
    for t in layout.tensors:
        got, want = loaded[t.key], t.values(save_idx)
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            delta = ((got.double() - want.double()).abs().max().item()
                     if got.shape == want.shape else "shape")
            wrong.append(f"{t.key}: dtype {got.dtype}/{want.dtype} max delta {delta}")
    for o in layout.objects:
        if loaded[o.key] != o.payload(save_idx):
            wrong.append(f"{o.key}: {loaded[o.key]!r}")
    return wrong


def _check_metadata(ckpt: str, layouts: list[Layout]) -> list[str]:
    """The checkpoint's own .metadata must record every tensor's global shape and dtype."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    wrong = []
    for layout in layouts:
        for t in layout.tensors:
            entry = md.get(t.key)
            if entry is None:
                wrong.append(f"{t.key}: missing from .metadata")
            elif tuple(entry.size) != t.global_shape or entry.properties.dtype != t.dtype:
                wrong.append(f"{t.key}: .metadata says {tuple(entry.size)} {entry.properties.dtype}, "
                             f"saved {t.global_shape} {t.dtype}")
    return wrong


#: Fully-parallel wrappers with megatron-core >= 0.20's distribution cache
#: (``--ckpt-pg-tensors-cache-path``): kind -> (do_cache_distribution, pg_cache_create).
#: ``pg_only`` is the cache path without ``--ckpt-assume-constant-structure``; ``pg_read``
#: reads the file that an earlier job created for the base structure.
PG_CACHE_KINDS: dict[str, tuple[bool, bool]] = {
    "pg_create": (True, True),
    "pg_only": (False, True),
    "pg_read": (True, False),
}


def _earlier_job_created(path: str, first: dict) -> None:
    """What a job run with ``pg_cache_create`` left: the group's file (for ``first``'s
    structure), and nothing in this process's memo."""
    from megatron.core.dist_checkpointing import exchange_utils

    exchange_utils.determine_main_replica_uniform_distribution(
        first, dist.group.WORLD, pg_cache_path=path, pg_cache_create=True)
    exchange_utils._PG_DIST_CACHE.clear()
    dist.barrier()  # the group's writer rank has written the file


def make_strategy(kind: str, root: str = "", first: dict | None = None):
    """A fresh save strategy of ``kind``; ``root`` and ``first`` (the first state dict it
    saves) only for the PG_CACHE_KINDS."""
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    base = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=kind != "pg_only")
    if kind == "fully_parallel":
        return FullyParallelSaveStrategyWrapper(base, None, do_cache_distribution=True)
    if kind in PG_CACHE_KINDS:
        cache_distribution, create = PG_CACHE_KINDS[kind]
        path = os.path.join(root, "pg_cache")
        if not create:
            _earlier_job_created(path, first)
        return FullyParallelSaveStrategyWrapper(base, None, cache_distribution,
                                                pg_cache_path=path, pg_cache_create=create)
    return base


def plan_reused(strategy) -> bool:
    """Whether the (base) strategy will reuse its cached plans at its next save."""
    return bool(getattr(strategy, "base_strategy", strategy).validated_cache_reuse)


def _new_dir(root: str, name: str) -> str:
    path = os.path.join(root, name)
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    return path


def run_scenario(rank: int, ws: int, root: str, change: str, strategy: str = "plain",
                 changed_saves: int = 3, resume: bool = False) -> Outcome:
    """Warm the cache on the base layout, change it, save ``changed_saves`` times, load."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    base = base_layout(rank, ws)
    changed = CHANGES[change](rank, ws, base)
    strat = make_strategy(strategy, root, base.state_dict(0))
    out = Outcome()
    idx = 0
    for _ in range(WARM_SAVES):
        dc.save(base.state_dict(idx), _new_dir(root, f"s{idx}"), sharded_strategy=strat)
        out.plan_reuse.append(plan_reused(strat))
        idx += 1
    if resume:
        # Megatron-LM's resume: load, then hand the load strategy's metadata to a new
        # save strategy, which may reuse it; save the unchanged structure once more.
        load_strat = TorchDistLoadShardedStrategy()
        dc.load(base.state_dict(None), os.path.join(root, f"s{idx - 1}"), load_strat)
        strat = make_strategy(strategy, root, base.state_dict(idx))
        strat.cached_global_metadata = load_strat.cached_global_metadata
        dc.save(base.state_dict(idx), _new_dir(root, f"s{idx}"), sharded_strategy=strat)
        out.plan_reuse.append(plan_reused(strat))
        idx += 1
    try:
        for _ in range(changed_saves):
            dc.save(changed.state_dict(idx), _new_dir(root, f"s{idx}"), sharded_strategy=strat)
            out.plan_reuse.append(plan_reused(strat))
            idx += 1
    except BaseException as exc:  # CheckpointException derives from BaseException
        out.save_error = _err(exc)
        return out
    ckpt = os.path.join(root, f"s{idx - 1}")
    gathered: list = [None] * ws
    dist.all_gather_object(gathered, changed)
    out.wrong_metadata = _check_metadata(ckpt, gathered) if rank == 0 else []
    try:
        loaded = dc.load(changed.state_dict(None), ckpt)
    except BaseException as exc:
        out.load_error = _err(exc)
        return out
    out.wrong_values = _compare(changed, loaded, idx - 1)
    return out


def scenario_worker(rank: int, ws: int, features: list[str] | None, change: str,
                    strategy: str = "plain", resume: bool = False) -> Outcome:
    """Entry point for :func:`megatron_ckpt_fixes._dev.testing.run_ranks`."""
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install(features)
    with shared_temp_dir() as root:
        outcome = run_scenario(rank, ws, os.path.join(root, change), change, strategy,
                               resume=resume)
    return outcome


def scenarios_worker(rank: int, ws: int, features: list[str] | None,
                     runs: list[tuple[str, str, bool]]) -> dict:
    """Many scenarios in one process group, for those that leave ranks in step."""
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install(features)
    results = {}
    with shared_temp_dir() as root:
        for change, strategy, resume in runs:
            name = f"{change}-{strategy}-{'resume' if resume else 'fresh'}"
            results[name] = run_scenario(rank, ws, os.path.join(root, name), change,
                                         strategy, resume=resume)
    return results


class InjectedSaveFailure(RuntimeError):
    """Stands for a failure that only one rank sees, after the save's last collective."""


def failed_save_worker(rank: int, ws: int, features: list[str] | None) -> dict:
    """Warm the cache, let the 4th save fail on the last rank only (after it completed,
    so the other ranks succeed), then save twice more and load the last checkpoint."""
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    calls = {"n": 0}
    real_save = TorchDistSaveShardedStrategy.save

    def save_then_fail_once(self, *args, **kwargs):
        result = real_save(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == WARM_SAVES + 1 and _last(rank, ws):
            raise InjectedSaveFailure(f"rank {rank}: storage went away after the write")
        return result

    TorchDistSaveShardedStrategy.save = save_then_fail_once  # underneath install()'s patch
    megatron_ckpt_fixes.install(features)
    layout = base_layout(rank, ws)
    strat = make_strategy("plain")
    out = Outcome()
    with shared_temp_dir() as root:
        for idx in range(WARM_SAVES + 3):
            try:
                dc.save(layout.state_dict(idx), _new_dir(root, f"s{idx}"),
                        sharded_strategy=strat)
            except InjectedSaveFailure as exc:
                out.save_error = _err(exc)
                dist.barrier()  # the one dist_checkpointing.save runs after the strategy's
            out.plan_reuse.append(plan_reused(strat))
        ckpt = os.path.join(root, f"s{idx}")
        out.wrong_values = _compare(layout, dc.load(layout.state_dict(None), ckpt), idx)
    return {"outcome": out, "failed": out.save_error is not None}
