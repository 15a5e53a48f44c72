"""Make a CPU-only process look enough like one GPU for megatron-core's own unit tests.

megatron-core's test suite is written for NCCL on GPUs: its ``Utils`` pins a CUDA device
and initializes NCCL, and its tests and models create tensors with ``device='cuda'``,
``.cuda()`` and ``torch.cuda.current_device()``. To run the *same* test files on CPU with
gloo, this module maps, process-wide and identically whatever ``megatron_ckpt_fixes``
features are installed:

- CUDA device requests (``device='cuda'``/``'cuda:N'``/an int, ``.cuda()``, ``.to('cuda')``,
  ``pin_memory``) to the CPU, with a :class:`~torch.overrides.TorchFunctionMode`;
- ``torch.cuda.set_device``/``synchronize`` to no-ops, ``current_device`` to 0 and
  ``device_count`` to 1 (one "device", the CPU), the CUDA RNG state to an empty state;
- the NCCL backend to gloo in ``init_process_group``/``new_group`` (with a collective
  timeout, so a hang fails a test instead of blocking the run).

- megatron-core's ``is_te_min_version`` to False without transformer-engine (upstream
  compares None with a version and raises TypeError; the suite's conftest asks on every
  test, and two model test modules at import), in megatron.core.utils and in the suite's
  already imported modules.

``torch.cuda.is_available()`` stays False, so code that asks (megatron_ckpt_fixes' own
backend detection, the suite's skip markers) sees the truth. Every mapping is counted by the
call site that asked for CUDA (:data:`SITES`): the report shows which test or library lines
needed it, and that megatron_ckpt_fixes itself never asks for CUDA on a gloo process.
"""

from __future__ import annotations

import collections
import datetime
import functools
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import rank_sync

#: "path:line" of each call that asked for CUDA -> how many times it was mapped to the CPU.
SITES: collections.Counter[str] = collections.Counter()

_TORCH_DIR = os.path.dirname(torch.__file__)
#: The platform's own files (this one and those of platforms built on it): never a call site.
PLATFORM_FILES: set[str] = {os.path.abspath(__file__)}
_CPU = torch.device("cpu")


def _caller() -> str:
    """The first frame outside torch and the platform: the line that asked for CUDA."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_TORCH_DIR) and path not in PLATFORM_FILES:
            return f"{_short(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _short(path: str) -> str:
    marker = f"{os.sep}site-packages{os.sep}"
    if marker in path:
        return path.split(marker, 1)[1]
    cwd = os.getcwd() + os.sep
    return path[len(cwd):] if path.startswith(cwd) else path


def _is_cuda(device: Any, ints: bool) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return ints and isinstance(device, int) and not isinstance(device, bool)


def _record() -> None:
    SITES[_caller()] += 1


class CudaToCpu(TorchFunctionMode):
    """Every torch call that asks for a CUDA device gets the CPU instead (and is recorded)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            _record()
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1], ints=True):
            _record()
            args = (args[0], _CPU, *args[2:])
        if "device" in kwargs and _is_cuda(kwargs["device"], ints=True):
            _record()
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            _record()
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _recorded(value: Callable[..., Any]) -> Callable[..., Any]:
    """``value`` as a replacement that records its caller each time."""

    @functools.wraps(value)
    def call(*args: Any, **kwargs: Any) -> Any:
        _record()
        return value(*args, **kwargs)

    return call


def _no_op(*_args: Any, **_kwargs: Any) -> None:
    return None


def _zero(*_args: Any, **_kwargs: Any) -> int:
    return 0


def _one(*_args: Any, **_kwargs: Any) -> int:
    return 1


