"""What the example training loop needs to run megatron-core's GPTModel and optimizer on gloo.

Not a checkpoint fix, so an optional ``install()`` feature
(``install(["training.cpu_support"])``): these are the CUDA hard-codings on the *training*
path (``GlobalMemoryBuffer`` allocates attention scratch on the current CUDA device, the
tensor-parallel RNG tracker seeds, saves and restores the CUDA generator around every
attention dropout, ``FP32Optimizer`` puts its loss scale and the grad-norm computation its
buffers on a hard-coded CUDA device). Each module gets a backend-aware ``torch`` (see
:mod:`megatron_ckpt_fixes.compat.device`); with NCCL on GPUs nothing changes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.compat.cpu import backend_aware_torch_patch
from megatron_ckpt_fixes.compat.device import backend_uses_cuda, cuda_collectives_reason

_TP_RANDOM = "megatron.core.tensor_parallel.random"

#: megatron-core modules whose CUDA calls sit on the forward/backward/optimizer path.
TRAINING_CUDA_MODULES: tuple[str, ...] = (
    "megatron.core.utils",
    _TP_RANDOM,
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
)


def _skip_without_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_set_cuda_rng_state`` queues a CUDA call; without CUDA there is no state to set."""

    @functools.wraps(original)
    def set_state(*args: Any, **kwargs: Any) -> None:
        if backend_uses_cuda():
            original(*args, **kwargs)

    return set_state


PATCHES: tuple[Patch, ...] = tuple(
    backend_aware_torch_patch(mod, f"training.cpu_support.{mod.rsplit('.', 1)[1]}")
    for mod in TRAINING_CUDA_MODULES
) + (
    Patch(
        name="training.cpu_support.set_cuda_rng_state",
        target=_TP_RANDOM,
        attr="_set_cuda_rng_state",
        build=_skip_without_cuda,
        not_needed=cuda_collectives_reason,
        why="the RNG tracker restores the CUDA generator after each fork; no-op without CUDA",
    ),
)
