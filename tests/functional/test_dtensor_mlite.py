"""MLite's DCP training checkpoints (``dtensor.mlite``) through MLite's own code, on 2, 3 and
4 gloo ranks, from the ``dev`` snapshot (and PR 61's ``dcp.py`` beside it).

Each spawn runs plain upstream first (the failing twins), then the fix, in the same ranks:
4 ranks (explicit ``install()``) save the checkpoints the others load at another layout;
3 ranks check the parameter's own mesh is kept where the checkpoint layout is unsharded
(uneven and empty FSDP2 shards, nothing materialized) and the two trivial wrong fixes fail;
2 ranks get the fix from the environment switch alone (``MEGATRON_CKPT_FIXES=1``, no code
change), then show the issue's own failure after ``uninstall()``. Every loaded shard is
compared with its true value on every rank (max delta 0.0), and every checkpoint is read back
whole. The harness (CPU meshes, the model) is in ``mlite_harness.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from optional_systems import require

require("mlite")

from megatron_ckpt_fixes._dev.testing import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import upstream_snapshots  # noqa: E402

pytestmark = pytest.mark.varies_with("torch", "python", "mlite")

FEATURE = "dtensor.mlite"


def _roots() -> dict[str, str]:
    return {ref: str(upstream_snapshots.import_root("megatron-lite", ref))
            for ref in ("dev", "pr61")}


def _setup(roots: dict[str, str]):
    """MLite (dev) importable and on CPU meshes; DeepSeek-V4's rules; MLite's dcp module."""
    import importlib

    import mlite_harness as h

    h.use_tree(roots["dev"])
    api = importlib.import_module("megatron.lite.primitive.ckpt.dcp")
    mapped = h.cpu_meshes()
    return h, api, h.deepseek_v4_rules(), mapped


def _summary(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "values"}


# ------------------------------------------------------------------ 4 ranks: the saves
def _four(rank: int, world: int, roots: dict, dirs: dict) -> dict:
    import torch
    from torch.distributed.tensor import DTensor

    import megatron_ckpt_fixes
    from megatron_ckpt_fixes.dtensor import wrap

    h, api, rules, mapped = _setup(roots)
    experts, even = h.Truth(tp=1, ep=2), h.Truth(tp=1, ep=2, experts=h.EXPERTS_EVEN)
    dense = h.Truth(tp=2, ep=1, dense=True)
    out = {"upstream_ep2_edp2": _summary(h.round_trip(api, dirs["up_a"], experts, 1, 2, rules)),
           "upstream_ep4": _summary(h.round_trip(api, dirs["up_b"], h.Truth(tp=1, ep=4), 1, 4,
                                                 rules))}
    h.round_trip(api, dirs["up_plain"], dense, 2, 1, rules, fsdp=False)
    out["upstream_plain_hc_head"] = h.saved_size(f"{dirs['up_plain']}/step_1",
                                                 "model.hc_head.hc_fn")
    pr61 = h.round_trip(h.pr61_dcp(roots["pr61"]), dirs["pr61"], even, 1, 2, rules)

    out["applied"] = megatron_ckpt_fixes.install([FEATURE])
    out["ep2_edp2"] = _summary(h.round_trip(api, dirs["a"], experts, 1, 2, rules))
    out["ep4"] = _summary(h.round_trip(api, dirs["b"], h.Truth(tp=1, ep=4), 1, 4, rules))
    out["dense_tp2_dp2"] = _summary(h.round_trip(api, dirs["c"], dense, 2, 1, rules))
    out["hc_head"] = h.saved_size(f"{dirs['c']}/step_1", "model.hc_head.hc_fn")
    h.round_trip(api, dirs["plain"], dense, 2, 1, rules, fsdp=False)
    out["plain_hc_head"] = h.saved_size(f"{dirs['plain']}/step_1", "model.hc_head.hc_fn")
    fixed_even = h.round_trip(api, dirs["even"], even, 1, 2, rules)
    out["pr61"] = _summary(pr61)
    out["pr61_same_values"] = all(torch.equal(pr61["values"][n], v)
                                  for n, v in fixed_even["values"].items()) \
        if "values" in pr61 else None

    # The trivial wrong fix: DTensor.from_local without shape=/stride=.
    def without_shape(local, mesh, placements, global_shape):
        return DTensor.from_local(local, mesh, tuple(placements), run_check=False)

    exact = wrap.from_local_exact
    wrap.from_local_exact = without_shape
    try:
        out["wrong_fix_no_shape"] = _summary(h.round_trip(api, dirs["no_shape"], experts, 1, 2,
                                                          rules))
    finally:
        wrap.from_local_exact = exact
    # PP 2 x EP 2: a stage's keys exist on its ranks only, the checkpoint mesh spans both.
    out["pp2_ep2"] = _summary(h.round_trip(api, dirs["pp2"], h.Truth(tp=1, ep=2), 1, 2, rules,
                                           pp=2))
    megatron_ckpt_fixes.uninstall()
    out["meshes_mapped"] = mapped["meshes"]
    return out


# ------------------------------------------------------------------ 3 ranks
def _three(rank: int, world: int, roots: dict, dirs: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    import megatron_ckpt_fixes
    from megatron_ckpt_fixes.dtensor import wrap

    h, api, rules, _ = _setup(roots)
    out = {"upstream_ep3": _summary(h.round_trip(api, dirs["up_3"], h.Truth(tp=1, ep=3), 1, 3,
                                                 rules))}
    megatron_ckpt_fixes.install([FEATURE])
    out["ep3"] = _summary(h.round_trip(api, dirs["ep3"], h.Truth(tp=1, ep=3), 1, 3, rules))

    seen: list[dict] = []
    real_load = dcp.load

    def spy(state_dict, *args, **kwargs):  # what reaches torch's DCP, per key
        seen.append({k: (v.device_mesh.mesh_dim_names, v.to_local().numel())
                     for k, v in state_dict.items() if isinstance(v, DTensor)})
        return real_load(state_dict, *args, **kwargs)

    def passed_to_dcp() -> dict:
        return {k: v for call in seen for k, v in call.items()}

    dcp.load = spy
    try:
        # The TP 2 x dp 2 dense checkpoint at TP 1 x dp 3 (uneven, one empty shard), and
        # experts at EP 1 (FSDP2 over dp 3): unsharded layouts keep the parameter's mesh.
        out["dense_from_tp2"] = _summary(h.round_trip(api, dirs["c"], h.Truth(tp=1, ep=1,
                                                                              dense=True),
                                                      1, 1, rules, save=False))
        out["ep1"] = _summary(h.round_trip(api, dirs["ep1"], h.Truth(tp=1, ep=1), 1, 1, rules))
        out["passed"] = passed_to_dcp()
        # The trivial wrong fix: the checkpoint mesh always, even for unsharded layouts (a
        # replicated layout then needs the whole tensor on every rank: materialized).
        seen.clear()
        plan = wrap.plan_wrap

        def always_checkpoint_mesh(key, value, layout, rank):
            if wrap.is_sharded(layout.placements):
                return plan(key, value, layout, rank)
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            return wrap.WrapPlan(whole, layout.mesh, tuple(layout.placements), whole.shape)

        wrap.plan_wrap = always_checkpoint_mesh
        try:
            out["wrong_fix_ckpt_mesh"] = _summary(h.round_trip(
                api, dirs["c"], h.Truth(tp=1, ep=1, dense=True), 1, 1, rules, save=False))
            out["wrong_fix_passed"] = passed_to_dcp()
        finally:
            wrap.plan_wrap = plan
    finally:
        dcp.load = real_load
    megatron_ckpt_fixes.uninstall()
    return out


# ------------------------------------------------------------------ 2 ranks: the switch
def _two_switch(rank: int, world: int, roots: dict, dirs: dict) -> dict:
    import megatron_ckpt_fixes

    h, api, rules, _ = _setup(roots)  # imports megatron.lite: the switch installs the fix
    out = {"installed": {k: v for k, v in megatron_ckpt_fixes.installed().items()
                         if k.startswith(FEATURE)}}
    experts = h.Truth(tp=1, ep=2)
    out["from_edp2"] = _summary(h.round_trip(api, dirs["a"], experts, 1, 2, rules, save=False))
    out["ep2_edp1"] = _summary(h.round_trip(api, dirs["two"], experts, 1, 2, rules))
    megatron_ckpt_fixes.uninstall()
    out["upstream_ep2_edp1"] = _summary(h.round_trip(api, dirs["up_two"], experts, 1, 2, rules))
    return out


# ------------------------------------------------------------------ fixtures (one spawn each)
@pytest.fixture(scope="module")
def roots():
    return _roots()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlite")
    return {name: str(root / name) for name in (
        "up_a", "up_b", "up_plain", "pr61", "a", "b", "c", "plain", "even", "no_shape",
        "up_3", "ep3", "ep1", "two", "up_two", "pp2")}


@pytest.fixture(scope="module")
def four(roots, dirs):
    return [r.value for r in run_ranks(_four, 4, roots, dirs, timeout_s=600)]


@pytest.fixture(scope="module")
def three(roots, dirs, four):
    return [r.value for r in run_ranks(_three, 3, roots, dirs, timeout_s=400)]


@pytest.fixture(scope="module")
def two(roots, dirs, four, monkeypatch_module):
    monkeypatch_module.setenv("MEGATRON_CKPT_FIXES", "1")
    return [r.value for r in run_ranks(_two_switch, 2, roots, dirs, timeout_s=400)]


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _exact(result: dict) -> None:
    assert "error" not in result, result
    assert result["wrong"] == {} and result["read_back"] == {}, result


# ------------------------------------------------------------------ upstream twins
def _one_group_survives(results: list[dict], rows: int) -> None:
    """Every EP rank wrote its experts at the same offsets of each key: the checkpoint holds
    one expert per key (``rows`` rows, not EP x ``rows``), each chunk from whichever rank
    DCP kept, and every rank loads experts that are not its own, silently (no error)."""
    assert all("error" not in r for r in results), results
    assert all(r["wrong"] for r in results), results
    assert all(r["read_back"]["layers.0.mlp.experts.fc1.weight0"] == f"saved shape [{rows}, 5]"
               for r in results)


def test_upstream_ep2_and_ep4_load_one_ranks_experts_everywhere(four):
    """dev at EP 2 x expert-dp 2 and at EP 4 (4 ranks)."""
    _one_group_survives([r["upstream_ep2_edp2"] for r in four], 6)
    _one_group_survives([r["upstream_ep4"] for r in four], 6)


def test_upstream_ep3_loads_one_ranks_experts_everywhere(three):
    _one_group_survives([r["upstream_ep3"] for r in three], 6)


def test_upstream_ep2_on_two_ranks_loads_the_peers_experts(two):
    """The issue's own setting: 8 experts, EP 2 on 2 ranks (rank 0 holds 0..3, rank 1 4..7);
    each rank ends with experts of the other."""
    results = [r["upstream_ep2_edp1"] for r in two]
    _one_group_survives(results, 6)
    loaded = results[0]["experts"]
    assert set(loaded) - {0, 1, 2, 3} and set(loaded) - {4, 5, 6, 7}, loaded


def test_upstream_head_rule_doubles_hc_head_under_tp2(four):
    """DeepSeek-V4's ``"head" in name -> Shard(0)`` on a plain (unwrapped) parameter that
    every TP rank holds whole: saved as [6, 5] instead of [3, 5]."""
    assert all(r["upstream_plain_hc_head"] == (6, 5) for r in four)


# ------------------------------------------------------------------ the fix
def test_expert_parallel_checkpoints_are_exact_at_ep2_ep3_ep4(four, three):
    for r in four:
        _exact(r["ep2_edp2"])  # uneven (3 + 2 rows) and empty (1 + 0) FSDP2 expert shards
        _exact(r["ep4"])
        assert r["applied"] == [f"{FEATURE}.dcp_tensor_from_param",
                                f"{FEATURE}.empty_dcp_tensor_like_param", f"{FEATURE}.dcp"]
        assert r["meshes_mapped"] > 0
    for r in three:
        _exact(r["ep3"])


def test_ep2_checkpoint_saved_at_expert_dp2_loads_at_expert_dp1(two):
    for r in two:
        _exact(r["from_edp2"])
        _exact(r["ep2_edp1"])
    assert [r["ep2_edp1"]["experts"] for r in two] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_dense_tp2_checkpoint_loads_at_tp1_dp3_with_uneven_and_empty_shards(four, three):
    for r in four:
        _exact(r["dense_tp2_dp2"])
    for r in three:
        _exact(r["dense_from_tp2"])
        _exact(r["ep1"])


def test_hc_head_is_saved_whole_before_the_head_rule(four):
    assert all(r["hc_head"] == (3, 5) and r["plain_hc_head"] == (3, 5) for r in four)


def test_unsharded_layouts_keep_the_parameter_mesh_and_empty_shards(three):
    """At TP 1 x EP 1 every checkpoint layout is unsharded: DCP gets each FSDP2 parameter on
    its own one-axis dp mesh, and rank 2's empty attn_hc shard stays empty."""
    for rank, r in enumerate(three):
        assert r["passed"] and all(names == ("dp_cp",) for names, _ in r["passed"].values())
    assert three[2]["passed"]["model.layers.0.attn_hc.hc_fn"][1] == 0


