"""NeMo Automodel's MoE state-dict adapters with exact DTensor layouts: the
``dtensor.nemo_automodel`` feature.

NeMo Automodel's ``Checkpointer`` converts the model's native state dict to the Hugging Face
layout with the model's ``state_dict_adapter`` (``to_hf``) before DCP saves or loads it, and
back (``from_hf``) after a load. The grouped expert weights are DTensors (experts over
``ep``; FSDP2 over ``ep_shard``, or over ``dp_shard_cp`` when EP is off), and the adapters
rebuild them after splitting, transposing or gathering. Release 0.7.0 gets that wrong in
five places:

- ``Gemma4MoEStateDictAdapter`` with EP off (``ep_size=1``: no MoE mesh) "gathers" an FSDP2
  expert tensor by taking its local shard, as a plain tensor: the save writes rank 0's
  experts as the whole tensor ([E/2, ...] on 2 ranks), the others are lost.
- Step3p5's transpose fix (PR 1691) swaps ``Shard(1)``/``Shard(2)`` but not
  ``_StridedShard``, and rebuilds with ``DTensor.from_local(local, mesh, swapped)``: no
  ``shape=``, so uneven or empty shards (3 experts on 2 or 4 ranks with EP off) get a wrong
  global shape on every rank, and the save fails.
- ``moe/state_dict_utils.split_experts_weights_dtensor_aware`` (every adapter on the shared
  MoE mixin, Gemma4's EP gather, DeepSeek-V4): per-expert DTensors without ``shape=``, and
  the local experts counted by a balanced split (4 experts on 3 ranks: 2, 1, 1) where the
  DTensor holds torch's chunks (2, 2, 0): the save raises on the ranks where they differ.
- The shared MoE mixin's ``_from_hf_w_merged_experts`` (Qwen3-MoE, DeepSeek-V3, GLM-4 MoE
  and every other adapter on ``MoESplitExpertsStateDictMixin``) merges the loaded experts
  and wraps them with ``create_dtensor_from_local``: no ``shape=``, so a hidden size that
  ``ep_shard`` splits unevenly (5 over 2) loads as [4, 6, 12] on ranks 0-1 and [4, 4, 12] on
  ranks 2-3 for [4, 5, 12], and the load into the model fails with a size mismatch.

The fixes are the package's DTensor core, wired in: expert ranges by torch's own rule
(:func:`megatron_ckpt_fixes.dtensor.placements.local_shape_and_offset`), placements moved by
:func:`megatron_ckpt_fixes.dtensor.transpose.transpose_placements` (``_StridedShard`` included), and every rebuilt
DTensor from :func:`megatron_ckpt_fixes.dtensor.wrap.from_local_checked` with a global shape derived from the tensor it
came from (:func:`megatron_ckpt_fixes.dtensor.placements.shape_from_reference`), checked on each rank. Gemma4 with EP
off keeps its FSDP2 DTensors (each rank writes its own experts), and its
``router.per_expert_scale`` is sharded like the experts so ``from_hf``'s scaling stays on
each rank's shard; the mixin's merged experts take their global shape from the per-expert
DTensors DCP loaded them into (:func:`merged_expert_shape`). No collective is added: every
shape comes from a DTensor that has it.

Whether an upstream function already does the right thing is probed with stand-ins
(:mod:`megatron_ckpt_fixes.dtensor.probe`); a patch whose probe passes is not applied.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from megatron_ckpt_fixes.core.patching import Patch, resolve
from megatron_ckpt_fixes.core.importers import bound_imports, name_aliases, renamed_imports
from megatron_ckpt_fixes.dtensor.errors import PlacementError
from megatron_ckpt_fixes.dtensor.placements import (is_shard_like, local_shape_and_offset,
    shape_from_reference, with_dim)
from megatron_ckpt_fixes.dtensor.probe import Recorder, Stub, standing_in
from megatron_ckpt_fixes.dtensor.transpose import transpose_placements
from megatron_ckpt_fixes.dtensor.wrap import from_local_checked

logger = logging.getLogger(__name__)

PACKAGE = "nemo_automodel"
UTILS = "nemo_automodel.components.moe.state_dict_utils"
MIXIN = "nemo_automodel.components.moe.state_dict_mixin"
STEP3P5 = "nemo_automodel.components.models.step3p5.state_dict_adapter"
GEMMA4 = "nemo_automodel.components.models.gemma4_moe.state_dict_adapter"

_SCALE = re.compile(r"(?P<layer>.*layers\.\d+)\.router\.per_expert_scale$")
#: An HF per-expert weight the mixin merges, and the native key it merges into (the mixin's
#: naming: ``<stem>.<expert>.up_proj.weight`` -> ``<stem>.gate_and_up_projs``).
_HF_EXPERT = re.compile(r"(?P<stem>.+)\.\d+\.(?P<proj>up_proj|down_proj)\.weight$")
_MERGED = {"up_proj": "gate_and_up_projs", "down_proj": "down_projs"}


# ----------------------------------------------------------------- the shared expert split
def expert_slice(original: Any) -> Any:
    """``get_expert_slice_for_rank`` by torch's chunk rule: the local experts of a DTensor
    are where its mesh and placements put them (upstream: a balanced split of its own)."""
    utils = resolve(UTILS)

    @functools.wraps(original)
    def get_expert_slice_for_rank(experts_tensor: torch.Tensor, n_experts: int):
        if not isinstance(experts_tensor, DTensor) or experts_tensor.shape[0] != n_experts \
                or utils._get_expert_mesh_dim_index(experts_tensor) is None:
            return original(experts_tensor, n_experts)
        mesh = experts_tensor.device_mesh
        shape, offset = local_shape_and_offset(experts_tensor.shape, mesh.shape,
                                               tuple(mesh.get_coordinate()),
                                               experts_tensor.placements)
        return experts_tensor.to_local(), offset[0], offset[0] + shape[0]

    return get_expert_slice_for_rank


def _without_expert_dim(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Placements of one expert of a grouped tensor: shards move down one dim (upstream's
    rule, ``_StridedShard`` included); a shard of the expert dim itself is gone."""
    return tuple(with_dim(p, p.dim - 1) if is_shard_like(p) and p.dim > 0
                 else Replicate() if is_shard_like(p) else p for p in placements)


