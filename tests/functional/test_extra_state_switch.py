"""``--ckpt-drop-redundant-extra-state`` with ``--ckpt-assume-constant-structure`` (Megatron-LM
main, megatron-core 0.20).

Megatron-LM main decides per save, from each ``_extra_state``'s bytes, whether the object is
written: Megatron-LM's own ``_localize_redundant_extra_states`` (used unchanged here) turns an
empty or recipe-only payload into a ``LocalNonpersistentObject`` and keeps a delayed-scaling
FP8 payload (``scale_fwd``, ``amax_history_fwd``) as a ``ShardedObject``. A transformer-engine
module's payload is empty until its first FP8 step and carries the scaling state after it,
so the set of saved objects changes inside a run. Under the cached plan upstream then saves
"successfully" without the newly kept object (the load fails: it is missing), or fails at
save when an object is dropped. With ``install()`` both switches save and load exactly.

Each run: Megatron-LM's save flow (the default torch_dist strategy with
``use_cached_ckpt_structure``, sharding validated on the first save only), three saves
before the switch, three after, then a load of the last checkpoint with a template of the
state after the switch. Skipped where Megatron-LM's training package has no
``_localize_redundant_extra_states`` (before main).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import typing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import run_ranks, shared_temp_dir

WS = 2
SAVES_EACH = 3
KEY = "decoder.layers.0.mlp.linear_fc1._extra_state"


def _localize():
    """Megatron-LM's own ``_localize_redundant_extra_states`` (None where it has none)."""
    if not hasattr(typing, "override"):  # megatron.training on main is Python 3.12 code
        from typing_extensions import override

        typing.override = override
    if importlib.util.find_spec("megatron.training") is None:
        return None
    from megatron.training import checkpointing

    return getattr(checkpointing, "_localize_redundant_extra_states", None)


def extra_state(kept: bool, save_idx: int | None) -> torch.Tensor:
    """A transformer-engine ``get_extra_state()`` payload: empty before the module's first
    FP8 step; the serialized delayed-scaling state (distinct per save) after it (plain
    lists here: a ``torch.save`` of tensors embeds a random id, so equal states would not
    be equal bytes)."""
    if not kept:
        return torch.empty(0, dtype=torch.uint8)
    scale = float(save_idx or 0)
    state = {"recipe": "DelayedScaling", "scale_fwd": [scale] * 3,
             "amax_history_fwd": [[scale] * 3] * 4, "scale_bwd": [1.0, 1.0]}
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def state_dict(rank: int, kept: bool, save_idx: int | None) -> dict:
    """The model part of Megatron-LM's checkpoint state dict, after Megatron-LM's own
    decision about the ``_extra_state`` (a load template when ``save_idx`` is None)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    weight = torch.zeros(4, 4) if save_idx is None else torch.full((4, 4), 10.0 * save_idx + rank)
    sd = {"model": {
        "decoder.layers.0.mlp.linear_fc1.weight":
            ShardedTensor.from_rank_offsets("decoder.layers.0.mlp.linear_fc1.weight", weight,
                                            (0, rank, WS)),
        KEY: ShardedObject(KEY, extra_state(kept, save_idx), (WS,), (rank,)),
    }}
    _localize()(sd)
    return sd


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)


def _run_switch(rank: int, root: str, strategy_dir: str, before: bool, after: bool) -> dict:
    """Save with the ``_extra_state`` kept (``before``/``after``) or dropped; load the last."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    strategy = get_default_save_sharded_strategy()
    strategy.use_cached_ckpt_structure = True  # --ckpt-assume-constant-structure
    out: dict = {"save_error": None, "load_error": None, "exact": None, "written": []}
    kept = [before] * SAVES_EACH + [after] * SAVES_EACH
    for idx, keep in enumerate(kept):
        ckpt = os.path.join(root, strategy_dir, f"iter_{idx}")
        if rank == 0:
            os.makedirs(ckpt)
        dist.barrier()
        try:
            dc.save(state_dict(rank, keep, idx), ckpt, strategy,
                    validate_access_integrity=idx == 0)
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException too
            out["save_error"] = f"{type(exc).__name__}: {exc}"
            return out
        out["written"].append(KEY in _object_keys(ckpt))
    try:
        loaded = dc.load(state_dict(rank, after, None), ckpt)
    except BaseException as exc:  # noqa: BLE001
        out["load_error"] = f"{type(exc).__name__}: {exc}"
        return out
    want = state_dict(rank, after, len(kept) - 1)["model"]
    want[KEY] = extra_state(after, len(kept) - 1)
    out["exact"] = _same(loaded["model"], {k: getattr(v, "data", v) for k, v in want.items()})
    return out


