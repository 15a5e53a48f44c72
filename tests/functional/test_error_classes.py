"""With install(), every load error keeps the class plain upstream raises.

A handler written for upstream (``except CheckpointingException``, ``except
CheckpointException``, ``except Exception``) must catch exactly what it caught before; the
package only adds (the same error on every rank, the failing ranks, keys and causes, and
its root class). Each error kind is raised by plain upstream and by the patched load in the
same process group, and the two class hierarchies are compared. Plain upstream includes
``compat.tensor_metadata`` (:data:`UPSTREAM`): on torch 2.15 megatron-core's strict loads fail
before any check with a ``TypeError`` of their own (tests/unit/test_tensor_metadata.py); on
2.13 and 2.14 it is not applied.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import run_ranks

#: Plain upstream, made runnable on gloo and on the installed torch.
UPSTREAM = ["compat.cpu", "compat.tensor_metadata"]
CASES = ("missing_directory", "strict_unexpected_key", "strict_missing_key",
         "key_not_in_checkpoint", "global_shape_mismatch")


def _classes(exc: BaseException) -> tuple[str, ...]:
    return tuple(f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__)


def _error_classes_worker(rank: int, ws: int) -> dict:
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.validation import StrictHandling

    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    ckpt = root[0]

    def tensor(key: str, rows: int = 4):
        return ShardedTensor.from_rank_offsets(key, torch.ones(rows), (0, rank, ws))

    megatron_ckpt_fixes.install(["compat.cpu"])
    dc.save({"w": tensor("w"), "v": tensor("v")}, ckpt)
    cases = {
        "missing_directory": lambda: dc.load({"w": tensor("w")}, f"{ckpt}/no-such-dir"),
        "strict_unexpected_key": lambda: dc.load({"w": tensor("w"), "u": tensor("u")}, ckpt,
                                                 strict=StrictHandling.RAISE_UNEXPECTED),
        "strict_missing_key": lambda: dc.load({"w": tensor("w")}, ckpt,
                                              strict=StrictHandling.RAISE_ALL),
        "key_not_in_checkpoint": lambda: dc.load({"w": tensor("w"), "u": tensor("u")}, ckpt),
        "global_shape_mismatch": lambda: dc.load({"w": tensor("w", rows=6)}, ckpt),
    }
    out: dict = {}
    for mode, features in (("upstream", UPSTREAM), ("patched", None)):
        megatron_ckpt_fixes.uninstall()
        megatron_ckpt_fixes.install(features)
        for name in CASES:
            try:
                cases[name]()
                out[(name, mode)] = None
            except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
                out[(name, mode)] = (_classes(exc), str(exc))
            dist.barrier()  # rank-local loads (0.19) may fail on one rank only
    return out


@pytest.fixture(scope="module")
def raised() -> list[dict]:
    return [r.value for r in run_ranks(_error_classes_worker, 2, timeout_s=180,
                                       collective_timeout_s=30)]


@pytest.mark.parametrize("case", CASES)
def test_patched_error_keeps_every_upstream_class(raised, case):
    upstream = [per_rank[(case, "upstream")] for per_rank in raised]
    patched = [per_rank[(case, "patched")] for per_rank in raised]
    assert any(upstream), f"plain upstream no longer fails {case}: the twin is out of date"
    assert all(patched) and len({p[0] for p in patched}) == 1, patched  # same error everywhere
    assert patched[0][1] == patched[1][1], patched
    classes = set(patched[0][0])
    assert "megatron_ckpt_fixes.core.errors.MegatronCkptFixesError" in classes
    for rank, seen in enumerate(upstream):
        if seen is None:  # this rank loaded without error upstream (rank-local planning)
            continue
        assert set(seen[0]) <= classes, (rank, seen[0], patched[0][0])
    builtins_exception = "builtins.Exception"
    assert (builtins_exception in classes) == any(
        builtins_exception in seen[0] for seen in upstream if seen), (upstream, patched)