def exact_split(original: Any) -> Any:
    """``split_experts_weights_dtensor_aware`` whose per-expert DTensors have the grouped
    tensor's exact inner shape (upstream: ``from_local`` without ``shape=``)."""
    utils = resolve(UTILS)

    @functools.wraps(original)
    def split_experts_weights_dtensor_aware(weight: torch.Tensor, n_experts: int):
        parts, expert_ids = original(weight, n_experts)
        if not isinstance(weight, DTensor):
            return parts, expert_ids
        axis = utils._get_expert_mesh_dim_index(weight)
        kept = tuple(p for a, p in enumerate(weight.placements) if a != axis)
        exact = []
        for expert, part in zip(expert_ids, parts):
            if isinstance(part, DTensor):
                part = from_local_checked(f"expert {expert}", part.to_local(), part.device_mesh,
                                          _without_expert_dim(kept), weight.shape[1:])
            exact.append(part)
        return exact, expert_ids

    return split_experts_weights_dtensor_aware


# ----------------------------------------------------------------- the shared mixin's merge
def merged_expert_shape(key: str, local_shape: Sequence[int], placements: Sequence[Placement],
                        n_experts: int, hf_shape: Sequence[int]) -> tuple[int, ...]:
    """The global shape of a grouped expert tensor [E, in, ...] that the mixin merged from
    per-expert HF weights [out, in] (transposed, stacked, gate and up joined on the last
    dim): a sharded dim 0 has all ``n_experts``, a sharded dim 1 the HF weight's global
    ``in``; an unsharded dim is whole on every rank. The mixin shards nothing else."""
    shape = list(local_shape)
    for axis, p in enumerate(placements):
        if not is_shard_like(p):
            continue
        if p.dim > 1:
            raise PlacementError(key, None, f"mesh axis {axis} shards dim {p.dim} of a merged "
                                            "expert tensor; only dims 0 and 1 are known")
        shape[p.dim] = n_experts if p.dim == 0 else hf_shape[1]
    return tuple(shape)


def hf_expert_references(hf_state_dict: Mapping[str, Any]) -> dict[str, DTensor]:
    """Native merged key -> one of the HF per-expert DTensors merged into it (read before
    the mixin pops them: they carry the global shapes its merge drops)."""
    found: dict[str, DTensor] = {}
    for key, value in hf_state_dict.items():
        match = _HF_EXPERT.fullmatch(key)
        if match and isinstance(value, DTensor):
            found.setdefault(f"{match['stem']}.{_MERGED[match['proj']]}", value)
    return found


