"""A tiny megatron-core GPTModel and its optimizer, as Megatron-LM builds them.

The model is megatron-core's own ``GPTModel`` with the local (non-Transformer-Engine) layer
spec, initialized on CPU (``use_cpu_initialization``: every rank builds the full master
weights from the same seed and keeps its tensor-parallel slice, so any TP size starts from
the same weights). No dropout: the step is then a deterministic function of the weights and
the batch, which is what the rerun state machine's zero-tolerance comparison assumes.

The optimizer comes from ``get_megatron_optimizer`` (non-distributed Adam, ``FP32Optimizer``).
megatron-core's DistributedDataParallel and DistributedOptimizer need CUDA streams and
buffers, so the model is not wrapped: the model carries a default ``ddp_config`` (all
``get_megatron_optimizer`` reads from the wrapper) and :func:`allreduce_data_parallel_grads`
averages gradients over the data-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig

from megatron_ckpt_fixes.compat.device import collective_device


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int


def build_model(shape: ModelShape, tensor_model_parallel_size: int) -> GPTModel:
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        tensor_model_parallel_size=tensor_model_parallel_size,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=shape.vocab_size, max_sequence_length=shape.seq_length)
    model.to(collective_device())
    model.ddp_config = DistributedDataParallelConfig()
    return model


def build_optimizer(model: GPTModel, lr: float, clip_grad: float) -> MegatronOptimizer:
    config = OptimizerConfig(optimizer="adam", lr=lr, clip_grad=clip_grad, bf16=False,
                             fp16=False, use_distributed_optimizer=False)
    return get_megatron_optimizer(config, [model])


def causal_mask(seq_length: int, device: torch.device) -> torch.Tensor:
    """Megatron's boolean mask (True = masked). Passed explicitly: the default one is on CUDA."""
    mask = torch.triu(torch.ones(seq_length, seq_length, device=device), diagonal=1)
    return mask.bool().view(1, 1, seq_length, seq_length)


def forward_loss(model: GPTModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's mean token loss (identical on the tensor-parallel ranks of a DP rank)."""
    device = collective_device()
    tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
    positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    per_token = model(tokens, positions, causal_mask(tokens.shape[1], device), labels=labels)
    return per_token.float().mean()


def allreduce_data_parallel_grads(model: GPTModel) -> None:
    """Average gradients over the data-parallel group (the job DDP would do)."""
    group = parallel_state.get_data_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(size)


def data_parallel_mean(value: torch.Tensor) -> float:
    """The loss Megatron reports: the mean over data-parallel ranks."""
    group = parallel_state.get_data_parallel_group()
    reduced = value.detach().clone().reshape(1)
    dist.all_reduce(reduced, group=group)
    return (reduced / dist.get_world_size(group)).item()
