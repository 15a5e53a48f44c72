"""DTensor parameters through megatron-core's own entry points (``dtensor.mcore``): real
``ColumnParallelLinear``/``RowParallelLinear``/``SequentialMLP`` modules whose weights torch's
``fully_shard`` turned into FSDP2 DTensors, their own ``sharded_state_dict``, and
``megatron.core.dist_checkpointing.save``/``load`` on 2, 3 and 4 gloo ranks.

Every loaded value is compared with what was saved (max delta 0.0) on every rank, by the
parameter's own mesh and placements, and every checkpoint is also read back as one full
tensor per key, so a shard saved at another rank's place cannot hide behind a round trip
that puts it back where it came from. Upstream twins assert today's failures: uneven FSDP2
shards (rank 0 asserts, the other rank loses its peer) and an expert mesh that is not the
dense data-parallel group (two experts silently swapped in the checkpoint).

One spawn per world size: each imports megatron-core, so the scenarios of one world size
share it (module-scoped fixtures).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import run_ranks

COL, ROW = "col.", "row."


# ------------------------------------------------------------------ helpers in the ranks
def _full(shape, seed: int) -> torch.Tensor:
    """Distinct, exactly representable values per key (a swap of two blocks shows)."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + \
        1000.0 * seed


def _block(param, full: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that ``param`` (a DTensor) holds on this rank, by its own mesh
    and placements (torch's rule, independent of the code under test)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _fsdp(module, mesh):
    """torch's FSDP2 on a megatron module, marked as megatron's TorchFullyShardedDataParallel
    marks its parameters (megatron-core 0.19 reads the mark)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh)
    for param in module.parameters():
        param.is_torch_fsdp2_param = True
    return module


def _linears(tp: int, out: int, row_out: int, mesh):
    """A ColumnParallelLinear(4 -> out) and a RowParallelLinear(out -> row_out), FSDP2-sharded
    over ``mesh``; full weights are known: (name -> (full tensor, TP axis or None))."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=2,
                            use_cpu_initialization=True, params_dtype=torch.float32,
                            tensor_model_parallel_size=tp)
    init = torch.nn.init.zeros_
    col = ColumnParallelLinear(4, out, config=cfg, init_method=init, bias=True,
                               gather_output=False)
    row = RowParallelLinear(out, row_out, config=cfg, init_method=init, bias=True,
                            input_is_parallel=True, skip_bias_add=False)
    full = {f"{COL}weight": (_full((out, 4), 1), 0), f"{COL}bias": (_full((out,), 2), 0),
            f"{ROW}weight": (_full((row_out, out), 3), 1),
            f"{ROW}bias": (_full((row_out,), 4), None)}
    return {COL: _fsdp(col, mesh), ROW: _fsdp(row, mesh)}, full


def _params(modules):
    return {prefix + name: p for prefix, m in modules.items() for name, p in m.named_parameters()}


def _tp_chunk(full, tp_axis):
    from megatron.core import parallel_state as ps

    if tp_axis is None:
        return full
    return full.chunk(ps.get_tensor_model_parallel_world_size(), tp_axis)[
        ps.get_tensor_model_parallel_rank()]


def _set(modules, full, zero: bool = False) -> None:
    with torch.no_grad():
        for key, param in _params(modules).items():
            value = _block(param, _tp_chunk(*full[key]))
            param.to_local().copy_(torch.zeros_like(value) if zero else value)


def _deltas(modules, full) -> dict[str, float]:
    """Max |loaded - saved| of every parameter's local shard (0.0 for an empty shard)."""
    out = {}
    for key, param in _params(modules).items():
        local, expected = param.to_local(), _block(param, _tp_chunk(*full[key]))
        assert local.shape == expected.shape, (key, local.shape, expected.shape)
        out[key] = float((local - expected).abs().max()) if local.numel() else 0.0
    return out


def _sharded_sd(modules, dp_group):
    return {k: v for prefix, m in modules.items()
            for k, v in m.sharded_state_dict(prefix=prefix,
                                             metadata={"dp_cp_group": dp_group}).items()}


def _fields(sharded_sd) -> dict[str, tuple]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {v.key: (v.global_shape, v.global_offset, v.local_shape, v.axis_fragmentations,
                    v.replica_id) for v in sharded_sd.values() if isinstance(v, ShardedTensor)}


def _full_load(path: str, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Read every key of a checkpoint as one whole tensor (a plain replicated template)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    template = {}
    for key, shape in shapes.items():
        t = torch.zeros(shape)
        template[key] = ShardedTensor(key, t, t.dtype, tuple(shape), tuple(shape),
                                      (0,) * len(shape), (1,) * len(shape),
                                      (0, 0, dist.get_rank()))
    return dist_checkpointing.load(template, path)


def _full_deltas(path: str, full: dict[str, tuple]) -> dict[str, float]:
    loaded = _full_load(path, {k: tuple(v[0].shape) for k, v in full.items()})
    return {k: float((loaded[k] - v[0]).abs().max()) for k, v in full.items()}


def _dp_mesh():
    from megatron.core import parallel_state as ps
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(ps.get_data_parallel_group(), "cpu")


def _init_parallel(tp: int = 1, ep: int = 1) -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)


# ------------------------------------------------------------------ 2 ranks
def _two_ranks(rank: int, world: int, dirs: dict[str, str]) -> dict:
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install()
    from megatron.core import dist_checkpointing, utils
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out: dict = {}
    _init_parallel()
    # The issue's example: [3, 4] over 2 ranks (2 and 1 rows), TP over a group of 1.
    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(_full((3, 4), 5), mesh, [Shard(0)])
    tp1 = [dist.new_group([r]) for r in range(world)][rank]
    sh = utils.make_tp_sharded_tensor_for_checkpoint(dt, "w", tp_axis=1, tp_group=tp1,
                                                     dp_cp_group=dist.group.WORLD)
    out["issue_fields"] = _fields({"w": sh})["w"]
    out["issue_shares_storage"] = sh.data.data_ptr() == dt.to_local().data_ptr()

    # Real layers, FSDP2 over dp=2: uneven column weight/bias (3 + 2 rows).
    modules, full = _linears(1, 5, 2, _dp_mesh())
    _set(modules, full)
    sd = _sharded_sd(modules, ps.get_data_parallel_group())
    out["linear_fields"] = _fields(sd)
    dist_checkpointing.save(sd, dirs["dp2"])
    _set(modules, full, zero=True)
    loaded = dist_checkpointing.load(_sharded_sd(modules, ps.get_data_parallel_group()),
                                     dirs["dp2"])
    out["roundtrip"] = _deltas(modules, full)
    out["loaded_in_place"] = all(loaded[k].data_ptr() == p.to_local().data_ptr()
                                 for k, p in _params(modules).items())
    out["dp2_full"] = _full_deltas(dirs["dp2"], full)

    # Cached plans (--ckpt-assume-constant-structure) on DTensor state dicts: unchanged
    # layout reuses the plan; a layout change (uneven rows -> replicated) replans.
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    value = _full((5, 3), 6)
    layouts = [[Shard(0)], [Shard(0)], [Replicate()]]
    out["cached"] = []
    for step, placements in enumerate(layouts):
        dt = distribute_tensor(value + step, mesh, placements)
        sd = make_sharded_tensors_for_checkpoint({"w": dt}, "s.", {"w": 0}, (),
                                                 tp_group=tp1, dp_cp_group=dist.group.WORLD)
        dist_checkpointing.save(sd, dirs[f"cached{step}"], sharded_strategy=strategy)
        target = distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)])
        dist_checkpointing.load(make_sharded_tensors_for_checkpoint(
            {"w": target}, "s.", {"w": 0}, (), tp_group=tp1, dp_cp_group=dist.group.WORLD),
            dirs[f"cached{step}"])
        expected = _block(target, value + step)
        out["cached"].append((float((target.to_local() - expected).abs().max()),
                              sd["s.w"].replica_id, strategy.validated_cache_reuse))
    return out


