"""Per-rank RNG states (python, numpy, torch, and CUDA where there is one).

Megatron seeds every generator from ``--seed`` and checkpoints each rank's states, because
anything that draws random numbers (dropout, the rerun state machine's error injector, which
uses Python's ``random``) must continue the same sequence after a resume. The states go into
the checkpoint as one :class:`ShardedObject` per rank, so a resume with a different world
size fails loudly unless told ``--no-load-rng``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_ckpt_fixes.compat.device import backend_uses_cuda

RNG_KEY = "rng_state"


def seed_all(seed: int) -> None:
    """Seed every generator identically on every rank, as Megatron does (one pipeline stage).

    The same torch seed on all tensor-parallel ranks is what makes megatron-core's CPU
    initialization build the same master weights everywhere before slicing them.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    if backend_uses_cuda():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
        state["rng_tracker_states"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def restore(state: dict[str, Any]) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state:
        if not backend_uses_cuda():
            raise RuntimeError("checkpoint holds CUDA RNG states but this run has no CUDA "
                               "backend; resume with --no-load-rng")
        torch.cuda.set_rng_state(state["cuda_rng_state"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def sharded() -> ShardedObject:
    """This rank's current states as its shard of a ``[world_size]`` object (also the load
    template: loading replaces the payload)."""
    return ShardedObject(RNG_KEY, capture(), (dist.get_world_size(),), (dist.get_rank(),),
                         replica_id=0)
