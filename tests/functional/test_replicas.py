"""Replicas that are not replicas (issue 31, item 2): a difference fails the save before any write.

megatron-core writes one replica of each chunk (replica_id 0) and gives it to every rank at
load. Ranks that declare a chunk as replicas but hold different values save "successfully"
upstream, and then ranks 1-3 load rank 0's values. Four gloo ranks, one spawn, every scenario:

- a ShardedObject and a ShardedTensor declared with replica_id=rank and a per-rank value;
- a tensor whose two "TP" halves are declared as one chunk, the TP rank folded into the
  replica id (saved asynchronously: the check runs on the trainer before the request exists);
- a common state that differs after the caller's preprocessing (rank 2's learning rate);
- a difference on rank 3 only (a check of rank 0 against rank 1 passes it);
- under a cached save plan (``--ckpt-assume-constant-structure``), an object that differs in
  the second save of an unchanged structure (objects are checked every save);
- (fixed only) an object that rank 2 cannot digest: the same error on every rank;

upstream: each saves and loads rank 0's values on every rank (asserted, so a fix upstream
shows); fixed: each fails on every rank with the same error, one line per chunk naming the
ranks that differ, nothing of the new checkpoint written, the previous checkpoint unchanged.
What must still save and load exactly, upstream and fixed: equal replicas (a tensor, an object
and a common state declared by every rank, as data-parallel replicas of weights are: a check
that refuses every replicated chunk fails it) and a common state that differs only in what the
caller's preprocessing drops (Megatron-LM's per-rank ``rank``: a check of the common state
before the preprocessing fails it).
"""

from __future__ import annotations

import hashlib
import inspect
import os
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import run_ranks, shared_temp_dir

pytestmark = pytest.mark.varies_with("megatron-core")

WORLD = 4


def _drop_rank(common: dict) -> dict:
    """The caller's preprocessing (Megatron-LM's drops ``args.rank``); leaves ``common`` be."""
    return {**common, "args": {k: v for k, v in common["args"].items() if k != "rank"}}


class _Undigestable:
    """A value that cannot be pickled (so cannot be digested), held by one rank."""

    def __reduce__(self):
        raise TypeError("cannot pickle _Undigestable")