def exact_merged_experts(original: Any) -> Any:
    """The mixin's ``_from_hf_w_merged_experts`` whose merged expert DTensors have their
    exact global shape (upstream: ``create_dtensor_from_local``, which multiplies the local
    size and is wrong where ``ep_shard`` splits a dim unevenly), checked on each rank."""

    @functools.wraps(original)
    def _from_hf_w_merged_experts(self, hf_state_dict, *args, **kwargs):
        references = hf_expert_references(hf_state_dict)
        out = original(self, hf_state_dict, *args, **kwargs)
        for key, reference in references.items():
            value = out.get(key)
            if isinstance(value, DTensor):
                local = value.to_local()
                shape = merged_expert_shape(key, local.shape, value.placements,
                                            self.moe_config.n_routed_experts, reference.shape)
                out[key] = from_local_checked(key, local, value.device_mesh, value.placements,
                                              shape)
        return out

    return _from_hf_w_merged_experts


# ----------------------------------------------------------------- Step3p5
def swap_1_2(original: Any) -> Any:
    """Step3p5's placement swap after ``transpose(1, 2)``, for every shard-like placement."""

    @functools.wraps(original)
    def _swap_shard_placements_1_2(placements: tuple) -> tuple:
        return transpose_placements(placements, 3, 1, 2, "step3p5 expert weight")

    return _swap_shard_placements_1_2


def exact_like(key: str, value: Any, reference: torch.Tensor) -> Any:
    """``value`` (a DTensor an adapter built from ``reference``'s local tensor by local steps)
    rebuilt with its exact global shape; anything else unchanged."""
    if not isinstance(value, DTensor) or value is reference:
        return value
    local = value.to_local()
    shape = shape_from_reference(key, local.shape, value.placements, reference.shape,
                                 reference.placements)
    return from_local_checked(key, local, value.device_mesh, value.placements, shape)


def exact_from_reference(original: Any) -> Any:
    """Step3p5's ``_create_dtensor_from_local_or_reference`` with the exact global shape when
    it rebuilds from a reference DTensor (upstream: ``from_local`` without ``shape=``)."""

    @functools.wraps(original)
    def _create_dtensor_from_local_or_reference(local_tensor, reference_dtensor,
                                                device_mesh=None, rank=None,
                                                placements_override=None):
        if not isinstance(reference_dtensor, DTensor):
            return original(local_tensor, reference_dtensor, device_mesh, rank,
                            placements_override)
        placements = placements_override if placements_override is not None else \
            reference_dtensor.placements
        key = "step3p5 expert weight"
        shape = shape_from_reference(key, local_tensor.shape, placements,
                                     reference_dtensor.shape, reference_dtensor.placements)
        return from_local_checked(key, local_tensor, reference_dtensor.device_mesh, placements,
                                  shape)

    return _create_dtensor_from_local_or_reference


def exact_native_to_hf(original: Any) -> Any:
    """Step3p5's ``_convert_native_to_hf`` whose transposed outputs have exact shapes."""

    @functools.wraps(original)
    def _convert_native_to_hf(self, fqn: str, tensor: torch.Tensor):
        result = original(self, fqn, tensor)
        if result is None or not isinstance(tensor, DTensor):
            return result
        return [(key, exact_like(key, value, tensor)) for key, value in result]

    return _convert_native_to_hf


# ----------------------------------------------------------------- Gemma4
def keep_fsdp_shards(original: Any) -> Any:
    """Gemma4's ``_gather_expert_tensor`` with EP off: the FSDP2 DTensor itself, so every
    rank writes its own experts (upstream: the local shard as a plain, "whole" tensor)."""

    @functools.wraps(original)
    def _gather_expert_tensor(self, tensor: torch.Tensor, device_mesh: Any, n_experts: int):
        if device_mesh is None and isinstance(tensor, DTensor):
            return tensor
        return original(self, tensor, device_mesh, n_experts)

    return _gather_expert_tensor


def sharded_scale(key: str, scale: torch.Tensor, experts: DTensor) -> DTensor:
    """``router.per_expert_scale`` ([E], whole on every rank) as a DTensor sharded like the
    experts (dim 0) of ``experts``: each rank keeps its own experts' scales."""
    mesh = experts.device_mesh
    placements = tuple(with_dim(p, 0) if is_shard_like(p) and p.dim == 0 else Replicate()
                       for p in experts.placements)
    shape, offset = local_shape_and_offset(scale.shape, mesh.shape,
                                           tuple(mesh.get_coordinate()), placements)
    local = scale.narrow(0, offset[0], shape[0])
    return from_local_checked(key, local, mesh, placements, scale.shape)