def _upstream_uneven(rank: int, world: int, path: str) -> None:
    """The issue's example on plain upstream (made runnable on gloo)."""
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install(["compat.cpu"])
    from megatron.core import dist_checkpointing, utils
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dt = distribute_tensor(_full((3, 4), 5), init_device_mesh("cpu", (world,)), [Shard(0)])
    dt.is_torch_fsdp2_param = True  # as megatron's FSDP2 wrapper marks it (read by 0.19)
    tp1 = [dist.new_group([r]) for r in range(world)][rank]
    sh = utils.make_tp_sharded_tensor_for_checkpoint(dt, "w", tp_axis=1, tp_group=tp1,
                                                     dp_cp_group=dist.group.WORLD)
    dist_checkpointing.save({"w": sh}, path)


# ------------------------------------------------------------------ 3 ranks
def _three_ranks(rank: int, world: int, dirs: dict[str, str]) -> dict:
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    out: dict = {}
    _init_parallel()
    # dp=2 checkpoint -> dp=3: column rows 2+2+1, row weight rows 1+1+0 (an empty shard).
    modules, full = _linears(1, 5, 2, _dp_mesh())
    _set(modules, full, zero=True)
    dist_checkpointing.load(_sharded_sd(modules, ps.get_data_parallel_group()), dirs["dp2"])
    out["from_dp2"] = _deltas(modules, full)
    out["local_rows"] = {k: tuple(p.to_local().shape) for k, p in _params(modules).items()}
    # Save at dp=3 (empty shards included), load back at dp=3 and as whole tensors.
    sd = _sharded_sd(modules, ps.get_data_parallel_group())
    out["fields"] = _fields(sd)
    dist_checkpointing.save(sd, dirs["dp3"])
    _set(modules, full, zero=True)
    dist_checkpointing.load(_sharded_sd(modules, ps.get_data_parallel_group()), dirs["dp3"])
    out["dp3_roundtrip"] = _deltas(modules, full)
    out["dp3_full"] = _full_deltas(dirs["dp3"], full)
    return out


