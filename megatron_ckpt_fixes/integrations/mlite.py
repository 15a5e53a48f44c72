"""MLite's DCP training checkpoints with the checkpoint's layout: the ``dtensor.mlite`` feature.

MLite (Megatron Lite, ``megatron.lite``: ``experimental/lite`` of Megatron-LM's ``dev``)
saves and loads training checkpoints in ``primitive/ckpt/dcp.py``: each parameter goes to
DCP as a DTensor on a checkpoint mesh (``_build_meshes``: dense ``[PP, DP, CP, TP]``, expert
``[PP, EDP, EP, ETP]``) with the placements the model's ``PLACEMENT_FN`` gives. Upstream
(``dev`` d48bd6be; MLite pull request 61 was never merged) gets this wrong twice:

- An FSDP2 parameter (a DTensor on the expert-data-parallel group) is rebuilt from its own
  mesh, placements and shape (``_dtensor_from_dtensor_like_param``), ignoring the
  checkpoint's: every expert-parallel rank writes its experts at the same offsets of one
  key, DCP keeps one rank's, and the others load them (2 ranks, EP 2: rank 0 loads
  experts 4..7), silently.
- A plain parameter goes through ``DTensor.from_local`` without ``shape=``/``stride=``:
  uneven shards get a wrong global shape. And DeepSeek-V4's rule ``"head" in name ->
  Shard(0)`` also catches ``hc_head.*``, which every tensor-parallel rank holds whole (a
  doubled global shape once TP > 1).

The fix is the package's DTensor core (:mod:`megatron_ckpt_fixes.dtensor.wrap`): the checkpoint layout wins where it
really shards (FSDP2's shard merged into the checkpoint axis that is its process group), the
parameter keeps its own mesh where the checkpoint layout is unsharded (an empty FSDP2 shard
is never materialized), and the global shape and stride are exact, agreed by every rank.

Wiring. Upstream builds the DCP tensors one parameter at a time and then calls
``dcp.save``/``dcp.load`` with the whole dict. An uneven shard's global shape needs every
rank's local shape, and a collective per parameter would pair wrongly across pipeline
stages, so the two per-parameter builders only record what they are given
(:class:`PendingShard`), and the module's ``dcp`` becomes :class:`LayoutAwareDCP`, whose
``save``/``load`` turn all recorded shards into checkpoint DTensors with one
:func:`~megatron_ckpt_fixes.dtensor.wrap.wrap_state_dict` (one agreed gather; a bad layout on any rank is the same
:class:`~megatron_ckpt_fixes.dtensor.errors.LayoutAgreementError` on every rank) and then call torch's DCP. Loading
writes into the recorded local tensors, which upstream then copies into the parameters.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from megatron_ckpt_fixes.core.patching import Patch, resolve
from megatron_ckpt_fixes.dtensor.placements import without_trivial_shards
from megatron_ckpt_fixes.dtensor.probe import FromLocal, Recorder, Stub, standing_in
from megatron_ckpt_fixes.dtensor.rules import PlacementTable, replicated
from megatron_ckpt_fixes.dtensor.wrap import CheckpointLayout, wrap_state_dict

logger = logging.getLogger(__name__)

DCP_MODULE = "megatron.lite.primitive.ckpt.dcp"

#: Keys that MLite's placement functions get wrong, above whatever they return: the mHC
#: head is replicated on every tensor-parallel rank (DeepSeek-V4's ``"head" in name`` rule
#: shards it over TP).
RULES = PlacementTable((replicated("*.hc_head.*"),))


@dataclass(frozen=True)
class PendingShard:
    """What upstream's per-parameter builder was given, until ``dcp.save``/``dcp.load``
    wraps all of them at once (see the module's docstring)."""

    param: torch.Tensor
    local: torch.Tensor  # read by a save, written by a load
    mesh: DeviceMesh  # the checkpoint mesh upstream chose
    placements: tuple[Placement, ...]  # what the model's PLACEMENT_FN returned


def checkpoint_placements(key: str, pending: PendingShard) -> tuple[Placement, ...]:
    """The placements the checkpoint uses for ``key``: :data:`RULES` first, then the model's;
    shards over mesh axes of size 1 count as unsharded."""
    rule = RULES.rule_for(key)
    placements = rule.placements(key, pending.mesh) if rule else pending.placements
    return without_trivial_shards(placements, pending.mesh.shape)


def wrap_pending(state_dict: MutableMapping[str, Any], group: dist.ProcessGroup | None) -> None:
    """Replace every :class:`PendingShard` of ``state_dict`` by its checkpoint DTensor
    (collective over ``group``: every rank calls it once per save or load)."""
    dcp_module = resolve(DCP_MODULE)
    pending = {k: v for k, v in state_dict.items() if isinstance(v, PendingShard)}
    values = {k: (dcp_module._dtensor_from_dtensor_like_param(p.param, p.local)
                  if dcp_module._is_dtensor_like(p.param) else p.local)
              for k, p in pending.items()}
    layouts = {k: CheckpointLayout(p.mesh, checkpoint_placements(k, p))
               for k, p in pending.items()}
    state_dict.update(wrap_state_dict(values, layouts, group))
    logger.debug("wrapped %d MLite parameters with their checkpoint layouts", len(pending))


class LayoutAwareDCP:
    """``torch.distributed.checkpoint`` as MLite's checkpoint module sees it: ``save`` and
    ``load`` wrap the pending shards first; everything else is torch's."""

    def __init__(self, dcp: Any) -> None:
        self._dcp = dcp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dcp, name)

    def save(self, state_dict: MutableMapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        wrap_pending(state_dict, kwargs.get("process_group"))
        return self._dcp.save(state_dict, *args, **kwargs)

    def load(self, state_dict: MutableMapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        wrap_pending(state_dict, kwargs.get("process_group"))
        return self._dcp.load(state_dict, *args, **kwargs)


def _pending(original: Any, *, empty: bool) -> Any:
    """A replacement of upstream's builder (``_dcp_tensor_from_param`` or, ``empty``,
    ``_empty_dcp_tensor_like_param``) that records instead of building."""
    dcp_module = resolve(DCP_MODULE)

    @functools.wraps(original)
    def record(param: torch.Tensor, mesh: DeviceMesh, placements: Any) -> PendingShard:
        local = dcp_module._to_local_tensor(param)
        local = torch.empty_like(local) if empty else local.detach()
        return PendingShard(param, local, mesh, tuple(placements))

    return record


# ----------------------------------------------------------------- detection by behaviour
#: The probe's checkpoint mesh: EP 2 x expert-dp 2 on 4 ranks, seen from rank 0.
PROBE_MESH = Stub({"mesh": torch.arange(4).reshape(1, 2, 2, 1), "shape": (1, 2, 2, 1),
                   "ndim": 4, "mesh_dim_names": None, "get_coordinate": lambda: [0, 0, 0, 0]})


def builder_calls(dcp_module: Any) -> list[FromLocal]:
    """What upstream's ``_dcp_tensor_from_param`` passes to ``DTensor.from_local`` for an
    FSDP2 expert shard (:mod:`megatron_ckpt_fixes.dtensor.probe`): rank 0 holds rows 0:2 of a [3, 2] expert that FSDP2
    shards unevenly over expert-dp ranks [0, 2]; the checkpoint key holds both EP ranks'
    experts, [6, 2], sharded over the EP axis of :data:`PROBE_MESH`."""
    local = torch.zeros(2, 2)
    param_mesh = Stub({"mesh": torch.tensor([0, 2]), "shape": (2,), "ndim": 1,
                       "mesh_dim_names": ("expert_dp",), "get_coordinate": lambda: [0]})
    param = Stub({"_local_tensor": local, "to_local": lambda: local, "device_mesh": param_mesh,
                  "placements": (Shard(0),), "shape": torch.Size([3, 2]),
                  "stride": lambda: (2, 1)})
    recorder = Recorder()
    with standing_in(dcp_module, DTensor=recorder):
        dcp_module._dcp_tensor_from_param(param, PROBE_MESH,
                                          [Replicate(), Replicate(), Shard(0), Replicate()])
    return recorder.calls


@functools.lru_cache(maxsize=None)
def upstream_uses_checkpoint_layout() -> str | None:
    """Why upstream needs no fix, or None: it does if :func:`builder_calls` shows the
    checkpoint mesh and the exact global shape [6, 2]. ``dev`` builds on the parameter's
    mesh; MLite PR 61 multiplies the local shape by the mesh sizes ([8, 2]). An error counts
    as needing the fix: the fix replaces the builder, so applying it over a fixed upstream
    is harmless."""
    try:
        calls = builder_calls(resolve(DCP_MODULE))
    except Exception as exc:  # noqa: BLE001 - see the docstring
        logger.debug("MLite probe: upstream's builder raised %r; the fix is applied", exc)
        return None
    if [(c.mesh is PROBE_MESH, c.shape, c.stride) for c in calls] == [(True, (6, 2), (2, 1))]:
        return ("MLite's _dcp_tensor_from_param builds an FSDP2 expert shard's checkpoint "
                "tensor on the checkpoint mesh with the exact global shape")
    return None


_READS = tuple(f"{DCP_MODULE}:{name}" for name in (
    "_dtensor_from_dtensor_like_param", "_is_dtensor_like", "_to_local_tensor", "DTensor",
    "save_training_checkpoint", "load_training_checkpoint"))


def _patch(attr: str, build: Any, why: str) -> Patch:
    return Patch(name=f"dtensor.mlite.{attr.strip('_')}", target=DCP_MODULE, attr=attr,
                 build=build, why=why, reads=_READS,
                 not_needed=upstream_uses_checkpoint_layout)


PATCHES: tuple[Patch, ...] = (
    _patch("_dcp_tensor_from_param", functools.partial(_pending, empty=False),
           "a parameter's DCP tensor is built when the whole state dict is saved: the "
           "checkpoint mesh and placements win where they shard (upstream: the FSDP2 "
           "parameter's own mesh, so EP ranks overwrite each other's experts)"),
    _patch("_empty_dcp_tensor_like_param", functools.partial(_pending, empty=True),
           "the load side of the same: each rank reads its own experts and shards"),
    _patch("dcp", LayoutAwareDCP,
           "save/load wrap every parameter in one agreed step: exact global shape and "
           "stride (uneven and empty shards), unsharded layouts keep the parameter's mesh, "
           "hc_head replicated before the model's head rule"),
)
