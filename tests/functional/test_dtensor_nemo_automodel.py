"""NeMo Automodel 0.7.0's MoE checkpoints (``dtensor.nemo_automodel``) through its own
``Checkpointer`` and state-dict adapters, on 2, 3 and 4 gloo ranks: Gemma4 (EP off and on),
Step3p5 (the PR 1691 transpose path) and Qwen3-MoE (the shared MoE mixin).

Each spawn runs plain upstream (the failing twins) and the fix in the same ranks: 2 ranks
(explicit ``install()``) show Gemma4 with EP off losing rank 1's experts, Step3p5 failing on
uneven experts, and the issue's own uneven-inner-dim numbers; 4 ranks save at EP 2 x
expert-dp 2 (and EP 4) what 3 ranks load with EP off, 2 + 2 + 0 experts per rank, with the
fix from the environment switch alone (``MEGATRON_CKPT_FIXES=1``); the mixin's expert split
fails upstream where torch's chunks and its balanced split disagree, and its merge at load
(issue 31 item 7: hidden 5 over ``ep_shard`` 2 at EP 2, saved on 4 ranks, loaded there and
on 3) fails with a size mismatch without its patch. HF-format checkpoints
do not depend on the layout, so every load at another layout is a real reshard. Every
loaded shard is compared with its true value on every rank (max delta 0.0). The harness is
``nemo_harness.py``; NeMo Automodel comes from ``scripts/install_nemo_automodel.sh``.
"""

from __future__ import annotations

import pytest
from optional_systems import require

require("nemo_automodel")

from megatron_ckpt_fixes._dev.testing import run_ranks

pytestmark = pytest.mark.varies_with("torch", "python", "nemo_automodel")

FEATURE = "dtensor.nemo_automodel"
NAMES = {f"{FEATURE}.{n}" for n in (
    "get_expert_slice_for_rank", "split_experts_weights_dtensor_aware", "mixin_merge",
    "step3p5_swap",
    "step3p5_from_reference", "step3p5_to_hf", "gemma4_gather", "gemma4_scales")}


def _two(rank: int, world: int, dirs: dict) -> dict:
    from torch.distributed.tensor import DTensor

    import megatron_ckpt_fixes
    import nemo_harness as h
    from megatron_ckpt_fixes.dtensor import wrap

    out = {"upstream_gemma4_ep1": h.run("gemma4", 1, dirs["up_gemma4"]),
           "upstream_step3p5_uneven": h.run("step3p5", 1, dirs["up_step3p5"], n_experts=3),
           "upstream_issue": h.issue_examples(gather=False)}
    out["applied"] = megatron_ckpt_fixes.install([FEATURE])
    out["gemma4_ep1"] = h.run("gemma4", 1, dirs["gemma4_ep1"])
    out["gemma4_ep2_from_ep1"] = h.run("gemma4", 2, dirs["gemma4_ep1"], save=False)
    out["step3p5_uneven"] = h.run("step3p5", 1, dirs["step3p5"], n_experts=3)
    out["qwen3_moe_uneven"] = h.run("qwen3_moe", 1, dirs["qwen3_moe"], n_experts=3)
    out["issue"] = h.issue_examples()

    # The trivial wrong fix: DTensor.from_local without shape=/stride=.
    def without_shape(local, mesh, placements, global_shape):
        return DTensor.from_local(local, mesh, tuple(placements), run_check=False)

    exact = wrap.from_local_exact
    wrap.from_local_exact = without_shape
    try:
        out["wrong_fix_no_shape"] = h.run("step3p5", 1, dirs["no_shape"], n_experts=3)
    finally:
        wrap.from_local_exact = exact
    megatron_ckpt_fixes.uninstall()
    return out


def _four(rank: int, world: int, dirs: dict) -> dict:
    import megatron_ckpt_fixes
    import nemo_harness as h
    from nemo_automodel.components.moe.state_dict_mixin import MoESplitExpertsStateDictMixin

    megatron_ckpt_fixes.install([FEATURE])
    out = {name: h.run(name, 2, dirs[f"{name}_ep2"]) for name in h.MODELS}
    out["gemma4_ep4_from_ep2"] = h.run("gemma4", 4, dirs["gemma4_ep2"], save=False)
    out["gemma4_ep1_empty"] = h.run("gemma4", 1, dirs["gemma4_empty"], n_experts=3)
    out["qwen3_moe_ep1_6"] = h.run("qwen3_moe", 1, dirs["qwen3_6"], n_experts=6)
    # Item 7: hidden 5 over ep_shard 2 (EP 2), gate_and_up [4, 5, 12]; first with every patch
    # but the mixin's merge (its upstream function: the issue's size mismatch), then fixed.
    merge = MoESplitExpertsStateDictMixin._from_hf_w_merged_experts
    MoESplitExpertsStateDictMixin._from_hf_w_merged_experts = merge.__wrapped__
    try:
        out["upstream_mixin_merge_hidden5"] = h.run("qwen3_moe", 2, dirs["up_hidden5"],
                                                    hidden=5, inter=6)
    finally:
        MoESplitExpertsStateDictMixin._from_hf_w_merged_experts = merge
    out["qwen3_moe_hidden5"] = h.run("qwen3_moe", 2, dirs["hidden5"], hidden=5, inter=6)
    megatron_ckpt_fixes.uninstall()
    # Last: it fails on ranks 2 and 3 only (6 experts: torch's chunks 2, 2, 2, 0; upstream's
    # balanced split 2, 2, 1, 1), and the others then lose their peers.
    out["upstream_qwen3_moe_ep1_6"] = h.run("qwen3_moe", 1, dirs["up_qwen3_6"], n_experts=6)
    return out


