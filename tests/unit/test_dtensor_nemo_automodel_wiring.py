"""``dtensor.nemo_automodel`` in one process, against NeMo Automodel 0.7.0
(``scripts/install_nemo_automodel.sh``): the pure pieces it adds to the DTensor core, the
probes that decide from upstream's behaviour whether each patch is needed, the modules found
to bind the shared helpers by name, and the all-or-nothing refusal when a symbol is missing.
"""

from __future__ import annotations

import pytest
from optional_systems import require

require("nemo_automodel")
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from megatron_ckpt_fixes import SYSTEMS, UnsupportedVersionError
from megatron_ckpt_fixes.integrations import nemo_automodel as nemo
from megatron_ckpt_fixes.dtensor.errors import PlacementError
from megatron_ckpt_fixes.dtensor.placements import shape_from_reference

pytestmark = pytest.mark.varies_with("torch", "python", "nemo_automodel")

FEATURE = "dtensor.nemo_automodel"
PROBES = (nemo.upstream_slices_by_chunks, nemo.upstream_splits_exactly,
          nemo.upstream_mixin_merges_exactly, nemo.upstream_swaps_strided,
          nemo.upstream_step3p5_to_hf_exact, nemo.upstream_step3p5_from_reference_exact,
          nemo.upstream_gemma4_keeps_shards)


@pytest.fixture
def fresh_probes():
    for probe in PROBES:
        probe.cache_clear()
    yield
    for probe in PROBES:
        probe.cache_clear()


# ------------------------------------------------------------------ pure pieces
def test_shape_from_reference_takes_sharded_dims_from_the_reference():
    # HF gate [4, 8, 5] Shard(2) (this rank 3 of 5 rows) -> native gate_and_up local [4, 3, 16]
    assert shape_from_reference("k", (4, 3, 16), (Shard(1),), (4, 8, 5), (Shard(2),)) == \
        (4, 5, 16)
    strided = (_StridedShard(2, split_factor=2), Shard(2))
    assert shape_from_reference("k", (2, 1, 8), (_StridedShard(1, split_factor=2), Shard(1)),
                                (2, 8, 4), strided) == (2, 4, 8)
    with pytest.raises(PlacementError, match="not a local transform"):
        shape_from_reference("k", (4, 3), (Replicate(),), (4, 6), (Shard(1),))


def test_expert_placements_drop_the_expert_dim():
    assert nemo._without_expert_dim((Shard(1), Shard(0), Replicate(),
                                     _StridedShard(2, split_factor=2))) == \
        (Shard(0), Replicate(), Replicate(), _StridedShard(1, split_factor=2))


def test_merged_expert_shape_takes_experts_and_the_hf_in_dim():
    # issue 31 item 7: gate_and_up local [2, 3, 12] of [4, 5, 12], (ep_shard Shard(1), ep
    # Shard(0)); HF up_proj [6, 5]
    assert nemo.merged_expert_shape("k", (2, 3, 12), (Shard(1), Shard(0)), 4, (6, 5)) == \
        (4, 5, 12)
    assert nemo.merged_expert_shape("k", (2, 2, 12), (Shard(1), Shard(0)), 4, (6, 5)) == \
        (4, 5, 12)
    assert nemo.merged_expert_shape("k", (2, 6, 5), (Replicate(), Shard(0)), 4, (5, 6)) == \
        (4, 6, 5)
    with pytest.raises(PlacementError, match="shards dim 2"):
        nemo.merged_expert_shape("k", (2, 3, 6), (Shard(2),), 4, (6, 5))


