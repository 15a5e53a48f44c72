"""Single-process tests: the rules table, the adapter's key/dim mapping, the agreement
verdict over per-rank reports, and the no-op copy into an empty shard."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from megatron_ckpt_fixes import dtensor as mdt
from megatron_ckpt_fixes.dtensor.verdict import KeyReport, RankReport, verdict

pytestmark = pytest.mark.varies_with("torch", "python")

MESH = SimpleNamespace(mesh_dim_names=("dp", "ep"), ndim=2)  # all a rule reads of a mesh

TABLE = mdt.PlacementTable((
    mdt.replicated("hc_head.*"),
    mdt.sharded("*head*", ep=0),
    mdt.sharded("*.experts.*", dp=1, ep=0),
    mdt.sharded("*.qkv.*", dp=0, ep=0),
))


@pytest.mark.parametrize("key,placements", [
    ("hc_head.weight", (Replicate(), Replicate())),      # the exception above the generic rule
    ("lm_head.weight", (Replicate(), Shard(0))),
    ("layers.3.mlp.experts.fc1.weight0", (Shard(1), Shard(0))),
    ("layers.0.attn.qkv.weight", (Shard(0), Shard(0))),  # two axes, one dim
])
def test_first_matching_rule_wins(key, placements):
    assert TABLE.rule_for(key).placements(key, MESH) == placements


def test_unmatched_key_has_no_rule():
    assert TABLE.rule_for("layers.0.norm.weight") is None


def test_rule_naming_a_missing_axis_is_named():
    match = r"'lm_head.weight'.*'tp', not one of \['dp', 'ep'\]"
    with pytest.raises(mdt.PlacementError, match=match):
        mdt.sharded("*", tp=0).placements("lm_head.weight", MESH)


class Adapter(mdt.StateDictAdapter):
    key_maps = (
        mdt.KeyMap("layers.{i}.experts.w13", ("hf.{i}.gate", "hf.{i}.up"), perm=(0, 2, 1),
                   split_dim=2),
        mdt.KeyMap("layers.{i}.experts.w2", "hf.{i}.down", perm=(2, 0, 1)),
    )


def test_adapter_maps_keys_permutes_splits_and_inverts():
    native = {"layers.1.experts.w13": torch.arange(2 * 6 * 3.).reshape(2, 6, 3),
              "layers.1.experts.w2": torch.arange(2 * 3 * 4.).reshape(2, 3, 4),
              "norm": torch.ones(3), "step": 5}
    hf = Adapter().to_hf(native)
    w13 = native["layers.1.experts.w13"].permute(0, 2, 1)
    assert torch.equal(hf["hf.1.gate"], w13[..., :3]) and torch.equal(hf["hf.1.up"], w13[..., 3:])
    assert torch.equal(hf["hf.1.down"], native["layers.1.experts.w2"].permute(2, 0, 1))
    assert hf["norm"] is native["norm"] and hf["step"] == 5
    back = Adapter().from_hf(hf)
    assert back.keys() == native.keys()
    for key, value in native.items():
        assert torch.equal(back[key], value) if key != "step" else back[key] == value


def test_adapter_refuses_an_uneven_split():
    with pytest.raises(mdt.PlacementError, match=r"'layers.0.experts.w13'.*size 5 .*2 equal"):
        Adapter().to_hf({"layers.0.experts.w13": torch.zeros(2, 5, 3)})


def _report(rank, coord, local_shape, placements=(Shard(0),), mesh_shape=(2,), given=None):
    return RankReport(rank, (), {"w": KeyReport(mesh_shape, tuple(range(2)), placements,
                                                given, coord, local_shape)})


def test_agreement_infers_uneven_global_shape():
    result = verdict([_report(0, (0,), (3, 4)), _report(1, (1,), (2, 4))])
    assert result.global_shapes == {"w": (5, 4)} and result.problems == ()


def test_agreement_reports_a_rank_with_another_layout():
    result = verdict([_report(0, (0,), (3, 4)), _report(1, (1,), (5, 2), (Shard(1),))])
    (key, rank, problem), = result.problems
    assert (key, rank) == ("w", 1) and "differs from rank 0" in problem


def test_agreement_reports_a_rank_without_the_key():
    result = verdict([_report(0, (0,), (3, 4)), RankReport(1)])
    assert result.problems == (("w", None, "ranks [1] of the checkpoint mesh have no local "
                                            "shard for this key"),)


def test_agreement_keeps_local_problems_and_skips_their_key():
    local = RankReport(1, (("w", 1, "bad placements"),))
    result = verdict([_report(0, (0,), (3, 4)), local])
    assert result.problems == (("w", 1, "bad placements"),) and result.global_shapes == {}


def test_copy_into_an_empty_shard_is_a_no_op():
    mdt.copy_into("w", torch.empty(0, 4), torch.ones(3, 4))  # no error, nothing to write
    dst = torch.zeros(2, 3)
    mdt.copy_into("w", dst, torch.ones(2, 3))
    assert torch.equal(dst, torch.ones(2, 3))
    with pytest.raises(mdt.PlacementError, match=r"'w'.*\[3, 3\] does not match.*\[2, 3\]"):
        mdt.copy_into("w", dst, torch.ones(3, 3))