def _state(rank: int, ws: int, case: str) -> tuple[dict, Callable | None]:
    """The state dict one rank saves in ``case``, and the caller's preprocessing."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    own = torch.arange(3, dtype=torch.float32) + 10 * rank  # this rank's own slice
    sd: dict[str, Any] = {"w": ShardedTensor.from_rank_offsets("w", own, (0, rank, ws))}
    lr = 0.5
    if case == "object":
        sd["rng"] = ShardedObject("rng", {"seed": 1000 + rank}, (1,), (0,), replica_id=rank)
    elif case == "tensor":
        sd["r"] = ShardedTensor.from_rank_offsets("r", torch.full((2,), 1.0 + rank),
                                                  replica_id=rank)
    elif case == "tp_folded":  # halves [0, 1] and [2, 3] of one tensor, declared as [0:2]
        tp, dp = rank % 2, rank // 2
        half = torch.tensor([0.0, 1.0, 2.0, 3.0])[2 * tp:2 * tp + 2].clone()
        sd["h"] = ShardedTensor.from_rank_offsets("h", half, replica_id=(tp, dp))
    elif case == "rank3":
        value = 7.0 + (rank == 3)
        sd["r"] = ShardedTensor.from_rank_offsets("r", torch.full((2,), value), replica_id=rank)
    elif case == "common":
        lr = 0.5 + (rank == 2)
    elif case == "undigestable":  # fixed side only: the check itself fails, on one rank
        value = _Undigestable() if rank == 2 else 1
        sd["u"] = ShardedObject("u", value, (1,), (0,), replica_id=rank)
    elif case in ("equal", "preprocessed", "object3"):  # object3: equal's structure
        sd["r"] = ShardedTensor.from_rank_offsets("r", torch.full((2,), 4.25), replica_id=rank)
        step = 12 + (case == "object3" and rank == 3)  # rank 3's step, in the same structure
        sd["o"] = ShardedObject("o", {"step": step}, (1,), (0,), replica_id=rank)
    if case == "equal":  # equal in every respect, no preprocessing
        sd["args"] = {"lr": lr}
        return sd, None
    sd["args"] = {"rank": rank, "lr": lr}  # differs before the preprocessing
    return sd, _drop_rank


#: Failing cases: the values rank ``r`` holds and rank 0's (which upstream loads everywhere),
#: and the line the fixed save's error must have.
FAILING: dict[str, tuple[Callable[[int], Any], Any, str]] = {
    "object": (lambda r: {"seed": 1000 + r}, {"seed": 1000},
               "ShardedObject 'rng' at offset (0,): ranks 1, 2, 3 hold values other than "
               "rank 0's (the main replica, the one written; declared by ranks 0, 1, 2, 3)"),
    "tensor": (lambda r: [1.0 + r] * 2, [1.0] * 2,
               "ShardedTensor 'r' at offset (0,): ranks 1, 2, 3 hold values other than rank 0's"),
    "tp_folded": (lambda r: [2.0 * (r % 2), 2.0 * (r % 2) + 1], [0.0, 1.0],
                  "ShardedTensor 'h' at offset (0,): ranks 1, 3 hold values other than rank 0's"),
    "rank3": (lambda r: [7.0 + (r == 3)] * 2, [7.0] * 2,
              "ShardedTensor 'r' at offset (0,): rank 3 holds values other than rank 0's"),
    "common": (lambda r: 0.5 + (r == 2), 0.5,
               "the common state (after the caller's preprocessing): rank 2 holds values "
               "other than rank 0's (the main replica, the one written; declared by "
               "ranks 0, 1, 2, 3)"),
}
PASSING = ("equal", "preprocessed")


def _loaded(rank: int, ws: int, case: str, path: str) -> dict:
    """Load ``path`` into a template of ``case``: the values each key came back with."""
    from megatron.core import dist_checkpointing as dc

    template, _ = _state(rank, ws, case)
    for key in ("w", "r", "h"):
        if key in template:
            template[key].data = torch.zeros_like(template[key].data)
    loaded = dc.load(template, path)
    return {key: (value.tolist() if isinstance(value, torch.Tensor) else value)
            for key, value in loaded.items()}


def _files(path: str) -> dict[str, str]:
    return {name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(path))}


def _save(rank: int, ws: int, case: str, path: str, strategy: Any = None) -> str | None:
    """Save ``case`` to a fresh ``path``; the error's class and message, or None."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.core import CheckpointingException

    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    sd, preprocess = _state(rank, ws, case)
    try:
        if case == "tp_folded":
            mcore = ({"async_strategy": "mcore"}  # 0.19+: not nvidia-resiliency-ext's
                     if "async_strategy" in inspect.signature(dc.save).parameters else {})
            request = dc.save(sd, path, strategy, async_sharded_save=True,
                              preprocess_common_before_consistancy_check=preprocess, **mcore)
            request.execute_sync()
        else:
            dc.save(sd, path, strategy, preprocess_common_before_consistancy_check=preprocess)
    except CheckpointingException as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        dist.barrier()
    return None


def _cached_strategy() -> Any:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)


def _side(rank: int, ws: int, root: str, features: list[str] | None) -> dict:
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install(features)
    out: dict[str, Any] = {}
    fixed = features is None
    previous = os.path.join(root, "previous")
    if fixed:  # the checkpoint a refused save must leave as it was
        out["previous_error"] = _save(rank, ws, "equal", previous)
        before = _files(previous)
    for case in (*FAILING, *PASSING):
        path = os.path.join(root, case)
        error = _save(rank, ws, case, path)
        out[case] = {"error": error, "files": sorted(os.listdir(path))}
        if error is None:
            out[case]["loaded"] = _loaded(rank, ws, case, path)
    strategy = _cached_strategy()
    out["cached_first"] = _save(rank, ws, "equal", os.path.join(root, "cached1"), strategy)
    out["cached_second"] = _save(rank, ws, "object3", os.path.join(root, "cached2"), strategy)
    if fixed:
        out["undigestable"] = _save(rank, ws, "undigestable", os.path.join(root, "undigestable"))
        out["previous_unchanged"] = _files(previous) == before
    return out


