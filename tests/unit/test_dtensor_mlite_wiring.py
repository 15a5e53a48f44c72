"""``dtensor.mlite`` in one process: the pure pieces it adds to the DTensor core, the
detection of an upstream that already builds checkpoint tensors right (by behaviour), and
the all-or-nothing refusal when MLite lacks something the patches read. MLite is the
``dev`` snapshot (``scripts/upstream_snapshots.py``); PR 61's ``dcp.py`` is loaded beside it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from optional_systems import require

require("mlite")
import torch
from torch.distributed.tensor import Replicate, Shard

from megatron_ckpt_fixes import SYSTEMS, UnsupportedVersionError
from megatron_ckpt_fixes.integrations import mlite
from megatron_ckpt_fixes.dtensor.errors import PlacementError
from megatron_ckpt_fixes.dtensor.placements import (axes_of_lines, lines_through,
                                                    merge_param_sharding,
                                                    without_trivial_shards)
from megatron_ckpt_fixes.dtensor.wrap import paired_axis_names

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import upstream_snapshots  # noqa: E402

pytestmark = pytest.mark.varies_with("torch", "python", "mlite")

FEATURE = "dtensor.mlite"
NAMES = {f"{FEATURE}.dcp_tensor_from_param", f"{FEATURE}.empty_dcp_tensor_like_param",
         f"{FEATURE}.dcp"}


@pytest.fixture(scope="module")
def dev():
    """MLite's checkpoint module from the dev snapshot."""
    root = str(upstream_snapshots.import_root("megatron-lite", "dev"))
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(mlite.DCP_MODULE)


@pytest.fixture
def probe():
    mlite.upstream_uses_checkpoint_layout.cache_clear()
    yield mlite.upstream_uses_checkpoint_layout
    mlite.upstream_uses_checkpoint_layout.cache_clear()


# ------------------------------------------------------------------ pure pieces
def test_shards_over_size_one_axes_are_unsharded():
    placements = (Replicate(), Shard(0), Replicate(), Shard(1))
    assert without_trivial_shards(placements, (1, 2, 1, 1)) == \
        (Replicate(), Shard(0), Replicate(), Replicate())


def test_rank_lines_pair_an_fsdp_mesh_with_the_expert_dp_axis():
    ranks = torch.arange(8).reshape(1, 2, 2, 2)  # MLite's expert mesh [PP, EDP, EP, ETP]
    assert lines_through(ranks, (0, 1, 0, 1)) == [[5], [1, 5], [5, 7], [4, 5]]
    # expert-dp group of rank 5, an EP group, a line in the wrong order, no line at all
    assert axes_of_lines(ranks, (0, 1, 0, 1), [[1, 5], [5, 7], [5, 1], [1, 3]]) == \
        (1, 2, None, None)


def _mesh(ranks, coord, names=None):
    ranks = torch.as_tensor(ranks)
    return SimpleNamespace(mesh=ranks, ndim=ranks.ndim, mesh_dim_names=names,
                           get_coordinate=lambda: list(coord))


def test_unnamed_checkpoint_mesh_axes_are_named_by_ranks():
    ckpt = _mesh(torch.arange(4).reshape(1, 2, 2, 1), (0, 1, 1, 0))  # rank 3
    names, param_names = paired_axis_names("k", 3, ckpt, _mesh([1, 3], (1,), ("expert_dp",)))
    assert names == ("axis 0", "axis 1", "axis 2", "axis 3") and param_names == ("axis 1",)
    merged = merge_param_sharding("k", (Replicate(), Replicate(), Shard(0), Replicate()),
                                  names, (1, 2, 2, 1), (Shard(0),), param_names)
    assert merged[1].split_factor == 2 and merged[2] == Shard(0)
    # A group that is no line of the checkpoint mesh (dp x cp flattened) is refused.
    _, param_names = paired_axis_names("k", 3, ckpt, _mesh([0, 1, 2, 3], (3,), ("dp_cp",)))
    with pytest.raises(PlacementError, match=r"ranks \[0, 1, 2, 3\] \(no checkpoint axis\)"):
        merge_param_sharding("k", (Replicate(),) * 3 + (Shard(0),), names, (1, 2, 2, 1),
                             (Shard(0),), param_names)


