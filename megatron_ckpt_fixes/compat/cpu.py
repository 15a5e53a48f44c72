"""CPU/gloo support for megatron-core's torch_dist save and load path.

The modules below hard-code CUDA on the checkpoint path (the async writer's preload
synchronizes CUDA, finalize broadcasts a tensor on the current CUDA device,
global-metadata reuse verification reduces on a hard-coded CUDA device, the async caller checks
liveness on the current CUDA device). Where collectives do not run on CUDA, each gets a
:class:`~.device.BackendAwareTorch` as its ``torch``. On a CUDA process whose collectives
run on CUDA (NCCL) upstream's calls are right, so nothing is patched there and megatron-core
keeps the real ``torch`` object.
"""

from __future__ import annotations

from .._patching import Patch
from .device import BackendAwareTorch, cuda_collectives_reason

_STRATEGIES = "megatron.core.dist_checkpointing.strategies"

#: megatron-core modules whose CUDA calls sit on the torch_dist save/load path.
CUDA_HARDCODED_MODULES: tuple[str, ...] = (
    f"{_STRATEGIES}.filesystem_async",
    f"{_STRATEGIES}.state_dict_saver",
    f"{_STRATEGIES}.async_utils",
    f"{_STRATEGIES}.fully_parallel",
)


def backend_aware_torch_patch(module: str, name: str,
                              build: type[BackendAwareTorch] = BackendAwareTorch) -> Patch:
    """A patch giving ``module`` a backend-aware ``torch``, only where collectives are not
    on CUDA (see :func:`~.device.cuda_collectives_reason`)."""
    return Patch(
        name=name,
        target=module,
        attr="torch",
        build=build,
        not_needed=cuda_collectives_reason,
        why=f"{module} hard-codes CUDA; follow the process group's backend instead",
    )


PATCHES: tuple[Patch, ...] = tuple(
    backend_aware_torch_patch(mod, f"compat.cpu.{mod.rsplit('.', 1)[1]}")
    for mod in CUDA_HARDCODED_MODULES
)