def test_hf_expert_references_name_the_merged_keys(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep_shard",))
    up, down = (distribute_tensor(torch.zeros(s), mesh, [Shard(1)]) for s in ((6, 5), (5, 6)))
    refs = nemo.hf_expert_references({
        "model.layers.0.mlp.experts.3.gate_proj.weight": up,
        "model.layers.0.mlp.experts.3.up_proj.weight": up,
        "model.layers.0.mlp.experts.3.down_proj.weight": down,
        "model.layers.1.mlp.experts.0.up_proj.weight": torch.zeros(6, 5),  # not a DTensor
        "model.layers.0.mlp.gate.weight": up})
    assert refs == {"model.layers.0.mlp.experts.gate_and_up_projs": up,
                    "model.layers.0.mlp.experts.down_projs": down}


# ------------------------------------------------------------------ detection by behaviour
def test_every_patch_is_needed_on_0_7_0(fresh_probes):
    assert [probe() for probe in PROBES] == [None] * len(PROBES)
    from nemo_automodel.components.moe import state_dict_utils

    assert state_dict_utils.is_dtensor.__module__ == state_dict_utils.__name__  # put back


def _fixed_upstream() -> dict:
    """What a NeMo Automodel with these fixes would do where the probes look (each answers
    the probe's stand-ins the way the fix answers real DTensors)."""
    import torch.distributed._tensor as dtensor_module
    from nemo_automodel.components.models.gemma4_moe import state_dict_adapter as gemma4
    from nemo_automodel.components.models.step3p5 import state_dict_adapter as step3p5
    from nemo_automodel.components.moe import state_dict_mixin as mixin
    from nemo_automodel.components.moe import state_dict_utils as utils

    from megatron_ckpt_fixes.dtensor.placements import contiguous_stride
    from megatron_ckpt_fixes.dtensor.transpose import transpose_placements

    def exact(from_local, value, reference):
        shape = shape_from_reference("k", value.to_local().shape, value.placements,
                                     reference.shape, reference.placements)
        return from_local(value.to_local(), value.device_mesh, value.placements, shape=shape,
                          stride=contiguous_stride(shape))

    def slice_(tensor, n_experts):  # torch's chunks: rank 1 of 3 holds experts 2:4 of 4
        return tensor.to_local(), 2, 4

    def split(weight, n_experts):
        local = weight.to_local()
        shape = tuple(weight.shape[1:])
        return [utils.DTensor.from_local(local[i], None, (Shard(0),), shape=shape,
                                         stride=contiguous_stride(shape))
                for i in range(local.shape[0])], list(range(local.shape[0]))

    original_to_hf = step3p5.Step3p5StateDictAdapter._convert_native_to_hf
    original_reference = step3p5._create_dtensor_from_local_or_reference

    def to_hf(self, fqn, tensor):
        return [(k, exact(dtensor_module.DTensor.from_local, v, tensor))
                for k, v in original_to_hf(self, fqn, tensor)]

    def from_reference(local, reference, device_mesh=None, rank=None, placements_override=None):
        made = original_reference(local, reference, device_mesh, rank, placements_override)
        return exact(dtensor_module.DTensor.from_local, made, reference)

    def gather(self, tensor, device_mesh, n_experts):
        return tensor

    original_merge = mixin.MoESplitExpertsStateDictMixin._from_hf_w_merged_experts
    merged = {"up_proj": "gate_and_up_projs", "down_proj": "down_projs"}

    def merge(self, hf, *args, **kwargs):  # the HF weights' shapes, as the fix reads them
        refs = {f"{k.rsplit('.', 3)[0]}.{merged[k.split('.')[-2]]}": v.shape
                for k, v in hf.items() if k.split(".")[-2] in merged}
        out = original_merge(self, hf, *args, **kwargs)
        for key, ref in refs.items():
            value = out[key]
            shape = nemo.merged_expert_shape(key, value.to_local().shape, value.placements,
                                             self.moe_config.n_routed_experts, ref)
            out[key] = utils.DTensor.from_local(value.to_local(), value.device_mesh,
                                                value.placements, shape=shape,
                                                stride=contiguous_stride(shape))
        return out

    return {(utils, "get_expert_slice_for_rank"): slice_,
            (utils, "split_experts_weights_dtensor_aware"): split,
            (mixin.MoESplitExpertsStateDictMixin, "_from_hf_w_merged_experts"): merge,
            (step3p5, "_swap_shard_placements_1_2"):
                lambda placements: transpose_placements(placements, 3, 1, 2),
            (step3p5, "_create_dtensor_from_local_or_reference"): from_reference,
            (step3p5.Step3p5StateDictAdapter, "_convert_native_to_hf"): to_hf,
            (gemma4.Gemma4MoEStateDictAdapter, "_gather_expert_tensor"): gather}


def test_a_fixed_upstream_is_left_alone(fresh_probes, monkeypatch, clean_install):
    """Each probe recognises an upstream that already does what its patch does, and
    install() then applies nothing of the feature and says why."""
    for (owner, attr), function in _fixed_upstream().items():
        monkeypatch.setattr(owner, attr, function)
    reasons = [probe() for probe in PROBES]
    assert all(reasons), reasons
    assert clean_install.install([FEATURE]) == []
    assert len(clean_install.installed()) == 8
    assert all(v.startswith("not applied: not needed: ") for v in
               clean_install.installed().values())


# ------------------------------------------------------------------ install
def test_install_patches_the_helpers_where_modules_bound_them(clean_install):
    from nemo_automodel.components.models.deepseek_v4 import state_dict_adapter as dsv4
    from nemo_automodel.components.moe import state_dict_mixin, state_dict_utils

    original = state_dict_utils.split_experts_weights_dtensor_aware
    assert dict(nemo._IMPORTS["split_experts_weights_dtensor_aware"]) == {
        "nemo_automodel.components.models.deepseek_v4.state_dict_adapter":
            "split_experts_weights_dtensor_aware",
        "nemo_automodel.components.moe.state_dict_mixin": "split_experts_weights_dtensor_aware"}
    assert len(clean_install.install([FEATURE])) == 8
    patched = state_dict_utils.split_experts_weights_dtensor_aware
    assert patched is not original and state_dict_mixin.split_experts_weights_dtensor_aware \
        is patched and dsv4.split_experts_weights_dtensor_aware is patched
    clean_install.uninstall()
    assert state_dict_mixin.split_experts_weights_dtensor_aware is original


def test_a_missing_symbol_refuses_everything(monkeypatch, clean_install):
    from nemo_automodel.components.moe import state_dict_utils

    monkeypatch.delattr(state_dict_utils, "_get_expert_mesh_dim_index")
    before = state_dict_utils.get_expert_slice_for_rank
    with pytest.raises(UnsupportedVersionError, match="_get_expert_mesh_dim_index not found"):
        clean_install.install([FEATURE])
    assert state_dict_utils.get_expert_slice_for_rank is before
    assert not any(not v.startswith("not applied") for v in clean_install.installed().values())


def test_sharded_scale_keeps_each_ranks_experts(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard_cp",))
    experts = distribute_tensor(torch.zeros(3, 2, 2), mesh, [Shard(0)])
    scale = nemo.sharded_scale("layers.0.router.per_expert_scale", torch.arange(3.0), experts)
    assert scale.placements == (Shard(0),) and tuple(scale.shape) == (3,)
    assert torch.equal(scale.to_local(), torch.arange(3.0))


def test_the_feature_waits_for_nemo_automodel():
    assert SYSTEMS[FEATURE] == "nemo_automodel"
