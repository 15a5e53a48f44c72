"""Full, tensor-parallel-gathered copies of weights and optimizer state (for exact checks).

Comparing runs with different TP sizes needs tensors in one layout: each TP-sharded
parameter (megatron marks them with ``tensor_model_parallel`` and ``partition_dim``) and its
Adam moments are all-gathered along the partition dimension of the tensor-parallel group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer


def _full(tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().cpu().clone()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim).cpu()


def _optimizer_state(optimizer: MegatronOptimizer) -> dict[torch.nn.Parameter, dict[str, Any]]:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return {p: opt.optimizer.state[p] for opt in inner for p in opt.get_parameters()}


def full_state(model: torch.nn.Module, optimizer: MegatronOptimizer) -> dict[str, torch.Tensor]:
    """``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``, identical for any TP size.

    Collective over the tensor-parallel group: call on every rank.
    """
    states = _optimizer_state(optimizer)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        out[f"param/{name}"] = _full(param, param)
        for key in ("exp_avg", "exp_avg_sq"):
            if key in states.get(param, {}):
                out[f"{key}/{name}"] = _full(states[param][key], param)
    return out
