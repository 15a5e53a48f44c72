"""The device a collective needs, and a ``torch`` view that honours it.

megatron-core's checkpoint code hard-codes CUDA (CUDA device arguments, the current CUDA
device, ``torch.cuda.synchronize()``). With a gloo process group
those calls either crash (no CUDA build) or put tensors where gloo cannot reduce them. Rather
than copying the functions, each affected megatron module gets its global name ``torch``
replaced by :class:`BackendAwareTorch`, which forwards everything to the real ``torch`` and
only maps CUDA device requests to :func:`collective_device`. With NCCL nothing changes.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist


def backend_uses_cuda(group: Any = None) -> bool:
    """Whether collectives of ``group`` (default: world) run on CUDA tensors."""
    if not dist.is_available() or not dist.is_initialized():
        return torch.cuda.is_available()
    backend = str(dist.get_backend(group)).lower()
    # "nccl", or a mixed spec such as "cpu:gloo,cuda:nccl" (then CUDA tensors are fine too).
    return torch.cuda.is_available() and ("nccl" in backend or "cuda" in backend)


def cuda_collectives_reason() -> str | None:
    """Why megatron-core's CUDA calls are right in this process, or None where they are not.

    They are right when CUDA is available and collectives run on CUDA: the default process
    group is NCCL, or none exists yet (``install()`` usually runs before
    ``init_process_group``; on a CUDA machine that group is NCCL in practice).
    """
    if not torch.cuda.is_available():
        return None
    if dist.is_available() and dist.is_initialized() and not backend_uses_cuda():
        return None
    return ("CUDA is available and collectives run on CUDA (NCCL), so megatron-core keeps "
            "the real torch")


def collective_device(group: Any = None) -> torch.device:
    """The device tensors must live on for collectives of ``group``."""
    if backend_uses_cuda(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def map_device(device: Any) -> Any:
    """Map a CUDA device request to the collective device; leave everything else alone."""
    if device is None or backend_uses_cuda():
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")  # a bare index means a CUDA ordinal in these call sites
    if str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


class _BackendAwareCuda(types.SimpleNamespace):
    """``torch.cuda`` with ``current_device``/``synchronize``/RNG state following the backend."""

    def __init__(self, cuda: Any) -> None:
        super().__init__()
        self._cuda = cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cuda, name)

    def current_device(self) -> Any:
        if backend_uses_cuda():
            return self._cuda.current_device()
        return torch.device("cpu")

    def synchronize(self, device: Any = None) -> None:
        if self._cuda.is_available() and self._cuda.is_initialized():
            self._cuda.synchronize(device)

    # megatron-core's persistent async checkpoint worker pins itself with
    # ``set_device(rank % device_count())``: without a CUDA backend the process has one
    # device, the CPU, and there is nothing to pin.

    def device_count(self) -> int:
        if backend_uses_cuda():
            return self._cuda.device_count()
        return 1

    def set_device(self, device: Any) -> None:
        if backend_uses_cuda():
            self._cuda.set_device(device)

    # The CUDA RNG calls below exist for code that saves/restores "all" RNG states around a
    # step (the rerun state machine, the tensor-parallel RNG tracker). Without a CUDA backend
    # there is no CUDA generator to save: the state is an empty tensor and restoring it (or
    # seeding) is a no-op, while the CPU generators are still saved/restored by the callers.

    def get_rng_state(self, device: Any = "cuda") -> Any:
        if backend_uses_cuda():
            return self._cuda.get_rng_state(device)
        return torch.empty(0, dtype=torch.uint8)

    def set_rng_state(self, new_state: Any, device: Any = "cuda") -> None:
        if backend_uses_cuda():
            self._cuda.set_rng_state(new_state, device)

    def manual_seed(self, seed: int) -> None:
        if backend_uses_cuda():
            self._cuda.manual_seed(seed)

    @property
    def random(self) -> "_BackendAwareCuda":
        """``torch.cuda.random.get_rng_state``/``set_rng_state`` follow the backend too."""
        return self


_DEVICE_FACTORIES = ("tensor", "empty", "empty_like", "zeros", "zeros_like", "ones", "full",
                     "arange", "as_tensor")


class BackendAwareTorch(types.SimpleNamespace):
    """A stand-in for the ``torch`` module inside one megatron-core module."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__()
        self._real = real
        self.cuda = _BackendAwareCuda(real.cuda)
        for name in _DEVICE_FACTORIES:
            setattr(self, name, self._with_mapped_device(getattr(real, name)))

    @staticmethod
    def _with_mapped_device(factory: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = map_device(kwargs["device"])
            return factory(*args, **kwargs)

        call.__wrapped__ = factory
        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)