def _worker(rank: int, ws: int) -> dict:
    with shared_temp_dir() as root:
        return {"upstream": _side(rank, ws, os.path.join(root, "upstream"), ["compat.cpu"]),
                "fixed": _side(rank, ws, os.path.join(root, "fixed"), None)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return [r.value for r in run_ranks(_worker, WORLD, timeout_s=180, collective_timeout_s=60)]


def test_upstream_still_saves_unequal_replicas_and_loads_rank_0s_values(ranks):
    for rank, out in enumerate(r["upstream"] for r in ranks):
        for case, (held, rank0s, _) in FAILING.items():
            assert out[case]["error"] is None, (case, out[case]["error"])
            loaded = out[case]["loaded"]
            if case == "common":
                assert loaded["args"]["lr"] == rank0s, "upstream no longer loads rank 0's"
            else:
                key = {"object": "rng", "tensor": "r", "tp_folded": "h", "rank3": "r"}[case]
                assert loaded[key] == rank0s, (case, rank, loaded[key])
                if held(rank) != rank0s:  # this rank lost its own values, without a word
                    assert loaded[key] != held(rank)
        assert out["cached_second"] is None


def test_unequal_replicas_fail_the_save_on_every_rank_before_any_write(ranks):
    fixed = [r["fixed"] for r in ranks]
    for case, (_, _, line) in FAILING.items():
        errors = {out[case]["error"] for out in fixed}
        assert len(errors) == 1, (case, errors)  # the same error on every rank
        error = errors.pop()
        assert error is not None and error.startswith("ReplicaMismatchError: save to "), error
        assert "refused before anything was written: 1 chunk(s)" in error, error
        assert line in error, (case, error)
        for out in fixed:
            assert out[case]["files"] == [], (case, out[case]["files"])


def test_a_difference_on_rank_3_alone_is_found_and_only_rank_3_is_named(ranks):
    """A check of rank 0 against rank 1 passes this save; one of rank 0 against all names 3."""
    lines = ranks[0]["fixed"]["rank3"]["error"].splitlines()[1:]
    assert len(lines) == 1 and lines[0].strip().startswith(
        "ShardedTensor 'r' at offset (0,): rank 3 holds values"), lines


def test_objects_are_checked_on_every_save_of_a_cached_plan(ranks):
    for out in (r["fixed"] for r in ranks):
        assert out["cached_first"] is None, out["cached_first"]
        assert out["cached_second"] is not None
        assert ("ShardedObject 'o' at offset (0,): rank 3 holds values other than rank 0's"
                in out["cached_second"]), out["cached_second"]


def test_equal_replicas_and_preprocessed_differences_save_and_load_exactly(ranks):
    assert all(r["fixed"]["previous_error"] is None for r in ranks)
    for side in ("upstream", "fixed"):
        for rank, out in enumerate(r[side] for r in ranks):
            for case in PASSING:
                assert out[case]["error"] is None, (side, case, out[case]["error"])
                loaded = out[case]["loaded"]
                assert loaded["w"] == [10.0 * rank + i for i in range(3)]
                assert loaded["r"] == [4.25, 4.25] and loaded["o"] == {"step": 12}
                assert loaded["args"] == ({"lr": 0.5} if case == "equal"
                                          else {"rank": 0, "lr": 0.5})  # rank 0's args


def test_a_rank_that_cannot_digest_fails_the_save_on_every_rank(ranks):
    errors = {r["fixed"]["undigestable"] for r in ranks}
    assert len(errors) == 1, errors  # the same error on every rank, none left waiting
    error = errors.pop()
    assert error is not None and error.startswith("ReplicaMismatchError: "), error
    assert ("rank 2: cannot digest the chunks it shares: TypeError: cannot pickle "
            "_Undigestable" in error), error


def test_a_refused_save_leaves_the_previous_checkpoint_as_it_was(ranks):
    for out in (r["fixed"] for r in ranks):
        assert out["previous_unchanged"]