def _empty_rng_state(*_args: Any, **_kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


#: torch.cuda functions without a CPU meaning, and what they do on the CPU "device".
CUDA_SHIMS: dict[str, Callable[..., Any]] = {
    "set_device": _no_op,
    "synchronize": _no_op,
    "current_device": _zero,
    "device_count": _one,
    "get_rng_state": _empty_rng_state,
    "set_rng_state": _no_op,
}

COLLECTIVE_TIMEOUT_ENV = "MCF_COLLECTIVE_TIMEOUT_S"


def _gloo_backend(original: Callable[..., Any], position: int, timeout_at: int,
                  created: list[Any] | None = None) -> Callable[..., Any]:
    """``init_process_group``/``new_group`` with NCCL asked for: gloo; a collective timeout
    where none is given (``position``/``timeout_at``: where backend and timeout sit).
    Groups made gloo here (NCCL or default backend) are appended to ``created``."""

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        args = list(args)
        asked = args[position] if len(args) > position else kwargs.get("backend")
        if asked is not None and "nccl" in str(asked):
            if len(args) > position:
                args[position] = "gloo"
            else:
                kwargs["backend"] = "gloo"
            kwargs.pop("pg_options", None)  # NCCL's options: gloo takes none of them
        if rank_sync.store_epoch() and isinstance(kwargs.get("store"), dist.Store):
            # process groups were reset after a failed test: keys of their own
            kwargs["store"] = dist.PrefixStore(f"mcf-epoch{rank_sync.store_epoch()}",
                                               kwargs["store"])
        if len(args) <= timeout_at and kwargs.get("timeout") is None:
            kwargs["timeout"] = datetime.timedelta(
                seconds=float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, "180")))
        group = original(*args, **kwargs)
        if created is not None and (asked is None or "nccl" in str(asked)):
            created.append(group)
        return group

    return call


def _destroying(destroy_model_parallel: Callable[[], None],
                created: list[Any]) -> Callable[[], None]:
    """megatron-core's ``destroy_model_parallel`` that also frees the groups it had as NCCL.

    NCCL communicators are created lazily, so on GPUs the groups megatron-core forgets
    there cost nothing; gloo connects every group at creation (threads and sockets per
    group), and a suite that re-initializes model parallelism in every test would pile up
    thousands of threads per rank. Upstream already destroys its explicit gloo groups.
    """

    @functools.wraps(destroy_model_parallel)
    def call() -> None:
        destroy_model_parallel()
        while created:
            group = created.pop()
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER and \
                    dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(group)

    return call


def _te_min_version_or_false(original: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(original)
    def is_te_min_version(*args: Any, **kwargs: Any) -> bool:
        from megatron.core.utils import get_te_version

        return get_te_version() is not None and original(*args, **kwargs)

    return is_te_min_version


class CpuPlatform:
    """Applies the mappings above; :meth:`close` restores torch exactly."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode = CudaToCpu()
        self._groups: list[Any] = []

    def _set(self, owner: Any, attr: str, value: Any) -> None:
        self._saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def open(self) -> "CpuPlatform":
        if torch.cuda.is_available():
            raise RuntimeError("a CUDA device is present: run megatron-core's suite as is")
        for name, shim in CUDA_SHIMS.items():
            replacement = _recorded(shim)
            self._set(torch.cuda, name, replacement)
            if hasattr(torch.cuda.random, name):
                self._set(torch.cuda.random, name, replacement)
        self._set(dist, "init_process_group", _gloo_backend(dist.init_process_group, 0, 2))
        self._set(dist, "new_group", _gloo_backend(dist.new_group, 2, 1, self._groups))
        import megatron.core.parallel_state as ps

        self._set(ps, "destroy_model_parallel", _destroying(ps.destroy_model_parallel,
                                                            self._groups))
        self._answer_te_version_questions()
        self._mode.__enter__()
        return self

    def _answer_te_version_questions(self) -> None:
        import megatron.core.utils as mcore_utils

        original = mcore_utils.is_te_min_version
        replacement = _te_min_version_or_false(original)
        self._set(mcore_utils, "is_te_min_version", replacement)
        for name, module in list(sys.modules.items()):
            if name.startswith("tests.") and getattr(module, "is_te_min_version", None) is original:
                self._set(module, "is_te_min_version", replacement)

    def close(self) -> None:
        self._mode.__exit__(None, None, None)
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()