def test_hc_head_is_replicated_before_the_models_rule():
    mesh = SimpleNamespace(shape=(1, 1, 1, 2), ndim=4, mesh_dim_names=None)
    rule = [Replicate(), Replicate(), Replicate(), Shard(0)]  # DeepSeek-V4: "head" -> Shard(0)
    for key, expected in (("model.hc_head.hc_fn", (Replicate(),) * 4),
                          ("model_pp1.mtp.0.hc_head.hc_base", (Replicate(),) * 4),
                          ("model.head.weight", tuple(rule))):
        pending = mlite.PendingShard(torch.zeros(1), torch.zeros(1), mesh, tuple(rule))
        assert mlite.checkpoint_placements(key, pending) == expected


# ------------------------------------------------------------------ detection by behaviour
def test_dev_and_pr61_still_need_the_fix(dev, probe):
    """dev builds on the FSDP2 parameter's mesh with its shape; PR 61 on the checkpoint mesh
    with the local shape times the mesh sizes ([8, 2], not [6, 2])."""
    assert probe() is None
    [call] = mlite.builder_calls(dev)
    assert call.mesh.mesh_dim_names == ("expert_dp",) and call.shape == (3, 2)
    path = Path(upstream_snapshots.import_root("megatron-lite", "pr61")) / "megatron" / \
        "lite" / "primitive" / "ckpt" / "dcp.py"
    spec = importlib.util.spec_from_file_location("mlite_pr61_dcp_unit", path)
    pr61 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pr61)
    [call] = mlite.builder_calls(pr61)
    assert call.mesh is mlite.PROBE_MESH and call.shape == (8, 2)
    assert dev.DTensor is pr61.DTensor  # put back after each probe


def test_an_upstream_that_builds_exactly_is_left_alone(dev, probe, monkeypatch, clean_install):
    def fixed(param, mesh, placements):  # what a fixed upstream would pass
        return dev.DTensor.from_local(dev._to_local_tensor(param), mesh, placements,
                                      shape=(6, 2), stride=(2, 1))

    monkeypatch.setattr(dev, "_dcp_tensor_from_param", fixed)
    assert clean_install.install([FEATURE]) == []
    assert dev._dcp_tensor_from_param is fixed
    reasons = clean_install.installed()
    assert set(reasons) == NAMES
    assert all(r.startswith("not applied: not needed: MLite's _dcp_tensor_from_param builds")
               for r in reasons.values())


def test_install_patches_and_uninstall_restores(dev, clean_install):
    originals = {a: getattr(dev, a) for a in ("_dcp_tensor_from_param",
                                              "_empty_dcp_tensor_like_param", "dcp")}
    assert set(clean_install.install([FEATURE])) == NAMES
    assert isinstance(dev.dcp, mlite.LayoutAwareDCP) and dev.dcp.FileSystemReader is \
        originals["dcp"].FileSystemReader
    clean_install.uninstall()
    assert all(getattr(dev, a) is o for a, o in originals.items())


def test_a_missing_symbol_refuses_everything(dev, monkeypatch, clean_install):
    monkeypatch.delattr(dev, "_is_dtensor_like")
    before = dev._dcp_tensor_from_param
    with pytest.raises(UnsupportedVersionError, match="_is_dtensor_like not found"):
        clean_install.install([FEATURE])
    assert dev._dcp_tensor_from_param is before and not isinstance(dev.dcp, mlite.LayoutAwareDCP)
    assert not any(name in clean_install.installed() and
                   not clean_install.installed()[name].startswith("not applied")
                   for name in NAMES)


def test_the_feature_waits_for_megatron_lite():
    assert SYSTEMS[FEATURE] == "megatron.lite"