def switches_worker(rank: int, ws: int, features: list[str] | None,
                    switches: list[str]) -> dict:
    """Each switch of ``SWITCHES`` in turn, with its own strategy (one process group)."""
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install(features)
    with shared_temp_dir() as root:
        outcome = {name: _run_switch(rank, root, name, *SWITCHES[name]) for name in switches}
    return outcome


def _object_keys(ckpt: str) -> set[str]:
    """The ShardedObject keys a torch_dist checkpoint holds (``key/shard_...`` entries)."""
    from torch.distributed.checkpoint import FileSystemReader

    return {k.split("/shard_")[0] for k in FileSystemReader(ckpt).read_metadata().state_dict_metadata}


def _upstream_has_the_flag() -> bool:
    """Read from the installed source, not imported: megatron.training is heavy and global."""
    spec = importlib.util.find_spec("megatron.training")
    sources = [Path(d) / "checkpointing.py" for d in (spec.submodule_search_locations or [])] \
        if spec else []
    return any(p.is_file() and "def _localize_redundant_extra_states(" in p.read_text()
               for p in sources)


pytestmark = pytest.mark.skipif(not _upstream_has_the_flag(), reason="Megatron-LM's training package "
                                "has no _localize_redundant_extra_states (before main)")

#: switch -> (kept before, kept after)
SWITCHES = {"dropped_then_kept": (False, True), "kept_then_dropped": (True, False)}


@pytest.fixture(scope="module")
def upstream() -> list[dict]:
    """Both switches under plain upstream; the failed save leaves the ranks in step (every
    rank fails it), so they share one process group."""
    return [r.value for r in run_ranks(switches_worker, WS, ["compat.cpu"],
                                       ["dropped_then_kept", "kept_then_dropped"],
                                       timeout_s=300)]


def test_extra_state_switches_save_and_load_exactly():
    results = run_ranks(switches_worker, WS, None, list(SWITCHES), timeout_s=300)
    for rank, result in enumerate(results):
        for name, (before, after) in SWITCHES.items():
            out = result.value[name]
            assert out["save_error"] is None and out["load_error"] is None, (rank, name, out)
            assert out["exact"], (rank, name, out)
            assert out["written"] == [before] * SAVES_EACH + [after] * SAVES_EACH, out


def test_upstream_saves_without_a_newly_kept_extra_state(upstream):
    """The hazard: every save after the switch "succeeds" and none writes the object that
    Megatron-LM now keeps; the resume cannot load it."""
    for rank, per_rank in enumerate(upstream):
        out = per_rank["dropped_then_kept"]
        assert out["save_error"] is None and out["written"] == [False] * 2 * SAVES_EACH, out
        assert f"Missing key in checkpoint state_dict: {KEY}/shard_{rank}_{WS}" in \
            (out["load_error"] or ""), f"rank {rank}: {out}"


def test_upstream_fails_to_save_once_an_extra_state_is_dropped(upstream):
    for rank, per_rank in enumerate(upstream):
        error = per_rank["kept_then_dropped"]["save_error"] or ""
        assert f"Could not find FQN: '{KEY}" in error, f"rank {rank}: {error}"