# ------------------------------------------------------------------ 4 ranks
def _experts(num_experts: int, ep: int):
    """megatron-core's SequentialMLP (non-gated fc1 4 -> 5, fc2 5 -> 4, no bias) with every
    local expert FSDP2-sharded over the expert-data-parallel mesh."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from torch.distributed.device_mesh import DeviceMesh

    _init_parallel(ep=ep)
    cfg = TransformerConfig(num_layers=1, hidden_size=4, ffn_hidden_size=5,
                            moe_ffn_hidden_size=5, num_attention_heads=1,
                            num_moe_experts=num_experts, expert_model_parallel_size=ep,
                            use_cpu_initialization=True, params_dtype=torch.float32,
                            add_bias_linear=False)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    mlp = SequentialMLP(num_experts // ep, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                              linear_fc2=RowParallelLinear),
                        pg_collection=groups)
    mesh = DeviceMesh.from_group(groups.expt_dp, "cpu")
    for expert in mlp.local_experts:
        _fsdp(expert, mesh)
    first = ps.get_expert_model_parallel_rank() * (num_experts // ep)
    stacked = {"mlp.experts.linear_fc1.weight": _full((num_experts, 5, 4), 7),
               "mlp.experts.linear_fc2.weight": _full((num_experts, 4, 5), 8)}
    full = {}
    for i, expert in enumerate(mlp.local_experts):
        for name in ("linear_fc1.weight", "linear_fc2.weight"):
            full[f"{i}.{name}"] = (stacked[f"mlp.experts.{name}"][first + i], None)
    modules = {f"{i}.": e for i, e in enumerate(mlp.local_experts)}
    return mlp, modules, full, {k: (v, None) for k, v in stacked.items()}


def _stacked_experts():
    """A plain torch module holding 4 experts as one [4, 3, 2] DTensor over a 2-D
    (ep, edp) mesh in megatron's rank order (ep varies fastest): EP splits the experts,
    FSDP2 splits each EP slice further. Its sharded state dict is megatron's default for a
    non-megatron module (``sharded_state_dict_default``)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2).T.contiguous(),
                      mesh_dim_names=("ep", "edp"))
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(distribute_tensor(_full((4, 3, 2), 9), mesh,
                                                         [Shard(0), Shard(0)]))
    module.weight.is_torch_fsdp2_param = True
    return module


