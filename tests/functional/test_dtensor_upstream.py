"""Each upstream DTensor-checkpoint failure, reproduced with the naive wrapping, next to the
same round trip through megatron_ckpt_fixes.dtensor (exact on every rank).

1. MLite PR 61: experts wrapped with the FSDP2 parameter mesh instead of the checkpoint
   mesh -> ranks load another rank's expert shard (right shape, wrong values); the same
   with the right mesh but the wrong axis passes ``run_check`` and saves wrong values.
2. NeMo Automodel PR 1691: transpose(1, 2) of expert weights keeping ``Shard(1)`` -> wrong
   global shape, DCP load fails with a size mismatch; upstream's Shard-only swap still
   misses ``_StridedShard``.
3. ``DTensor.from_local`` without ``shape=`` on uneven shards -> wrong global shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from megatron_ckpt_fixes import dtensor as mdt
from megatron_ckpt_fixes._dev.testing import run_ranks

pytestmark = pytest.mark.varies_with("torch", "python")

KEY = "layers.3.mlp.experts.fc1.weight0"


def _chunk(t: torch.Tensor, n: int, i: int, dim: int) -> torch.Tensor:
    """DTensor's chunk rule: ceil(size / n) per shard, trailing shards short or empty."""
    step = -(-t.shape[dim] // n)
    start = min(step * i, t.shape[dim])
    return t.narrow(dim, start, min(step, t.shape[dim] - start))


def _full(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1


def _delta(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


# ---------------------------------------------------------------- 1. wrong expert shard
def _experts_run(rank: int, world: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    dp, ep = mesh.get_coordinate()
    full = _full(4, 4, 3)  # 4 experts over ep=2; FSDP2 shards dim 1 of each EP slice over dp

    def param() -> DTensor:
        local = _chunk(_chunk(full, 2, ep, 0), 2, dp, 1).clone()
        return mdt.from_local_exact(local, mesh["dp"], [Shard(1)], (2, 4, 3))

    peer_expected = _chunk(_chunk(full, 2, 1 - ep, 0), 2, dp, 1)
    expected = param().to_local()
    out = {}

    # Naive (upstream): wrap with the parameter's own mesh/placements; run_check passes.
    src = param()
    dcp.save({KEY: DTensor.from_local(src.to_local(), src.device_mesh, src.placements,
                                      run_check=True)},
             checkpoint_id=f"{path}/naive")
    dst = param()
    dst.to_local().zero_()
    dcp.load({KEY: DTensor.from_local(dst.to_local(), dst.device_mesh, dst.placements)},
             checkpoint_id=f"{path}/naive")
    out["naive_delta"] = _delta(dst.to_local(), expected)
    out["naive_got_peer_shard"] = torch.equal(dst.to_local(), peer_expected)

    # Helper: the checkpoint layout (experts over ep), FSDP2's dp shard merged in.
    layouts = {KEY: mdt.CheckpointLayout(mesh, (Replicate(), Shard(0)))}
    mdt.save({KEY: param()}, f"{path}/fixed", layouts)
    dst = param()
    dst.to_local().zero_()
    state = {KEY: dst}
    mdt.load(state, f"{path}/fixed", layouts)
    out["fixed_delta"] = _delta(dst.to_local(), expected)
    # The fixed checkpoint holds the full expert tensor: load it unsharded, compare all.
    whole = {KEY: torch.zeros_like(full)}
    dcp.load(whole, checkpoint_id=f"{path}/fixed")
    out["fixed_full_delta"] = _delta(whole[KEY], full)

    # The same trap with the right mesh but the wrong axis: the EP slice placed over dp.
    # Right global shape, run_check passes, and the saved tensor is wrong.
    ep_slice = _chunk(full, 2, ep, 0).clone()
    dcp.save({KEY: DTensor.from_local(ep_slice, mesh, (Shard(0), Replicate()), run_check=True)},
             checkpoint_id=f"{path}/wrong_axis")
    whole = {KEY: torch.zeros_like(full)}
    dcp.load(whole, checkpoint_id=f"{path}/wrong_axis")
    out["wrong_axis_full_delta"] = _delta(whole[KEY], full)
    return out


def test_experts_wrapped_with_param_mesh_load_another_ranks_shard(four):
    results = [r["experts"] for r in four]
    # Naive: the ep=0 and ep=1 ranks of one dp row claim the same chunk; one side's experts
    # are dropped at save and that side loads its peer's expert shard (right shape).
    wrong = [r for r in results if r["naive_delta"] > 0]
    assert len(wrong) == 2 and all(r["naive_got_peer_shard"] for r in wrong)
    assert all(r["wrong_axis_full_delta"] > 0 for r in results)
    # Helper: exact on every rank, and the checkpoint is the true full tensor.
    assert [r["fixed_delta"] for r in results] == [0.0] * 4
    assert [r["fixed_full_delta"] for r in results] == [0.0] * 4


# ---------------------------------------------------------------- 2. transpose
def _transpose_run(rank: int, world: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    native_full = _full(4, 8, 6)  # native [E, H, I]; the HF checkpoint stores [E, I, H]
    hf_full = native_full.transpose(1, 2).contiguous()
    hf = mdt.from_local_exact(_chunk(hf_full, 2, rank, 1).clone(), mesh, [Shard(1)], (4, 6, 8))
    dcp.save({KEY: hf}, checkpoint_id=path)

    def native() -> DTensor:  # FSDP2: Shard(1) of the native layout, zeroed for loading
        return mdt.from_local_exact(torch.zeros(4, 4, 6), mesh, [Shard(1)], (4, 8, 6))

    expected = _chunk(native_full, 2, rank, 1)
    out = {}
    # Naive (upstream): transpose the local tensor, keep Shard(1), no shape.
    p = native()
    naive = DTensor.from_local(p.to_local().transpose(1, 2), mesh, p.placements)
    out["naive_shape"] = tuple(naive.shape)
    try:
        dcp.load({KEY: naive}, checkpoint_id=path)
        out["naive_error"] = None
    except BaseException as exc:  # CheckpointException derives from BaseException
        out["naive_error"] = f"{type(exc).__name__}: {exc}"
    # Helper: placements follow the transpose.
    p = native()
    fixed = mdt.transpose(p, 1, 2, key=KEY)
    out["fixed_shape"], out["fixed_placements"] = tuple(fixed.shape), fixed.placements
    dcp.load({KEY: fixed}, checkpoint_id=path)
    out["fixed_delta"] = _delta(p.to_local(), expected)
    return out


def test_transpose_keeping_shard1_fails_with_size_mismatch(two):
    results = [r["transpose"] for r in two]
    for r in results:
        assert r["naive_shape"] == (4, 12, 4)  # [E, 2*I, H/2] instead of [E, I, H]
        assert r["naive_error"] is not None and "size" in r["naive_error"].lower()
        assert r["fixed_shape"] == (4, 6, 8) and r["fixed_placements"] == (Shard(2),)
        assert r["fixed_delta"] == 0.0


def _strided_transpose_run(rank: int, world: int, path: str) -> dict:
    """FSDP2 (dp) on top of TP (tp) on dim 1 -> (_StridedShard(1, 2), Shard(1)); after
    transpose(1, 2) upstream's patch swaps only the Shard."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tpr = mesh.get_coordinate()
    native_full = _full(2, 8, 4)
    hf_full = native_full.transpose(1, 2).contiguous()
    placements = (_StridedShard(1, split_factor=2), Shard(1))
    expected = _chunk(_chunk(native_full, 2, tpr, 1), 2, dp, 1)
    mdt.save({KEY: hf_full}, f"{path}/hf")  # a plain tensor: saved replicated

    def native() -> DTensor:
        return mdt.from_local_exact(torch.zeros_like(expected), mesh, placements, (2, 8, 4))

    out = {}
    p = native()
    swapped = tuple(Shard(2) if type(q) is Shard and q.dim == 1 else q for q in p.placements)
    naive = DTensor.from_local(p.to_local().transpose(1, 2), mesh, swapped)
    try:
        dcp.load({KEY: naive}, checkpoint_id=f"{path}/hf")
        out["naive_delta"] = _delta(p.to_local(), expected)
    except BaseException as exc:
        out["naive_delta"] = f"{type(exc).__name__}: {exc}"
    p = native()
    fixed = mdt.transpose(p, 1, 2, key=KEY)
    out["fixed_placements"] = fixed.placements
    dcp.load({KEY: fixed}, checkpoint_id=f"{path}/hf")
    out["fixed_delta"] = _delta(p.to_local(), expected)
    return out


def test_upstream_shard_only_swap_misses_strided_shard(four):
    results = [r["strided"] for r in four]
    for r in results:  # Shard(2) on the strided-sharded dim: global [2, 8, 4], saved [2, 4, 8]
        assert "Size mismatch" in r["naive_delta"] and "[2, 8, 4]" in r["naive_delta"]
    for r in results:
        assert r["fixed_placements"] == (_StridedShard(2, split_factor=2), Shard(2))
        assert r["fixed_delta"] == 0.0


# ---------------------------------------------------------------- 3. uneven shards
def _uneven_run(rank: int, world: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    full = _full(5, 3)
    local = _chunk(full, 2, rank, 0).clone()  # 3 rows and 2 rows
    out = {}
    # Naive: from_local without shape= assumes equal local shapes.
    naive = DTensor.from_local(local, mesh, [Shard(0)])
    out["naive_shape"] = tuple(naive.shape)
    try:
        dcp.save({"w": naive}, checkpoint_id=f"{path}/naive")
        out["naive_error"] = None
    except BaseException as exc:
        out["naive_error"] = f"{type(exc).__name__}: {exc}"
    # Helper: the global shape is agreed from every rank's local shape.
    layouts = {"w": mdt.CheckpointLayout(mesh, (Shard(0),))}
    mdt.save({"w": local}, f"{path}/fixed", layouts)
    whole = {"w": torch.zeros(5, 3)}
    dcp.load(whole, checkpoint_id=f"{path}/fixed")
    out["fixed_full_delta"] = _delta(whole["w"], full)
    dst = {"w": torch.zeros_like(local)}
    mdt.load(dst, f"{path}/fixed", layouts)
    out["fixed_delta"] = _delta(dst["w"], local)
    out["bad_input"] = [_error_of(_bad_layout, mesh, rank, local, path, case)
                        for case in ("mesh", "shape", "disagree")]
    # The process group is still healthy after every rejected layout (nobody hung).
    mdt.save({"w": local}, f"{path}/after", layouts)
    return out


def _bad_layout(mesh, rank: int, local: torch.Tensor, path: str, case: str) -> None:
    if case == "mesh":  # only rank 1 passes placements that do not fit the 1-D mesh
        placements = (Shard(0), Shard(0)) if rank == 1 else (Shard(0),)
        layout = mdt.CheckpointLayout(mesh, placements)
    elif case == "shape":  # a global shape that the local shards do not match
        layout = mdt.CheckpointLayout(mesh, (Shard(0),), global_shape=(6, 3))
    else:  # the ranks disagree on the placements
        layout = mdt.CheckpointLayout(mesh, (Shard(rank),))
    mdt.save({"w": local}, f"{path}/bad-{case}", {"w": layout})


def _error_of(fn, *args) -> tuple[str, str] | None:
    try:
        fn(*args)
    except mdt.PlacementError as exc:
        return type(exc).__name__, str(exc)
    return None


def test_uneven_shards_without_shape_break_save(two):
    results = [r["uneven"] for r in two]
    # Naive: each rank infers its own global shape, DCP rejects the overlapping chunks.
    assert [r["naive_shape"] for r in results] == [(6, 3), (4, 3)]
    for r in results:
        assert "overlapping chunks" in r["naive_error"]
        assert r["fixed_full_delta"] == 0.0 and r["fixed_delta"] == 0.0


def test_bad_layouts_raise_the_same_named_error_on_every_rank(two):
    results = [r["uneven"] for r in two]
    mesh_err, shape_err, disagree_err = results[0]["bad_input"]
    assert results[1]["bad_input"] == results[0]["bad_input"]  # same error on every rank
    assert all(e[0] == "LayoutAgreementError" for e in results[0]["bad_input"])
    assert "'w' on rank 1" in mesh_err[1] and "2 placements" in mesh_err[1]
    assert "'w' on rank 1" in shape_err[1] and "global shape [6, 3]" in shape_err[1]
    assert "'w' on rank 1" in disagree_err[1] and "differs from rank 0" in disagree_err[1]


# ---------------------------------------------------------------- one spawn per world size
def _four_rank_run(rank: int, world: int, path: str) -> dict:
    return {"experts": _experts_run(rank, world, f"{path}/experts"),
            "strided": _strided_transpose_run(rank, world, f"{path}/strided")}


def _two_rank_run(rank: int, world: int, path: str) -> dict:
    return {"transpose": _transpose_run(rank, world, f"{path}/transpose"),
            "uneven": _uneven_run(rank, world, f"{path}/uneven")}


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    """One 4-rank (dp=2 x ep/tp=2) run for the expert and _StridedShard cases."""
    return [r.value for r in run_ranks(_four_rank_run, 4, str(tmp_path_factory.mktemp("4")))]


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    """One 2-rank run for the transpose, uneven-shard and bad-input cases."""
    return [r.value for r in run_ranks(_two_rank_run, 2, str(tmp_path_factory.mktemp("2")))]
