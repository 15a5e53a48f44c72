"""CPU/gloo support for megatron-core's torch_dist save and load path.

The modules below hard-code CUDA on the checkpoint path (the async writer's preload
synchronizes CUDA, finalize broadcasts a tensor on the current CUDA device,
global-metadata reuse verification reduces on a hard-coded CUDA device, the async caller checks
liveness on the current CUDA device). Where collectives do not run on CUDA, each gets a
:class:`~.device.BackendAwareTorch` as its ``torch``. On a CUDA process whose collectives
run on CUDA (NCCL) upstream's calls are right, so no stand-in is applied there and
megatron-core keeps the real ``torch`` object.

The persistent async checkpoint worker is a spawned process that starts without any patch;
its process target (:class:`PersistentWorker`) installs in it the features its trainer has,
on every backend.
"""

from __future__ import annotations

from typing import Any, Callable

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.compat.device import BackendAwareTorch, cuda_collectives_reason

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


_PERSISTENT_CALLER = f"{_STRATEGIES}.async_utils:PersistentAsyncCaller"


#: Upstream's worker loop, kept when the patch is applied (a forked worker inherits it).
_upstream_loop: Callable[..., None] | None = None


class PersistentWorker:
    """megatron-core's persistent async checkpoint worker, with the trainer's fixes.

    The worker is a spawned process: it imports megatron-core afresh, without the patches of
    the trainer, and its first call is ``torch.cuda.set_device(rank % device_count())``
    (ZeroDivisionError without CUDA: the worker dies and the trainer waits for it forever).
    An instance of this class is the process target instead. Pickled for the spawn, it
    carries the features the trainer has installed at that moment (``__reduce__`` runs in
    the trainer); in the worker it installs them (``compat.cpu`` among them, so upstream's
    loop runs on CPU; ``checksums``, so the worker's writes are checksummed like the
    trainer's) and runs upstream's unchanged loop. No environment switch is needed.

    A class of this package, picklable by name: the fresh process must find this target,
    not upstream's loop (which it would find unpatched).
    """

    def __init__(self, features: tuple[str, ...] = ("compat.cpu",)) -> None:
        self.features = features

    def __reduce__(self) -> tuple[Any, tuple[tuple[str, ...]]]:
        import megatron_ckpt_fixes

        return type(self), (megatron_ckpt_fixes.installed_features(),)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        loop = _upstream_loop
        if loop is None:  # spawned: megatron-core is fresh and unpatched in this process
            import megatron_ckpt_fixes
            from megatron.core.dist_checkpointing.strategies.async_utils import (
                PersistentAsyncCaller)

            loop = PersistentAsyncCaller.async_loop
            megatron_ckpt_fixes.install(self.features)
        loop(*args, **kwargs)


def _worker_target(upstream_loop: Callable[..., None]) -> staticmethod:
    global _upstream_loop
    _upstream_loop = upstream_loop
    return staticmethod(PersistentWorker())


PATCHES: tuple[Patch, ...] = tuple(
    backend_aware_torch_patch(mod, f"compat.cpu.{mod.rsplit('.', 1)[1]}")
    for mod in CUDA_HARDCODED_MODULES
) + (
    Patch(
        name="compat.cpu.persistent_worker",
        target=_PERSISTENT_CALLER,
        attr="async_loop",
        build=_worker_target,
        # Applied on CUDA too: there the worker needs no stand-in (install() finds none
        # needed in it), but it needs the trainer's other fixes (checksums of its writes).
        why="the spawned persistent async checkpoint worker runs with the trainer's fixes "
            "(without them it pins a CUDA device at start-up: ZeroDivisionError on CPU, and "
            "the trainer waits forever; its writes would have no checksums)",
    ),
)