def _expert_swap(rank: int, dirs: dict[str, str], upstream: bool) -> dict:
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.uninstall()
    megatron_ckpt_fixes.install(["compat.cpu"] if upstream else None)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.utils import sharded_state_dict_default

    _init_parallel(ep=2)
    module = _stacked_experts()
    path = dirs["swap_upstream" if upstream else "swap_fixed"]
    meta = {"dp_cp_group": ps.get_data_parallel_group()}
    dist_checkpointing.save(sharded_state_dict_default(module, "moe.", metadata=meta), path)
    mine = module.weight.to_local().detach().clone()
    with torch.no_grad():
        module.weight.to_local().zero_()
    dist_checkpointing.load(sharded_state_dict_default(module, "moe.", metadata=meta), path)
    whole = _full_load(path, {"moe.weight": (4, 3, 2)})["moe.weight"]
    truth = _full((4, 3, 2), 9)
    return {"same_layout_roundtrip": float((module.weight.to_local().detach() - mine).abs().max()),
            "experts_equal": [bool(torch.equal(whole[e], truth[e])) for e in range(4)],
            "expert_1_holds": [bool(torch.equal(whole[1], truth[e])) for e in range(4)]}


def _upstream_replicas(mlp) -> dict:
    """The sharded state dict upstream's SequentialMLP makes of exactly laid-out DTensor
    shards: it marks the shards of expert-data-parallel rank 1 as copies of rank 0's."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    return SequentialMLP.sharded_state_dict.__wrapped__(mlp, prefix="mlp.")


def _save_error(sharded_sd: dict, path: str) -> tuple[list[str], str] | None:
    from megatron.core import dist_checkpointing

    try:
        dist_checkpointing.save(sharded_sd, path)
    except BaseException as exc:  # CheckpointingException subclasses, as the ranks raise them
        return [c.__name__ for c in type(exc).__mro__], str(exc)
    return None


def _four_ranks(rank: int, world: int, dirs: dict[str, str]) -> dict:
    import megatron_ckpt_fixes

    out: dict = {"swap_upstream": _expert_swap(rank, dirs, upstream=True),
                 "swap_fixed": _expert_swap(rank, dirs, upstream=False)}
    megatron_ckpt_fixes.install()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    # TP 2 x dp 2 -> TP 1 x dp 4 (column 6 rows: TP chunks of 3 split 2 + 1 by FSDP2, then
    # 2 + 2 + 2 + 0; the row layer's 2 rows end as 1 + 1 + 0 + 0).
    _init_parallel(tp=2)
    modules, full = _linears(2, 6, 2, _dp_mesh())
    _set(modules, full)
    sd = _sharded_sd(modules, ps.get_data_parallel_group())
    out["tp2_fields"] = _fields(sd)
    dist_checkpointing.save(sd, dirs["tp2dp2"])
    _init_parallel(tp=1)
    modules, full = _linears(1, 6, 2, _dp_mesh())
    _set(modules, full, zero=True)
    dist_checkpointing.load(_sharded_sd(modules, ps.get_data_parallel_group()), dirs["tp2dp2"])
    out["tp1dp4"] = _deltas(modules, full)
    out["tp2dp2_full"] = _full_deltas(dirs["tp2dp2"], full)

    # Experts: EP 2 x expert-dp 2 (fc1's 5 rows: 3 + 2) -> EP 1 x expert-dp 4 (2+2+1+0).
    mlp, modules, full, stacked = _experts(2, ep=2)
    _set(modules, full)
    sd = mlp.sharded_state_dict(prefix="mlp.")
    out["ep2_fields"] = _fields(sd)
    dist_checkpointing.save(sd, dirs["ep2"])
    out["ep2_full"] = _full_deltas(dirs["ep2"], stacked)
    out["ep2_upstream_replicas"] = _save_error(_upstream_replicas(mlp), dirs["ep2_copies"])
    mlp, modules, full, stacked = _experts(2, ep=1)
    _set(modules, full, zero=True)
    dist_checkpointing.load(mlp.sharded_state_dict(prefix="mlp."), dirs["ep2"])
    out["ep1"] = _deltas(modules, full)
    sd = mlp.sharded_state_dict(prefix="mlp.")
    out["ep1_fields"] = _fields(sd)
    dist_checkpointing.save(sd, dirs["ep1"])
    out["ep1_full"] = _full_deltas(dirs["ep1"], stacked)
    return out


# ------------------------------------------------------------------ fixtures (one spawn each)
CHECKPOINTS = ("dp2", "dp3", "cached0", "cached1", "cached2", "tp2dp2", "ep2", "ep1",
               "ep2_copies", "swap_upstream", "swap_fixed", "upstream_uneven")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("dtensor_mcore")
    paths = {name: str(base / name) for name in CHECKPOINTS}
    for path in paths.values():
        os.makedirs(path)
    return paths


@pytest.fixture(scope="module")
def two(dirs):
    return [r.value for r in run_ranks(_two_ranks, 2, dirs)]


@pytest.fixture(scope="module")
def three(dirs, two):
    return [r.value for r in run_ranks(_three_ranks, 3, dirs)]


@pytest.fixture(scope="module")
def four(dirs):
    return [r.value for r in run_ranks(_four_ranks, 4, dirs, timeout_s=400)]


def _all_zero(per_rank: list[dict]) -> bool:
    return all(d == 0.0 for deltas in per_rank for d in deltas.values())


# ------------------------------------------------------------------ tests
def test_upstream_uneven_fsdp2_shards_assert_on_rank0_and_kill_the_peer(dirs):
    """Today's failure (the issue's example): rank 0 computes global shape (4, 4), rank 1
    (2, 4); the save asserts on rank 0 and rank 1 loses its peer (or is killed)."""
    results = run_ranks(_upstream_uneven, 2, dirs["upstream_uneven"], check=False,
                        timeout_s=120, collective_timeout_s=20)
    assert results[0] is not None and results[0].error_type == "AssertionError"
    assert "(2, 4), (4, 4)" in results[0].error
    assert results[1] is None or not results[1].ok


def test_the_issue_example_gets_exact_fields(two):
    assert [r["issue_fields"] for r in two] == [
        ((3, 4), (0, 0), (2, 4), None, (0, 0, 0)), ((3, 4), (2, 0), (1, 4), None, (0, 0, 0))]
    assert all(r["issue_shares_storage"] for r in two)


def test_megatron_layers_with_uneven_fsdp2_shards_round_trip_exactly(two):
    """Through ColumnParallelLinear/RowParallelLinear.sharded_state_dict (the helpers reached
    through the modules that imported them by name): exact on every rank, loaded into the
    parameters' own storage, and the checkpoint holds the full tensors."""
    assert [r["linear_fields"][f"{COL}weight"] for r in two] == [
        ((5, 4), (0, 0), (3, 4), None, (0, 0, 0)), ((5, 4), (3, 0), (2, 4), None, (0, 0, 0))]
    assert [r["linear_fields"][f"{ROW}weight"][3] for r in two] == [(2, 1)] * 2  # even: grid
    assert _all_zero([r["roundtrip"] for r in two]) and _all_zero([r["dp2_full"] for r in two])
    assert all(r["loaded_in_place"] for r in two)