def scales_like_experts(original: Any) -> Any:
    """Gemma4's ``to_hf`` whose per-expert scales are sharded like their down projection
    when that stays a DTensor (EP off), so ``from_hf`` scales each rank's own experts."""

    @functools.wraps(original)
    def to_hf(self, state_dict, exclude_key_regex=None, quantization=False, **kwargs):
        out = original(self, state_dict, exclude_key_regex=exclude_key_regex,
                       quantization=quantization, **kwargs)
        for key, value in list(out.items()):
            match = _SCALE.fullmatch(key)
            down = out.get(f"{match['layer']}.experts.down_proj") if match else None
            if isinstance(down, DTensor) and not isinstance(value, DTensor):
                out[key] = sharded_scale(key, value, down)
        return out

    return to_hf


# ----------------------------------------------------------------- detection by behaviour
def _mesh(names: tuple[str, ...], sizes: tuple[int, ...], local_rank: int = 0) -> Stub:
    """A stand-in mesh whose sub-meshes report ``sizes`` and ``local_rank``."""
    sub = {name: Stub({"size": lambda s=s: s, "get_local_rank": lambda: local_rank,
                       "get_rank": lambda: local_rank, "mesh_dim_names": (name,)})
           for name, s in zip(names, sizes)}
    return Stub({"mesh_dim_names": names, "shape": sizes, "ndim": len(sizes),
                 "__getitem__": lambda dims: sub[dims[0] if isinstance(dims, tuple) else dims]})


def _dtensor(local: torch.Tensor, mesh: Stub, placements: tuple, shape: tuple) -> Stub:
    return Stub({"to_local": lambda: local, "device_mesh": mesh, "placements": placements,
                 "shape": torch.Size(shape)})


def _is_stub(tensor: Any) -> bool:
    return isinstance(tensor, Stub)