def test_the_switch_alone_installs_the_fix_at_import(two):
    for r in two:
        assert set(r["installed"]) == {f"{FEATURE}.dcp_tensor_from_param",
                                       f"{FEATURE}.empty_dcp_tensor_like_param",
                                       f"{FEATURE}.dcp"}
        assert not any(v.startswith(("not applied", "waiting")) for v in r["installed"].values())


def test_pr61_gives_the_same_values_where_it_works(four):
    """PR 61's tree on even shards (its global shape is the local one times the mesh): the
    same loaded values on every rank as the fix, at the layout it saved. Its checkpoint does
    not hold the experts in order, though: it puts FSDP2's expert-dp shard before the EP
    axis on the same dim (``Shard`` where the fix has ``_StridedShard``), so read back whole,
    or at another expert-dp degree, the rows are another expert's."""
    for r in four:
        assert r["pr61"].get("wrong") == {}, r["pr61"]
        assert r["pr61_same_values"] is True
        assert r["pr61"]["read_back"], r["pr61"]  # whole: rows out of order


# ------------------------------------------------------------------ the trivial wrong fixes
def test_wrong_fix_without_shape_fails_on_uneven_expert_shards(four):
    results = [r["wrong_fix_no_shape"] for r in four]
    assert any("error" in r or r["wrong"] or r["read_back"] for r in results), results


def test_wrong_fix_always_checkpoint_mesh_materializes_empty_shards(three):
    """Rank 2's empty attn_hc shard became the whole [2, 5] tensor (gathered), and MLite then
    cannot copy the whole loaded tensors into its FSDP2 shards."""
    assert three[2]["wrong_fix_passed"]["model.layers.0.attn_hc.hc_fn"][1] == 10
    assert all("error" in r["wrong_fix_ckpt_mesh"] for r in three)


def test_pipeline_stages_with_a_sharded_layout_are_refused_on_every_rank(four):
    """PP 2 x EP 2: the expert mesh spans both stages, each stage's keys live on its own
    ranks; the same LayoutAgreementError on every rank before DCP (upstream: silently the
    wrong experts, as at PP 1)."""
    errors = [r["pp2_ep2"].get("error", "") for r in four]
    assert all(e.startswith("LayoutAgreementError") and "of the checkpoint mesh have no "
               "local shard for this key" in e for e in errors), errors
    assert len({e.partition(":")[2] for e in errors}) == 1