def test_cached_plans_keep_working_and_replan_when_the_dtensor_layout_changes(two):
    """Uneven rows saved twice with one caching strategy (the second reuses the plan), then
    replicated: the structure check replans, the copy on rank 1 is not a main replica, and
    every checkpoint loads exactly."""
    for rank, result in enumerate(two):
        deltas, replicas, reused = zip(*result["cached"])
        assert deltas == (0.0, 0.0, 0.0)
        assert replicas == ((0, 0, 0), (0, 0, 0), (0, 0, rank))
        assert reused == (False, True, False)


def test_dp2_checkpoint_loads_at_dp3_with_uneven_and_empty_shards(three):
    assert [r["local_rows"][f"{ROW}weight"] for r in three] == [(1, 5), (1, 5), (0, 5)]
    assert [r["local_rows"][f"{COL}weight"] for r in three] == [(2, 4), (2, 4), (1, 4)]
    assert _all_zero([r["from_dp2"] for r in three])


def test_empty_shards_save_and_load_at_dp3(three):
    assert three[2]["fields"][f"{ROW}weight"] == ((2, 5), (2, 0), (0, 5), None, (0, 0, 0))
    assert _all_zero([r["dp3_roundtrip"] for r in three])
    assert _all_zero([r["dp3_full"] for r in three])


