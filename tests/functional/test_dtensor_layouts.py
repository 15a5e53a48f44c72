"""Save with one layout, load into another, on real gloo ranks: 2x2 (dp, ep) -> 4 (ep) -> 2
(ep), an EP/DP axis-order change, FSDP2-style parameters merged into the checkpoint layout,
uneven and empty expert shards, and an HF adapter that transposes and splits expert
weights. Every rank compares every loaded local shard with the full reference tensor (built
here by plain chunking, independent of the package): max delta 0.0.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from megatron_ckpt_fixes import dtensor as mdt
from megatron_ckpt_fixes._dev.testing import run_ranks

pytestmark = pytest.mark.varies_with("torch", "python")

FULL_SHAPES = {
    "layers.0.mlp.experts.w1": (6, 5, 4),   # 6 experts: 3/3 over ep=2, 2/2/2/0 over ep=4
    "layers.0.mlp.experts.w2": (8, 3, 2),   # FSDP2 shards dim 0 again: _StridedShard merge
    "layers.0.attn.qkv.weight": (7, 4),     # uneven rows, two mesh axes on one dim
    "hc_head.weight": (3, 4),               # replicated: must win over the "*head*" rule
    "lm_head.weight": (5, 4),
}


def _full(key: str) -> torch.Tensor:
    shape = FULL_SHAPES[key]
    base = 1000.0 * list(FULL_SHAPES).index(key)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + base


def _chunk(t: torch.Tensor, n: int, i: int, dim: int) -> torch.Tensor:
    """DTensor's chunk rule: ceil(size / n) per shard, trailing shards short or empty."""
    step = -(-t.shape[dim] // n)
    start = min(step * i, t.shape[dim])
    return t.narrow(dim, start, min(step, t.shape[dim] - start))


def _fsdp(local: torch.Tensor, mesh: DeviceMesh, dim: int, ep_local: torch.Tensor):
    """An FSDP2-style parameter: a DTensor over the dp sub-mesh whose global tensor is the
    rank's EP/TP slice."""
    return mdt.from_local_exact(local.clone(), mesh["dp"], [Shard(dim)], tuple(ep_local.shape))


def _state_2d(mesh: DeviceMesh) -> dict:
    """Layout A/A': mesh with axes dp and ep (either order); FSDP2 over dp on top of EP."""
    dp, ep = mesh.get_local_rank("dp"), mesh.get_local_rank("ep")
    w1 = _chunk(_full("layers.0.mlp.experts.w1"), 2, ep, 0)
    w2 = _chunk(_full("layers.0.mlp.experts.w2"), 2, ep, 0)
    hc = _full("hc_head.weight")
    return {
        "layers.0.mlp.experts.w1": _fsdp(_chunk(w1, 2, dp, 1), mesh, 1, w1),
        "layers.0.mlp.experts.w2": _fsdp(_chunk(w2, 2, dp, 0), mesh, 0, w2),
        "layers.0.attn.qkv.weight": _qkv_2d(mesh).clone(),
        "hc_head.weight": _fsdp(_chunk(hc, 2, dp, 0), mesh, 0, hc),
        "lm_head.weight": _chunk(_full("lm_head.weight"), 2, ep, 0).clone(),
        "step": 7,
    }


def _qkv_2d(mesh: DeviceMesh) -> torch.Tensor:
    """qkv rows sharded over both axes, in mesh order."""
    full = _full("layers.0.attn.qkv.weight")
    names = mesh.mesh_dim_names
    for name in names:
        full = _chunk(full, 2, mesh.get_local_rank(name), 0)
    return full


def _state_1d(mesh: DeviceMesh) -> dict:
    """Layout B/C: one ep axis, plain local tensors (experts dim 0, attention/head dim 1)."""
    n, r = mesh.size(), mesh.get_local_rank("ep")
    return {
        "layers.0.mlp.experts.w1": _chunk(_full("layers.0.mlp.experts.w1"), n, r, 0).clone(),
        "layers.0.mlp.experts.w2": _chunk(_full("layers.0.mlp.experts.w2"), n, r, 0).clone(),
        "layers.0.attn.qkv.weight": _chunk(_full("layers.0.attn.qkv.weight"), n, r, 1).clone(),
        "hc_head.weight": _full("hc_head.weight").clone(),
        "lm_head.weight": _chunk(_full("lm_head.weight"), n, r, 1).clone(),
        "step": 7,
    }


TABLE_2D = mdt.PlacementTable((
    mdt.replicated("hc_head.*"),
    mdt.sharded("*head*", ep=0),
    mdt.sharded("*.experts.*", ep=0),
    mdt.sharded("*.attn.*", dp=0, ep=0),
))
TABLE_1D = mdt.PlacementTable((
    mdt.replicated("hc_head.*"),
    mdt.sharded("*head*", ep=1),
    mdt.sharded("*.experts.*", ep=0),
    mdt.sharded("*.attn.*", ep=1),
))


def _zeroed(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            local.zero_()
        out[key] = value if isinstance(value, torch.Tensor) else 0
    return out


def _deltas(loaded: dict, expected: dict) -> dict:
    """Max |loaded - expected| of every key's local shard (0.0 for an empty shard)."""
    out = {}
    for key, exp in expected.items():
        got = loaded[key]
        if not isinstance(exp, torch.Tensor):
            out[key] = 0.0 if got == exp else float("inf")
            continue
        got_l = got.to_local() if hasattr(got, "to_local") else got
        exp_l = exp.to_local() if hasattr(exp, "to_local") else exp
        assert got_l.shape == exp_l.shape, (key, got_l.shape, exp_l.shape)
        out[key] = float((got_l - exp_l).abs().max()) if exp_l.numel() else 0.0
    return out


def _load_into(build, mesh: DeviceMesh, table: mdt.PlacementTable, src_path: str) -> dict:
    """Load ``src_path`` into a zeroed ``build(mesh)`` state; compare with the reference."""
    state = _zeroed(build(mesh))
    mdt.load(state, src_path, table.layouts(state, mesh))
    return _deltas(state, build(mesh))


def _four_rank_run(rank: int, world: int, path: str) -> dict:
    mesh_a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    state = _state_2d(mesh_a)
    layouts = TABLE_2D.layouts(state, mesh_a)
    wrapped = mdt.wrap_state_dict(state, layouts)
    out = {"placements_a": {k: (v.device_mesh.mesh_dim_names, v.placements)
                            for k, v in wrapped.items() if isinstance(v, DTensor)}}
    mdt.save(state, f"{path}/a", layouts)
    # The checkpoint holds the true full tensors (read back unsharded).
    whole = {k: torch.zeros(s) for k, s in FULL_SHAPES.items()}
    dcp.load(whole, checkpoint_id=f"{path}/a")
    out["full"] = {k: float((whole[k] - _full(k)).abs().max()) for k in FULL_SHAPES}
    # 2x2 -> 4: experts 2/2/2/0 (rank 3 holds an empty shard), qkv and lm_head by columns.
    mesh_b = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    out["a_to_b"] = _load_into(_state_1d, mesh_b, TABLE_1D, f"{path}/a")
    out["empty_w1"] = _state_1d(mesh_b)["layers.0.mlp.experts.w1"].numel() == 0
    # 2x2 (dp, ep) -> 2x2 (ep, dp): every rank's EP coordinate and merge order change.
    mesh_a2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp"))
    out["a_to_a2"] = _load_into(_state_2d, mesh_a2, TABLE_2D, f"{path}/a")
    # A DTensor already on the checkpoint mesh: kept if its placements agree, else refused.
    lm = wrapped["lm_head.weight"]
    same = mdt.wrap_state_dict({"lm": lm}, {"lm": mdt.CheckpointLayout(mesh_a, lm.placements)})
    out["same_mesh"] = (tuple(same["lm"].shape), same["lm"].to_local().data_ptr() == lm.to_local().data_ptr())
    try:
        mdt.wrap_state_dict({"lm": lm}, {"lm": mdt.CheckpointLayout(mesh_a, (Shard(0),) * 2)})
        out["same_mesh_other_placements"] = None
    except mdt.LayoutAgreementError as exc:
        out["same_mesh_other_placements"] = str(exc)
    # 4 -> save again (rank 3 saves its empty expert shard) for the 2-rank run.
    state_b = _state_1d(mesh_b)
    mdt.save(state_b, f"{path}/b", TABLE_1D.layouts(state_b, mesh_b))
    return out


class MoEAdapter(mdt.StateDictAdapter):
    """Native [E, 2F, H] fused gate/up and [E, H, F] down <-> HF per-projection [E, H, F] /
    [E, F, H] (the Step3p5-style transpose of dims 1 and 2)."""

    key_maps = (
        mdt.KeyMap("layers.{i}.mlp.experts.w13", ("model.layers.{i}.mlp.experts.gate_proj",
                                                  "model.layers.{i}.mlp.experts.up_proj"),
                   perm=(0, 2, 1), split_dim=2),
        mdt.KeyMap("layers.{i}.mlp.experts.w2", "model.layers.{i}.mlp.experts.down_proj",
                   perm=(0, 2, 1)),
    )


ADAPTER_FULL = {
    "layers.0.mlp.experts.w13": torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5),
    "layers.0.mlp.experts.w2": -torch.arange(4 * 5 * 3, dtype=torch.float32).reshape(4, 5, 3),
}


def _adapter_fsdp(mesh: DeviceMesh) -> dict:
    """Save layout: FSDP2 parameters, experts dim for w13, H (dim 1) for w2."""
    r = mesh.get_local_rank()
    return {k: mdt.from_local_exact(_chunk(full, 2, r, dim).clone(), mesh, [Shard(dim)],
                                    tuple(full.shape))
            for (k, full), dim in zip(ADAPTER_FULL.items(), (0, 1))}


def _adapter_ep(mesh: DeviceMesh) -> dict:
    """Load layout: plain EP-local expert slices."""
    r = mesh.get_local_rank()
    return {k: _chunk(full, 2, r, 0).clone() for k, full in ADAPTER_FULL.items()}


def _adapter_round_trip(mesh_dp: DeviceMesh, mesh_ep: DeviceMesh, path: str) -> dict:
    mdt.save(_adapter_fsdp(mesh_dp), f"{path}/hf", adapter=MoEAdapter())
    hf = {"model.layers.0.mlp.experts.gate_proj": torch.zeros(4, 5, 3),
          "model.layers.0.mlp.experts.up_proj": torch.zeros(4, 5, 3),
          "model.layers.0.mlp.experts.down_proj": torch.zeros(4, 3, 5)}
    dcp.load(hf, checkpoint_id=f"{path}/hf")
    w13 = ADAPTER_FULL["layers.0.mlp.experts.w13"].transpose(1, 2)
    hf_ref = {"model.layers.0.mlp.experts.gate_proj": w13[..., :3],
              "model.layers.0.mlp.experts.up_proj": w13[..., 3:],
              "model.layers.0.mlp.experts.down_proj":
                  ADAPTER_FULL["layers.0.mlp.experts.w2"].transpose(1, 2)}
    out = {"hf_on_disk": {k: float((hf[k] - v).abs().max()) for k, v in hf_ref.items()}}
    table = mdt.PlacementTable((mdt.sharded("*.experts.*", ep=0),))
    state = _zeroed(_adapter_ep(mesh_ep))
    mdt.load(state, f"{path}/hf", table.layouts(state, mesh_ep), adapter=MoEAdapter())
    out["fsdp_to_ep"] = _deltas(state, _adapter_ep(mesh_ep))
    state = _zeroed(_adapter_fsdp(mesh_dp))
    mdt.load(state, f"{path}/hf", adapter=MoEAdapter())
    out["fsdp_to_fsdp"] = _deltas(state, _adapter_fsdp(mesh_dp))
    return out


def _two_rank_run(rank: int, world: int, path: str) -> dict:
    mesh_c = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    mesh_dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    return {"b_to_c": _load_into(_state_1d, mesh_c, TABLE_1D, f"{path}/b"),
            "a_to_c": _load_into(_state_1d, mesh_c, TABLE_1D, f"{path}/a"),
            **_adapter_round_trip(mesh_dp, mesh_c, path)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    path = str(tmp_path_factory.mktemp("layouts"))
    four = [r.value for r in run_ranks(_four_rank_run, 4, path)]
    two = [r.value for r in run_ranks(_two_rank_run, 2, path)]
    return four, two


def _all_exact(results: list[dict], name: str) -> None:
    for rank, res in enumerate(results):
        assert res[name] == {k: 0.0 for k in res[name]}, (rank, name, res[name])
        assert set(res[name]) == set(FULL_SHAPES) | {"step"}


def test_checkpoint_layout_from_rules_and_fsdp_merge(runs):
    four, _ = runs
    placements = four[0]["placements_a"]
    # hc_head matches its replicated rule before "*head*": the FSDP2 parameter is kept.
    assert placements["hc_head.weight"] == (("dp",), (Shard(0),))
    assert placements["lm_head.weight"] == (("dp", "ep"), (Replicate(), Shard(0)))
    assert placements["layers.0.attn.qkv.weight"] == (("dp", "ep"), (Shard(0), Shard(0)))
    # FSDP2's dp shard merged into the checkpoint's dp axis (strided when EP shards dim 0).
    assert placements["layers.0.mlp.experts.w1"] == (("dp", "ep"), (Shard(1), Shard(0)))
    assert placements["layers.0.mlp.experts.w2"] == (
        ("dp", "ep"), (_StridedShard(0, split_factor=2), Shard(0)))
    assert [r["full"] for r in four] == [{k: 0.0 for k in FULL_SHAPES}] * 4
    assert [r["same_mesh"] for r in four] == [((5, 4), True)] * 4
    assert all("'lm'" in r["same_mesh_other_placements"] and "already a DTensor" in
               r["same_mesh_other_placements"] for r in four)


def test_2x2_to_4_with_empty_expert_shard(runs):
    four, _ = runs
    _all_exact(four, "a_to_b")
    assert [r["empty_w1"] for r in four] == [False, False, False, True]


def test_ep_axis_order_change(runs):
    _all_exact(runs[0], "a_to_a2")


def test_4_to_2_and_2x2_to_2(runs):
    _, two = runs
    _all_exact(two, "b_to_c")
    _all_exact(two, "a_to_c")


def test_adapter_transposes_and_splits_with_placements(runs):
    _, two = runs
    for res in two:
        assert res["hf_on_disk"] == {k: 0.0 for k in res["hf_on_disk"]}
        assert res["fsdp_to_ep"] == {k: 0.0 for k in ADAPTER_FULL}
        assert res["fsdp_to_fsdp"] == {k: 0.0 for k in ADAPTER_FULL}