def _three_switch(rank: int, world: int, dirs: dict) -> dict:
    import megatron_ckpt_fixes
    import nemo_harness as h

    import nemo_automodel  # noqa: F401 - the switch installs the fix at this import

    out = {"installed": {k: v for k, v in megatron_ckpt_fixes.installed().items()
                         if k.startswith(FEATURE)}}
    for name in h.MODELS:  # saved at EP 2 x expert-dp 2; here EP off, 2 + 2 + 0 experts
        out[f"{name}_from_ep2"] = h.run(name, 1, dirs[f"{name}_ep2"], save=False)
    out["qwen3_moe_hidden5_from_ep2"] = h.run("qwen3_moe", 1, dirs["hidden5"], save=False,
                                              hidden=5, inter=6)
    megatron_ckpt_fixes.uninstall()
    out["upstream_gemma4_from_ep2"] = h.run("gemma4", 1, dirs["gemma4_ep2"], save=False)
    out["upstream_step3p5_from_ep2"] = h.run("step3p5", 1, dirs["step3p5_ep2"], save=False)
    # Last: fails on ranks 1 and 2 only (4 experts: chunks 2, 2, 0; balanced split 2, 1, 1).
    out["upstream_qwen3_moe_from_ep2"] = h.run("qwen3_moe", 1, dirs["qwen3_moe_ep2"],
                                               save=False)
    return out


# ------------------------------------------------------------------ fixtures (one spawn each)
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemo")
    return {name: str(root / name) for name in (
        "up_gemma4", "up_step3p5", "gemma4_ep1", "step3p5", "qwen3_moe", "no_shape",
        "gemma4_ep2", "step3p5_ep2", "qwen3_moe_ep2", "gemma4_empty", "qwen3_6", "up_qwen3_6",
        "up_hidden5", "hidden5")}


@pytest.fixture(scope="module")
def two(dirs):
    return [r.value for r in run_ranks(_two, 2, dirs, timeout_s=400)]


@pytest.fixture(scope="module")
def four(dirs):
    return [r.value for r in run_ranks(_four, 4, dirs, timeout_s=500, collective_timeout_s=60)]


@pytest.fixture(scope="module")
def three(dirs, four):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGATRON_CKPT_FIXES", "1")
        return [r.value for r in run_ranks(_three_switch, 3, dirs, timeout_s=400,
                                           collective_timeout_s=60)]


def _exact(result: dict) -> None:
    assert "error" not in result, result
    assert result["wrong"] == {}, result


# ------------------------------------------------------------------ upstream twins
def test_upstream_gemma4_ep_off_saves_rank0s_local_experts_as_the_whole(two):
    """ep_size=1: ``to_hf`` hands DCP each rank's FSDP2 shard as a plain tensor; the
    checkpoint holds [2, ...] experts (rank 0's) instead of [4, ...], and a load fails."""
    for r in two:
        result = r["upstream_gemma4_ep1"]
        assert result["saved"]["model.language_model.layers.0.experts.gate_up_proj"] == \
            (2, 4, 4), result
        assert "error" in result and "size of tensor" in result["error"], result


def test_upstream_step3p5_uneven_experts_fail_the_save(two):
    """3 experts over 2 ranks (2 + 1): ``DTensor.from_local(local, mesh, swapped)`` makes
    rank 0 see 4 experts and rank 1 see 2; DCP finds overlapping chunks."""
    assert any("overlapping chunks" in r["upstream_step3p5_uneven"].get("error", "") or
               "CheckpointException" in r["upstream_step3p5_uneven"].get("error", "")
               for r in two), [r["upstream_step3p5_uneven"] for r in two]


def test_upstream_issue_numbers(two):
    """The issue's numbers: rank 0 infers (4, 8, 6), rank 1 (4, 8, 4), true (4, 8, 5); the
    per-expert split of [4, 5, 6] over ep_shard 2 infers [6, 6] and [4, 6], true [5, 6]."""
    assert [r["upstream_issue"]["step3p5_shapes"] for r in two] == \
        [[(4, 8, 6), (4, 8, 6)], [(4, 8, 4), (4, 8, 4)]]
    assert [r["upstream_issue"]["split_shapes"] for r in two] == [[(6, 6)], [(4, 6)]]