def _probe(name: str, run: Any) -> str | None:
    """``run()`` -> why upstream needs no fix, or None; an error counts as None (the fix
    replaces or wraps what upstream does, so applying it over a fixed upstream is safe)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - see the docstring
        logger.debug("NeMo Automodel probe %s: upstream raised %r; the fix is applied",
                     name, exc)
        return None


@functools.lru_cache(maxsize=None)
def upstream_slices_by_chunks() -> str | None:
    """4 experts over ``ep`` 3, this rank 1: torch's chunks put experts 2:4 here (2, 2, 0);
    0.7.0 says 2:3 (2, 1, 1)."""
    def run() -> str | None:
        utils = resolve(UTILS)
        tensor = _dtensor(torch.zeros(2, 1), _mesh(("ep",), (3,), local_rank=1), (Shard(0),),
                          (4, 1))
        with standing_in(utils, is_dtensor=_is_stub):
            _, start, end = utils.get_expert_slice_for_rank(tensor, 4)
        return "get_expert_slice_for_rank follows torch's chunks" if (start, end) == (2, 4) \
            else None

    return _probe("expert_slice", run)


@functools.lru_cache(maxsize=None)
def upstream_splits_exactly() -> str | None:
    """Experts [4, 5, 6] over (ep_shard 2, ep 2) with ``Shard(1)`` on ep_shard: this rank's
    3 of 5 rows; each per-expert DTensor must say [5, 6]."""
    def run() -> str | None:
        utils = resolve(UTILS)
        mesh = _mesh(("ep_shard", "ep"), (2, 2))
        local = torch.zeros(2, 3, 6)
        tensor = _dtensor(local, mesh, (Shard(1), Shard(0)), (4, 5, 6))
        with standing_in(utils, is_dtensor=_is_stub, DTensor=Recorder(),
                         get_submesh=lambda m, dims: m[dims],
                         get_expert_slice_for_rank=lambda t, n: (local, 0, 2)):
            parts, _ = utils.split_experts_weights_dtensor_aware(tensor, 4)
        return "split_experts_weights_dtensor_aware passes the exact shape" \
            if [tuple(p.shape) for p in parts] == [(5, 6)] * 2 else None

    return _probe("split_experts", run)


@functools.lru_cache(maxsize=None)
def upstream_mixin_merges_exactly() -> str | None:
    """Two gated experts loaded as HF DTensors, gate/up [4, 5] and down [5, 4], sharded on
    dim 1 over ``ep_shard`` 2 (this rank 3 of 5 and 2 of 4): the mixin's merged
    gate_and_up_projs must say [2, 5, 8] and down_projs [2, 4, 5]."""
    def run() -> str | None:
        mixin, utils = resolve(MIXIN), resolve(UTILS)

        class Adapter(mixin.MoESplitExpertsStateDictMixin):
            moe_config = Stub({"n_routed_experts": 2, "expert_bias": False, "dim": 5,
                               "moe_inter_dim": 4, "expert_activation": "swiglu"})
            dtype = torch.float32

        shard = _mesh(("ep_shard",), (2,))
        hf = {f"model.layers.0.mlp.experts.{e}.{proj}.weight":
              _dtensor(torch.zeros(*local), shard, (Shard(1),), whole)
              for e in range(2) for proj, local, whole in (
                  ("gate_proj", (4, 3), (4, 5)), ("up_proj", (4, 3), (4, 5)),
                  ("down_proj", (5, 2), (5, 4)))}
        submesh = lambda m, dims: m[dims]  # noqa: E731 - the stand-ins' own indexing
        with standing_in(utils, DTensor=Recorder(), get_submesh=submesh), \
                standing_in(mixin, is_dtensor=_is_stub, get_submesh=submesh):
            out = Adapter()._from_hf_w_merged_experts(hf, _mesh(("ep_shard", "ep"), (2, 1)))
        built = [tuple(out[f"model.layers.0.mlp.experts.{k}"].shape)
                 for k in ("gate_and_up_projs", "down_projs")]
        return "the MoE mixin's merge passes exact shapes" \
            if built == [(2, 5, 8), (2, 4, 5)] else None

    return _probe("mixin_merge", run)


@functools.lru_cache(maxsize=None)
def upstream_swaps_strided() -> str | None:
    def run() -> str | None:
        swapped = resolve(STEP3P5)._swap_shard_placements_1_2(
            (_StridedShard(1, split_factor=2), Shard(2)))
        return "Step3p5 swaps _StridedShard too" \
            if tuple(swapped) == (_StridedShard(2, split_factor=2), Shard(1)) else None

    return _probe("step3p5_swap", run)


def _step3p5_probe(call: Any, expected: tuple[int, ...], what: str) -> str | None:
    """``call(module)`` returns what Step3p5 built, with its ``DTensor`` (imported inside its
    functions from ``torch.distributed._tensor``) and ``is_dtensor`` standing in; every
    DTensor it built must have the ``expected`` global shape."""
    def run() -> str | None:
        import torch.distributed._tensor as dtensor_module

        module = resolve(STEP3P5)
        with standing_in(dtensor_module, DTensor=Recorder()), \
                standing_in(module, is_dtensor=_is_stub):
            built = call(module)
        return what if built and all(tuple(b.shape) == expected for b in built) else None

    return _probe(what, run)


@functools.lru_cache(maxsize=None)
def upstream_step3p5_to_hf_exact() -> str | None:
    """Native gate_and_up [4, 5, 6] (inner 3), ``Shard(1)`` over 2 ranks, this rank 3 of 5
    rows: the HF gate and up projections are [4, 3, 5] each."""
    def call(module: Any) -> list:
        adapter = module.Step3p5StateDictAdapter(None, Stub({"moe_inter_dim": 3}), None)
        tensor = _dtensor(torch.zeros(4, 3, 6), _mesh(("dp",), (2,)), (Shard(1),), (4, 5, 6))
        return [v for _, v in adapter._convert_native_to_hf(
            "model.layers.0.moe.experts.gate_and_up_projs", tensor)]

    return _step3p5_probe(call, (4, 3, 5), "Step3p5's to_hf passes exact shapes")


@functools.lru_cache(maxsize=None)
def upstream_step3p5_from_reference_exact() -> str | None:
    """An HF gate [4, 3, 5] with ``Shard(2)`` (this rank 3 of 5) merged to native
    [4, 5, 6]: the DTensor must say [4, 5, 6]."""
    def call(module: Any) -> list:
        reference = _dtensor(torch.zeros(4, 3, 3), _mesh(("dp",), (2,)), (Shard(2),),
                             (4, 3, 5))
        return [module._create_dtensor_from_local_or_reference(
            torch.zeros(4, 3, 6), reference, placements_override=(Shard(1),))]

    return _step3p5_probe(call, (4, 5, 6), "Step3p5's from_hf passes exact shapes")


@functools.lru_cache(maxsize=None)
def upstream_gemma4_keeps_shards() -> str | None:
    """With EP off, upstream must not turn an FSDP2 expert DTensor into its local shard."""
    def run() -> str | None:
        utils = resolve(UTILS)
        tensor = _dtensor(torch.zeros(2, 1, 1), _mesh(("dp_shard_cp",), (2,)), (Shard(0),),
                          (4, 1, 1))
        with standing_in(utils, is_dtensor=_is_stub):
            kept = resolve(GEMMA4).Gemma4MoEStateDictAdapter._gather_expert_tensor(
                None, tensor, None, 4)
        return "Gemma4 keeps FSDP2 expert DTensors with EP off" if kept is tensor else None

    return _probe("gemma4", run)


# ----------------------------------------------------------------- the patches
#: Which NeMo Automodel modules bind the shared helpers by name (read from its source).
_SHARED = ("get_expert_slice_for_rank", "split_experts_weights_dtensor_aware")
# Where NeMo Automodel is not installed the feature is never applied (install() says so), but
# its patches are still declared: this module must import without the package.
_IMPORTS = (bound_imports(PACKAGE, UTILS, _SHARED) if importlib.util.find_spec(PACKAGE)
            else {name: () for name in _SHARED})


def _shared_patch(attr: str, build: Any, not_needed: Any, why: str) -> Patch:
    def imports() -> list[str]:
        return renamed_imports(_IMPORTS[attr], UTILS, attr)

    return Patch(name=f"dtensor.nemo_automodel.{attr}", target=UTILS, attr=attr, build=build,
                 why=why, reads=(f"{UTILS}:_get_expert_mesh_dim_index",), probes=(imports,),
                 aliases=name_aliases(_IMPORTS[attr], attr), not_needed=not_needed)


PATCHES: tuple[Patch, ...] = (
    _shared_patch("get_expert_slice_for_rank", expert_slice, upstream_slices_by_chunks,
                  "a DTensor's local experts are where torch's chunks put them (upstream's "
                  "balanced split disagrees for 4 experts on 3 ranks, 6 on 4, ...)"),
    _shared_patch("split_experts_weights_dtensor_aware", exact_split, upstream_splits_exactly,
                  "per-expert DTensors with the exact global shape (every MoE-mixin adapter, "
                  "Gemma4's EP gather)"),
    Patch(name="dtensor.nemo_automodel.mixin_merge",
          target=f"{MIXIN}:MoESplitExpertsStateDictMixin", attr="_from_hf_w_merged_experts",
          build=exact_merged_experts, not_needed=upstream_mixin_merges_exactly,
          why="the MoE mixin's merged expert DTensors get the exact global shape (upstream: "
              "create_dtensor_from_local without shape=, wrong where ep_shard splits unevenly)"),
    Patch(name="dtensor.nemo_automodel.step3p5_swap", target=STEP3P5,
          attr="_swap_shard_placements_1_2", build=swap_1_2, not_needed=upstream_swaps_strided,
          why="placements follow transpose(1, 2), _StridedShard included (PR 1691 swaps Shard "
              "only)"),
    Patch(name="dtensor.nemo_automodel.step3p5_from_reference", target=STEP3P5,
          attr="_create_dtensor_from_local_or_reference", build=exact_from_reference,
          not_needed=upstream_step3p5_from_reference_exact,
          why="from_hf rebuilds expert DTensors with the exact global shape (uneven and empty "
              "shards)"),
    Patch(name="dtensor.nemo_automodel.step3p5_to_hf", target=f"{STEP3P5}:Step3p5StateDictAdapter",
          attr="_convert_native_to_hf", build=exact_native_to_hf,
          not_needed=upstream_step3p5_to_hf_exact,
          why="to_hf's transposed expert DTensors get the exact global shape (upstream: "
              "DTensor.from_local(local, mesh, swapped), wrong for uneven shards)"),
    Patch(name="dtensor.nemo_automodel.gemma4_gather", target=f"{GEMMA4}:Gemma4MoEStateDictAdapter",
          attr="_gather_expert_tensor", build=keep_fsdp_shards,
          not_needed=upstream_gemma4_keeps_shards,
          why="with EP off every rank saves its own FSDP2 experts (upstream: rank 0's local "
              "shard as the whole tensor; the others are lost)"),
    Patch(name="dtensor.nemo_automodel.gemma4_scales", target=f"{GEMMA4}:Gemma4MoEStateDictAdapter",
          attr="to_hf", build=scales_like_experts, not_needed=upstream_gemma4_keeps_shards,
          why="per-expert scales sharded like the experts they scale, so a load with EP off "
              "stays on each rank's shard (applied with gemma4_gather)"),
)
