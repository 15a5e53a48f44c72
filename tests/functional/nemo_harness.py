"""NeMo Automodel's own checkpointing on CPU/gloo ranks: what the ``dtensor.nemo_automodel``
tests run.

Everything that saves and loads is NeMo Automodel 0.7.0's, unchanged
(``scripts/install_nemo_automodel.sh``): ``_create_fsdp2_device_mesh`` builds the device and
MoE meshes (CPU under gloo, NeMo's own choice), the experts are sharded as its MoE
parallelizer does (``ExpertParallel`` over ``ep``, then FSDP2 over ``ep_shard`` with
``_moe_shard_placement``; with EP off, FSDP2 over ``dp_shard_cp`` as the decoder block is),
and ``Checkpointer.save_model`` / ``load_model`` run the model's real state-dict adapter
(``to_hf`` before DCP, ``from_hf`` after) with DCP. The model is a module holding the native
expert weights under the model's own key names (:data:`MODELS`) with the real adapter as
its ``state_dict_adapter``: NeMo's model classes build attention and kernels a CPU run does
not need, and the checkpoint path reads only the state dict and the adapter.

Every expert weight has known values; after a load every rank compares its shard with the
block its own mesh and placements say it holds (max delta 0.0), and the saved checkpoint's
global shapes are read from its metadata.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

#: Experts, hidden size, expert inner size. FSDP2 shards dim 0 unevenly where it may (3
#: experts on 2 ranks: 2 + 1; 4 on 3 ranks: 2 + 2 + 0, one rank empty); over ``ep_shard`` it
#: shards dim 1, which must divide evenly (FSDP2 refuses otherwise).
E, H, I = 4, 4, 2


@dataclass(frozen=True)
class Model:
    """Where a model keeps its native expert weights, and its adapter class."""

    adapter: str  # module:class
    prefix: str  # native key prefix of layer 0's experts

    def adapter_class(self):
        import importlib

        module, _, cls = self.adapter.partition(":")
        return getattr(importlib.import_module(module), cls)


MODELS = {
    "gemma4": Model("nemo_automodel.components.models.gemma4_moe.state_dict_adapter:"
                    "Gemma4MoEStateDictAdapter", "model.language_model.layers.0.moe.experts"),
    "step3p5": Model("nemo_automodel.components.models.step3p5.state_dict_adapter:"
                     "Step3p5StateDictAdapter", "model.layers.0.moe.experts"),
    "qwen3_moe": Model("nemo_automodel.components.models.qwen3_moe.state_dict_adapter:"
                       "Qwen3MoeStateDictAdapter", "model.layers.0.mlp.experts"),
}


def truth(n_experts: int = E, hidden: int = H, inter: int = I) -> dict[str, torch.Tensor]:
    """The native expert weights (gate_and_up [E, H, 2I], down [E, I, H])."""
    gate_up = torch.arange(n_experts * hidden * 2 * inter, dtype=torch.float32).reshape(
        n_experts, hidden, 2 * inter)
    down = torch.arange(n_experts * inter * hidden, dtype=torch.float32).reshape(
        n_experts, inter, hidden) + 1000
    return {"gate_and_up_projs": gate_up, "down_projs": down}


def moe_config(n_experts: int = E, inter: int = I, hidden: int = H):
    from nemo_automodel.components.moe.config import MoEConfig

    return MoEConfig(n_routed_experts=n_experts, n_shared_experts=0, n_activated_experts=2,
                     n_expert_groups=0, n_limited_groups=0, train_gate=True,
                     gate_bias_update_factor=0.0, aux_loss_coeff=0.0, score_func="softmax",
                     route_scale=1.0, dim=hidden, inter_dim=inter, moe_inter_dim=inter,
                     norm_topk_prob=False, dtype=torch.float32)


def _module_at(root: torch.nn.Module, dotted: str) -> torch.nn.Module:
    for part in dotted.split("."):
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    return root


@functools.lru_cache(maxsize=None)
def meshes(ep: int):
    """NeMo's device mesh and MoE mesh for ``ep`` on this world (built once per spawn: each
    build creates a dozen process groups)."""
    from nemo_automodel.components.distributed.mesh import ParallelismSizes
    from nemo_automodel.components.distributed.mesh_utils import _create_fsdp2_device_mesh

    return _create_fsdp2_device_mesh(ParallelismSizes(ep_size=ep),
                                     world_size=dist.get_world_size())


def build(name: str, ep: int, n_experts: int = E, hidden: int = H, inter: int = I):
    """(model, experts module, moe_mesh): the native weights sharded as NeMo shards them.

    A ``hidden`` that ``ep_shard`` splits unevenly (FSDP2 refuses to) gets the same
    placements from ``distribute_tensor``, as parameters set as DTensors have them (issue
    31's EP 2 x ep_shard 2 with hidden 5)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.moe.parallelizer import ExpertParallel, _moe_shard_placement

    spec = MODELS[name]
    mesh, moe_mesh = meshes(ep)
    model = torch.nn.Module()
    experts = _module_at(model, spec.prefix)
    uneven = ep > 1 and hidden % moe_mesh["ep_shard"].size() != 0
    for key, value in truth(n_experts, hidden, inter).items():
        if uneven:
            value = distribute_tensor(value, moe_mesh[("ep_shard", "ep")],
                                      [_moe_shard_placement(value), Shard(0)])
        experts.register_parameter(key, torch.nn.Parameter(value.clone()))
    if ep == 1:
        fully_shard(experts, mesh=mesh["dp_shard_cp"])
    elif not uneven:
        parallelize_module(experts, moe_mesh["ep"], ExpertParallel())
        if moe_mesh["ep_shard"].size() > 1:
            fully_shard(experts, mesh=moe_mesh["ep_shard"],
                        shard_placement_fn=_moe_shard_placement)
    model.state_dict_adapter = spec.adapter_class()(None, moe_config(n_experts, inter, hidden),
                                                     BackendConfig(), dtype=torch.float32)
    return model, experts, moe_mesh


def checkpointer(moe_mesh, path: str):
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    config = CheckpointingConfig(model_save_format="torch_save", save_consolidated=False,
                                 checkpoint_dir=path)
    return Checkpointer(config, dp_rank=0, tp_rank=0, pp_rank=0, moe_mesh=moe_mesh)


def block(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that ``param`` holds on this rank, by its own mesh and
    placements (torch's rule, not the code under test)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _report(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:600]


def saved_shapes(path: str) -> dict[str, tuple[int, ...]]:
    metadata = dcp.FileSystemReader(os.path.join(path, "model")).read_metadata()
    return {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
            if hasattr(v, "size") and ("proj" in k)}


def run(name: str, ep: int, path: str, *, save: bool = True, n_experts: int = E,
        hidden: int = H, inter: int = I) -> dict:
    """Build at ``ep``, save (unless ``save`` is false: the checkpoint is another layout's),
    overwrite, load, compare. Errors are reported, not raised."""
    full = truth(n_experts, hidden, inter)
    model, experts, moe_mesh = build(name, ep, n_experts, hidden, inter)
    ckpt = checkpointer(moe_mesh, path)
    out: dict = {"placements": {k: str(p.placements) for k, p in experts.named_parameters()}}
    try:
        if save:
            ckpt.save_model(model, path)
            out["saved"] = saved_shapes(path)
        with torch.no_grad():
            for param in experts.parameters():
                param.to_local().fill_(-1.0)
        ckpt.load_model(model, os.path.join(path, "model"))
    except BaseException as exc:  # CheckpointException derives from BaseException
        out["error"] = _report(exc)
        return out
    out["wrong"] = {k: float((p.to_local() - block(p, full[k])).abs().max())
                    if p.to_local().numel() else 0.0
                    for k, p in experts.named_parameters()
                    if not torch.equal(p.to_local(), block(p, full[k]))}
    out["local_sizes"] = {k: tuple(p.to_local().shape) for k, p in experts.named_parameters()}
    dist.barrier()
    return out


def issue_examples(gather: bool = True) -> dict:
    """The issue's own numbers, through the adapters' functions on 2 ranks, with DTensors that
    ``distribute_tensor`` shards unevenly on an inner dim (FSDP2 would refuse to): Step3p5's
    ``_convert_native_to_hf`` on native gate_and_up [4, 5, 16] sharded on dim 1 (true HF
    gate shape [4, 8, 5]), and ``split_experts_weights_dtensor_aware`` on experts [4, 5, 6]
    sharded on dim 1 over ``ep_shard`` (true per-expert shape [5, 6]). ``gather``: also
    gather the results whole (only where the shapes agree: a gather of disagreeing shapes
    is undefined)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.step3p5.state_dict_adapter import (
        Step3p5StateDictAdapter)
    from nemo_automodel.components.moe import state_dict_utils

    out: dict = {}
    native = torch.arange(4 * 5 * 16, dtype=torch.float32).reshape(4, 5, 16)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard_cp",))
    adapter = Step3p5StateDictAdapter(None, moe_config(4, inter=8), BackendConfig())
    hf = adapter._convert_native_to_hf("model.layers.0.moe.experts.gate_and_up_projs",
                                       distribute_tensor(native, mesh, [Shard(1)]))
    out["step3p5_shapes"] = [tuple(v.shape) for _, v in hf]
    if gather:
        out["step3p5_exact"] = _whole_equal(hf[0][1], native[:, :, :8].transpose(1, 2))

    experts = torch.arange(4 * 5 * 6, dtype=torch.float32).reshape(4, 5, 6)
    mesh2 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep_shard", "ep"))
    parts, _ = state_dict_utils.split_experts_weights_dtensor_aware(
        distribute_tensor(experts, mesh2, [Shard(1), Shard(0)]), 4)
    out["split_shapes"] = sorted({tuple(p.shape) for p in parts})
    if gather:
        out["split_exact"] = _whole_equal(parts[3], experts[3])
    return out


def _whole_equal(value, expected: torch.Tensor):
    """Whether the DTensor ``value`` gathers to ``expected`` (its error where it cannot)."""
    try:
        return tuple(value.shape) == tuple(expected.shape) and \
            torch.equal(value.full_tensor(), expected)
    except Exception as exc:  # noqa: BLE001 - a wrong global shape may fail the gather
        return _report(exc)