def test_upstream_saves_an_expert_mesh_at_the_dense_dp_ranks_slots(four):
    """MLite #61 inside megatron-core: the expert DTensor's mesh is (ep, edp) in megatron's
    rank order, upstream places rank r's shard at slot r of the dense data-parallel group.
    The save passes validation and a same-layout round trip looks fine, but the checkpoint
    holds expert 2 where expert 1 belongs (and the reverse): a different layout, or any
    reader of the full tensor, gets the wrong experts."""
    for result in four:
        upstream = result["swap_upstream"]
        assert upstream["same_layout_roundtrip"] == 0.0
        assert upstream["experts_equal"] == [True, False, False, True]
        assert upstream["expert_1_holds"] == [False, False, True, False]
        fixed = result["swap_fixed"]
        assert fixed["same_layout_roundtrip"] == 0.0 and all(fixed["experts_equal"])


def test_tp2_dp2_checkpoint_loads_at_tp1_dp4(four):
    weight = [r["tp2_fields"][f"{COL}weight"] for r in four]
    assert [(f[1], f[2]) for f in weight] == [((0, 0), (2, 4)), ((3, 0), (2, 4)),
                                             ((2, 0), (1, 4)), ((5, 0), (1, 4))]
    assert _all_zero([r["tp1dp4"] for r in four]) and _all_zero([r["tp2dp2_full"] for r in four])


def test_sequential_mlp_experts_reshard_from_ep2_to_ep1_with_empty_shards(four):
    """megatron's own SequentialMLP: every expert-data-parallel shard is a main replica
    (upstream marks all but expert-dp rank 0's as copies), uneven rows at EP 2, an empty
    shard at EP 1, exact on every rank and in the full tensors."""
    fc1 = "mlp.experts.linear_fc1.weight"
    assert sorted(r["ep2_fields"][fc1][1:] for r in four) == [
        ((0, 0, 0), (3, 4), None, (0, 0, 0)), ((0, 3, 0), (2, 4), None, (0, 0, 0)),
        ((1, 0, 0), (3, 4), None, (0, 0, 0)), ((1, 3, 0), (2, 4), None, (0, 0, 0))]
    assert _all_zero([r["ep2_full"] for r in four])
    assert _all_zero([r["ep1"] for r in four])
    assert four[3]["ep1_fields"][fc1][2] == (0, 4)
    assert _all_zero([r["ep1_full"] for r in four])


def test_sharding_validation_is_chunk_exact_for_uneven_expert_shards(four):
    """Upstream's SequentialMLP on the same shards never writes expert-dp rank 1's rows.
    Upstream's validation skips keys without a regular grid (fc1, uneven); the chunk-exact
    check names the missing rows, and every rank raises the same error."""
    errors = [r["ep2_upstream_replicas"] for r in four]
    assert all(e is not None and "ShardingValidationError" in e[0] and
               "CheckpointingException" in e[0] for e in errors)
    assert len({e[1] for e in errors}) == 1
    assert "Invalid access pattern for 'mlp.experts.linear_fc1.weight' (chunks of unequal " \
           "shapes, checked element by element): 16 of 40 elements are covered by no main " \
           "replica (first: [0:1, 3:5, 0:4])" in errors[0][1]