def test_upstream_mixin_split_disagrees_with_torchs_chunks(four, three):
    """Qwen3-MoE (the shared mixin), EP off: 6 experts on 4 ranks or 4 on 3 (one rank
    empty) raise on the ranks where the balanced split and the DTensor differ."""
    for results, failing in (([r["upstream_qwen3_moe_ep1_6"] for r in four], {2, 3}),
                             ([r["upstream_qwen3_moe_from_ep2"] for r in three], {1, 2})):
        raised = {rank for rank, r in enumerate(results)
                  if "Expected local tensor first dimension" in r.get("error", "")}
        assert raised == failing, results


def test_upstream_mixin_merge_loads_an_uneven_hidden_size_with_a_wrong_shape(four):
    """Item 7 (issue 31): EP 2 x ep_shard 2, hidden 5 over ep_shard 2, every other patch on:
    the save passes, and the load fails in ``load_state_dict`` with the shapes that
    ``create_dtensor_from_local`` infers from each rank's local 3 or 2 rows."""
    for rank, r in enumerate(four):
        result = r["upstream_mixin_merge_hidden5"]
        assert "saved" in result, result
        wrong = "[4, 6, 12]" if rank < 2 else "[4, 4, 12]"
        assert ("size mismatch for model.layers.0.mlp.experts.gate_and_up_projs: copying a "
                f"param with shape torch.Size({wrong}) from checkpoint, the shape in current "
                "model is torch.Size([4, 5, 12])") in result.get("error", ""), result


def test_upstream_gemma4_and_step3p5_cannot_load_an_ep2_checkpoint_with_ep_off(three):
    for r in three:
        assert "error" in r["upstream_gemma4_from_ep2"], r["upstream_gemma4_from_ep2"]
    assert any("error" in r["upstream_step3p5_from_ep2"] or r["upstream_step3p5_from_ep2"]
               ["wrong"] for r in three)


# ------------------------------------------------------------------ the fix
def test_gemma4_ep_off_saves_every_rank_and_loads_at_ep2(two, four):
    for r in two:
        assert set(r["applied"]) == NAMES
        _exact(r["gemma4_ep1"])
        assert r["gemma4_ep1"]["saved"]["model.language_model.layers.0.experts.gate_up_proj"] \
            == (4, 4, 4)
        _exact(r["gemma4_ep2_from_ep1"])
    for r in four:  # 3 experts on 4 ranks: rank 3 holds none
        _exact(r["gemma4_ep1_empty"])
    assert four[3]["gemma4_ep1_empty"]["local_sizes"]["down_projs"][0] == 0


def test_uneven_experts_round_trip_step3p5_and_the_mixin(two, four):
    for r in two:
        _exact(r["step3p5_uneven"])
        _exact(r["qwen3_moe_uneven"])
    for r in four:
        _exact(r["qwen3_moe_ep1_6"])


def test_ep2_with_expert_dp_saves_and_loads_at_ep4_and_ep_off(four, three):
    for r in four:
        for name in ("gemma4", "step3p5", "qwen3_moe"):
            _exact(r[name])
            assert r[name]["placements"]["down_projs"] == "(Shard(dim=1), Shard(dim=0))"
        _exact(r["gemma4_ep4_from_ep2"])
    for r in three:
        for name in ("gemma4", "step3p5", "qwen3_moe"):
            _exact(r[f"{name}_from_ep2"])
    assert three[2]["gemma4_from_ep2"]["local_sizes"]["down_projs"][0] == 0


def test_mixin_merge_is_exact_with_an_uneven_hidden_size(four, three):
    """The same save (EP 2 x ep_shard 2, hidden 5) with the fix loads exactly there and at
    EP off on 3 ranks (2 + 2 + 0 experts)."""
    for r in four:
        _exact(r["qwen3_moe_hidden5"])
        assert r["qwen3_moe_hidden5"]["saved"][
            "model.layers.0.mlp.experts.0.up_proj.weight"] == (6, 5)
    assert [r["qwen3_moe_hidden5"]["local_sizes"]["gate_and_up_projs"] for r in four] == \
        [(2, 3, 12), (2, 3, 12), (2, 2, 12), (2, 2, 12)]
    for r in three:
        _exact(r["qwen3_moe_hidden5_from_ep2"])


def test_the_issue_numbers_are_exact(two):
    for r in two:
        assert r["issue"]["step3p5_shapes"] == [(4, 8, 5), (4, 8, 5)]
        assert r["issue"]["step3p5_exact"] is True
        assert r["issue"]["split_shapes"] == [(5, 6)] and r["issue"]["split_exact"] is True


def test_the_switch_alone_installs_the_fix_at_import(three):
    for r in three:
        assert set(r["installed"]) == NAMES
        assert not any(v.startswith(("not applied", "waiting")) for v in r["installed"].values())


def test_wrong_fix_without_shape_fails_on_uneven_experts(two):
    assert any("error" in r["wrong_fix_no_shape"] or r["wrong_fix_no_shape"]["wrong"]
               for r in two), [r["wrong_fix_no_shape"] for r in two]
