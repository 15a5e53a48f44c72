"""Make a CPU-only process look like one GPU to Megatron-LM's training package.

Megatron-LM's ``pretrain_gpt.py`` asserts CUDA (``Megatron requires CUDA.``), pins a CUDA
device, builds its buffers on ``torch.cuda.current_device()``, syncs CUDA streams around DDP
and reads CUDA memory statistics for its logs. To run the unchanged script on gloo ranks,
this module extends the CPU platform of megatron-core's own suite
(``scripts/mcore_suite/cpu_platform.py``: CUDA device requests go to the CPU, NCCL becomes
gloo, ``set_device``/``synchronize`` are no-ops, the CUDA RNG state is empty) with what the
training package needs on top:

- ``torch.cuda.is_available()`` answers True to Megatron-LM's training tree only (the
  scripts and ``megatron/training``, found by the caller's file), so the training package
  starts, while megatron-core, torch and ``megatron_ckpt_fixes`` keep seeing the truth (no
  CUDA) and choose their devices from the process group's backend, as on any gloo job; the
  device's properties (a compute capability 9.0 part: the H100 the functional cases' golden
  values come from) are answered to the tree only as well (:data:`TREE_ONLY_SHIMS`);
- build steps that need a source checkout or the CUDA toolkit (:data:`BUILD_STEPS`):
  megatron-core's ``compile_helpers`` runs ``make`` in its datasets directory, which a
  pip-installed wheel ships compiled but without a Makefile (upstream's call exits 1), so it
  loads the shipped ``helpers_cpp``; Megatron-LM 0.16's ``fused_kernels.load`` builds no
  kernel but asks ``$CUDA_HOME/bin/nvcc`` for its version, so it does nothing;
- on Python 3.11, ``typing.override`` (PEP 698, 3.12) is typing_extensions' decorator:
  Megatron-LM 0.19's training package imports it;
- ``tensor.type()`` names the CUDA type (``torch.cuda.FloatTensor``): megatron-core's
  gradient clipping asserts it;
- ``current_device()`` is the job's placement, ``MCF_CPU_DEVICE_INDEX`` (the launcher gives
  every relaunch a new one, as a scheduler placing the job on other hardware would): the
  rerun state machine reruns a suspicious step "on another GPU" only if the index differs;
- every ``DataLoader`` gets a host generator of its own: on a GPU, dropout draws from the
  CUDA generator and a DataLoader iterator's seed from the CPU one; here both would come
  from the CPU generator, and Megatron-LM builds its data iterators *after* loading a
  checkpoint (the RNG states restored), so a resumed run would draw its dropout masks one
  seed later than the uninterrupted run;
- CUDA streams are the CPU's (``torch.cpu.Stream``, waits are no-ops) and CUDA events are
  always complete (CPU work is synchronous; torch's CPU events cannot be recorded);
  memory statistics are zero; ``empty_cache`` and the memory-pool context do nothing;
- with ``TORCHDYNAMO_DISABLE=1`` (the jobs' environment), ``torch.compile`` returns the
  function it is given (:mod:`eager_compile`).

Every mapping is counted by the line that asked for CUDA (:data:`cpu_platform.SITES`); the
harness writes them per process (:func:`write_sites`), which shows that
``megatron_ckpt_fixes`` itself never asks for CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mcore_suite"))
import cpu_platform  # noqa: E402  (the suite's platform, extended here)
import eager_compile  # noqa: E402
from after_import import after_import  # noqa: E402

cpu_platform.PLATFORM_FILES.add(os.path.abspath(__file__))

#: The Megatron-LM training tree whose CUDA questions are answered "yes" (its root).
TREE_ENV = "MCF_MLM_TREE"

#: What the CPU "device" reports as its properties: a compute capability 9.0 part.
DEVICE_PROPERTIES = SimpleNamespace(name="cpu (training_platform)", major=9, minor=0,
                                    total_memory=0, multi_processor_count=1)


def _for_tree(tree: str, answer: Callable[..., Any], real: Callable[..., Any]
              ) -> Callable[..., Any]:
    """``answer`` (recorded) to callers in Megatron-LM's tree, ``real`` to everyone else."""

    @functools.wraps(real)
    def call(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_code.co_filename
        if os.path.abspath(caller).startswith(tree):
            cpu_platform._record()
            return answer(*args, **kwargs)
        return real(*args, **kwargs)

    return call


def _true(*_args: Any, **_kwargs: Any) -> bool:
    return True


#: The launcher's per-attempt placement (see scripts/run_with_restarts.py).
PLACEMENT_ENV = "MCF_CPU_DEVICE_INDEX"


def _placement(*_args: Any, **_kwargs: Any) -> int:
    return int(os.environ.get(PLACEMENT_ENV, "0"))


class CpuStream(torch.cpu.Stream):
    """``torch.cuda.Stream`` on the CPU "device": the CPU's stream, whose waits are no-ops
    (CPU work runs in order). A type, not a function, so that annotations such as
    ``torch.cuda.Stream | None`` (megatron-core 0.20's FSDP buffers) still evaluate."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        cpu_platform._record()
        super().__init__()


class CpuEvent:
    """``torch.cuda.Event`` on the CPU "device": CPU work is synchronous, so every event
    has completed when it is recorded (torch's own CPU events cannot be recorded)."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        cpu_platform._record()

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Any) -> float:
        return 0.0


def _stream(*_args: Any, **_kwargs: Any) -> CpuStream:
    return CpuStream()


def _properties(*_args: Any, **_kwargs: Any) -> SimpleNamespace:
    return DEVICE_PROPERTIES


def _capability(*_args: Any, **_kwargs: Any) -> tuple[int, int]:
    return DEVICE_PROPERTIES.major, DEVICE_PROPERTIES.minor


def _no_context(*_args: Any, **_kwargs: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _empty_stats(*_args: Any, **_kwargs: Any) -> dict:
    return {}


#: torch.cuda functions the training package calls, and what they do on the CPU "device".
TRAINING_SHIMS: dict[str, Callable[..., Any]] = {
    "current_device": _placement,
    "current_stream": _stream,
    "default_stream": _stream,
    "stream": torch.cpu.stream,
    "set_stream": cpu_platform._no_op,
    "memory_allocated": cpu_platform._zero,
    "max_memory_allocated": cpu_platform._zero,
    "memory_reserved": cpu_platform._zero,
    "max_memory_reserved": cpu_platform._zero,
    "device_memory_used": cpu_platform._zero,
    "memory_stats": _empty_stats,
    "reset_peak_memory_stats": cpu_platform._no_op,
    "empty_cache": cpu_platform._no_op,
    "use_mem_pool": _no_context,
}


def _load_shipped_helpers() -> None:
    """``compile_helpers`` for a pip-installed megatron-core: import the shipped build."""
    from megatron.core.datasets import helpers_cpp  # noqa: F401  (fails loudly if absent)


#: (module, function, replacement): build steps replaced where the module exists.
BUILD_STEPS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("megatron.core.datasets.utils", "compile_helpers", _load_shipped_helpers),
    ("megatron.legacy.fused_kernels", "load", cpu_platform._no_op),
)


#: ``DataLoader.__init__``'s positional parameters up to and including ``generator``.
_GENERATOR_POSITION = 12


def _own_generator(init: Callable[..., None]) -> Callable[..., None]:
    """``DataLoader.__init__`` that gives a loader without a generator one of its own."""

    @functools.wraps(init)
    def call(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) <= _GENERATOR_POSITION and kwargs.get("generator") is None:
            cpu_platform._record()
            kwargs["generator"] = torch.Generator()
        init(self, *args, **kwargs)

    return call


#: torch.cuda functions answered as a GPU would to Megatron-LM's tree only.
TREE_ONLY_SHIMS: dict[str, Callable[..., Any]] = {
    "is_available": _true,
    "get_device_properties": _properties,
    "get_device_capability": _capability,
}


class TrainingCudaToCpu(cpu_platform.CudaToCpu):
    """The suite's CUDA-to-CPU mode; ``tensor.type()`` also names the CUDA type."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                cpu_platform._record()
                return "torch.cuda." + name.removeprefix("torch.")
            return name
        return super().__torch_function__(func, types, args, kwargs)


class TrainingCpuPlatform(cpu_platform.CpuPlatform):
    """The suite's platform plus the training package's needs (see the module docstring)."""

    def __init__(self, tree: str) -> None:
        super().__init__()
        self._mode = TrainingCudaToCpu()
        self.tree = os.path.abspath(tree) + os.sep

    def open(self, spawned: bool = False) -> "TrainingCpuPlatform":
        """``spawned``: a process a rank started (megatron-core's checkpoint workers); it
        gets the torch-level mappings only, and megatron-core is not imported here, so the
        worker imports it when and as upstream does."""
        if not hasattr(typing, "override"):
            from typing_extensions import override

            typing.override = override  # an addition: nothing to restore
        if spawned:
            for name, shim in cpu_platform.CUDA_SHIMS.items():
                self._set(torch.cuda, name, cpu_platform._recorded(shim))
            self._mode.__enter__()
        else:
            super().open()
            loader = torch.utils.data.DataLoader
            self._set(loader, "__init__", _own_generator(loader.__init__))
            for module, name, replacement in BUILD_STEPS:
                after_import(module, functools.partial(self._set, attr=name,
                                                       value=cpu_platform._recorded(replacement)))
        for name, shim in TRAINING_SHIMS.items():
            self._set(torch.cuda, name, cpu_platform._recorded(shim))
        for name, stand_in in (("Stream", CpuStream), ("Event", CpuEvent)):
            self._set(torch.cuda, name, stand_in)  # they record their creation themselves
        for name, shim in TREE_ONLY_SHIMS.items():
            self._set(torch.cuda, name, _for_tree(self.tree, shim, getattr(torch.cuda, name)))
        if eager_compile.dynamo_disabled():
            self._set(torch, "compile", eager_compile.eager_compile)
        return self


def write_sites(path: Path) -> None:
    """Write this process's CUDA call sites (path:line -> times mapped) as JSON, whole or not
    at all: a job's reader may look while a last process (a checkpoint worker the rank did not
    wait for) still writes at its exit (CI: an empty file read as JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(dict(cpu_platform.SITES.most_common()), indent=1))
    os.replace(partial, path)
