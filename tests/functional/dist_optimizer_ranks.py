"""Ranks that save and resume megatron-core's own distributed optimizer (``dp_reshardable``).

megatron-core's ``DistributedDataParallel`` and ``DistributedOptimizer`` build their buffers
on CUDA and check CUDA tensor types; the ranks run them on CPU through the platform of the
Megatron-LM harness (``scripts/megatron_lm/training_platform.py``: CUDA device requests go
to the CPU, ``tensor.type()`` names the CUDA type, streams are the CPU's). The model is
megatron-core's GPTModel with four local MoE experts beside a 1024-token embedding and
output layer, in bf16 (``Float16Module``) as Megatron-LM wraps it: parameter sizes from 16
to 16384 elements, so the data-parallel ranks' slices of the one gradient bucket hold 10 and
17 parameters at DP=2 and 26 at DP=1.

What is compared is DP-independent: each bucket's global tensors (main parameters and Adam
moments, keyed by bucket) at the offsets the non-padding entries cover, and the Adam step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
#: The optimizer's checkpoint format under test.
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
SAVED_STEPS = 2  # optimizer steps before the save
#: No Megatron-LM tree runs here: nothing is told that CUDA is available.
NO_TREE = "/nonexistent-megatron-lm-tree"
UPSTREAM = ["compat.cpu", "training.cpu_support"]


def open_platform(features: list[str]) -> None:
    for folder in ("megatron_lm", "mcore_suite"):
        sys.path.insert(0, str(SCRIPTS / folder))
    import training_platform

    training_platform.TrainingCpuPlatform(NO_TREE).open()
    import megatron_ckpt_fixes
    from megatron.core import parallel_state

    megatron_ckpt_fixes.install(features)
    parallel_state.initialize_model_parallel(1, 1)


def install_all() -> None:
    import megatron_ckpt_fixes

    megatron_ckpt_fixes.install()


def build(seed: int) -> tuple[Any, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, num_moe_experts=4, moe_router_topk=2,
        moe_grouped_gemm=False, add_bias_linear=False)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=1024,
                     max_sequence_length=8)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=True), Float16Module(config, model))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=0.01, bf16=True, params_dtype=torch.bfloat16,
        use_distributed_optimizer=True), [model])
    return model, optimizer


def _inner(model: Any) -> Any:
    return model.module.module  # DDP -> Float16Module -> GPTModel


def train(model: Any, optimizer: Any, steps: int, seed: int) -> None:
    """``steps`` optimizer steps on gradients drawn from ``seed`` (data-parallel ranks draw
    their own: the reduce-scatter averages them)."""
    draw = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in _inner(model).parameters():
            param.main_grad.copy_(torch.randn(param.main_grad.shape, generator=draw))
        optimizer.step()


def template(model: Any, optimizer: Any, is_loading: bool) -> dict:
    sharded = optimizer.sharded_state_dict(_inner(model).sharded_state_dict(),
                                           is_loading=is_loading, metadata=METADATA)
    return {"optimizer": sharded, "iteration": 8}


def _entries(state: dict):
    for gbuf, by_dtype in state["optimizer"]["param_state"].items():
        if isinstance(gbuf, int):
            for buckets in by_dtype.values():
                for bucket in buckets:
                    yield from bucket


def held(model: Any, optimizer: Any) -> dict:
    """What this rank holds, DP-independently: ``(bucket key, global offset) -> values`` of
    every non-padding entry, and the Adam steps."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    pieces = {}
    entries = list(_entries(template(model, optimizer, is_loading=False)))
    for entry in entries:
        if entry["padding"].obj:
            continue
        for value in entry.values():
            if isinstance(value, ShardedTensor):
                pieces[(value.key, value.global_offset[0])] = value.data.detach().clone()
    steps = sorted({float(s["step"]) for s in optimizer.optimizer.state.values()})
    return {"pieces": pieces, "steps": steps, "entries": len(entries)}


def leave_step_plain(state: dict) -> dict:
    """The writer of Megatron-LM forks (radixark/Megatron-LM) and of builds between releases:
    ``if key == 'step': continue`` leaves each entry's Adam step a plain tensor, which the save
    puts into the common state (rank 0's) instead of dropping it."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    for entry in _entries(state):
        if isinstance(entry.get("step"), LocalNonpersistentObject):
            entry["step"] = entry["step"].obj
    return state


def save(root: str, rank: int) -> dict:
    """Train and save both checkpoints (upstream's writer and the plain-step writer)."""
    from megatron.core import dist_checkpointing

    model, optimizer = build(seed=1)
    train(model, optimizer, SAVED_STEPS, seed=100 + rank)
    for name, state in (("upstream", template(model, optimizer, False)),
                        ("plain_step", leave_step_plain(template(model, optimizer, False)))):
        if rank == 0:
            os.makedirs(os.path.join(root, name))
        dist.barrier()
        dist_checkpointing.save(state, os.path.join(root, name))
    return held(model, optimizer)


def resume(root: str, name: str) -> dict | str:
    """A fresh job (one step taken: the Adam state exists) loads ``root/name``; what it then
    holds, or the error the load raised."""
    from megatron.core import dist_checkpointing

    model, optimizer = build(seed=2)
    train(model, optimizer, 1, seed=7)
    try:
        loaded = dist_checkpointing.load(template(model, optimizer, True),
                                         os.path.join(root, name))
    except (Exception, BaseException) as exc:  # noqa: BLE001 - reported to the test
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return f"{type(exc).__name__}: {exc}"
    optimizer.load_state_dict(loaded["optimizer"])
    found = held(model, optimizer)
    found["iteration"] = loaded["iteration"]
    found["sharding_type"] = loaded["optimizer"]["param_state_sharding_type"]
    return found


NAMES = ("upstream", "plain_step")


def save_and_resume(rank: int, world: int, root: str) -> dict:
    """DP=``world``: save, resume with upstream, then with every fix installed."""
    open_platform(UPSTREAM)
    saved = save(root, rank)
    upstream = {name: resume(root, name) for name in NAMES}
    install_all()
    fixed = {name: resume(root, name) for name in NAMES}
    return {"saved": saved, "upstream": upstream, "fixed": fixed}


def resume_only(rank: int, world: int, root: str) -> dict:
    """Another data-parallel size: resume with upstream, then with every fix installed."""
    open_platform(UPSTREAM)
    upstream = {name: resume(root, name) for name in NAMES}
    install_all()
    fixed = {name: resume(root, name) for name in NAMES}
    return {"upstream": upstream, "fixed": fixed}
