"""CPU/gloo support for megatron-core's rerun state machine, which stays unchanged.

``megatron.core.rerun_state_machine`` hard-codes CUDA in three places: it all-reduces its
rerun/checkpoint/continue flags on a hard-coded CUDA device, it saves and restores ``torch.cuda``'s
RNG state around a step, and it asks for the current CUDA device to name the device a
suspicious result came from (and, after a relaunch, to decide whether the job came back on the
same device and must be restarted again). The module gets a :class:`RerunMachineTorch` as its
``torch``: reductions go to :func:`~.device.collective_device`, CUDA RNG calls are no-ops
without a CUDA backend, and with NCCL everything is the real ``torch``.

On CPU there is no GPU ordinal that tells two placements of a rank apart. The device a rank
reports is ``cpu:<MCF_CPU_DEVICE_INDEX>`` (default ``cpu:0``); a scheduler that relaunches a
job on other hardware says so by changing that variable (``scripts/run_with_restarts.py`` does,
per attempt, unless told ``--same-device``). Without it every relaunch looks like the same
device, and the state machine asks to be restarted again, exactly as it would on one GPU node.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.compat.cpu import backend_aware_torch_patch
from megatron_ckpt_fixes.compat.device import (BackendAwareTorch, _BackendAwareCuda,
    backend_uses_cuda)

#: Environment variable naming the CPU "device" a rank runs on (see the module docstring).
CPU_DEVICE_ENV = "MCF_CPU_DEVICE_INDEX"


def cpu_device() -> torch.device:
    """The identity of this rank's placement when there is no CUDA backend."""
    return torch.device("cpu", int(os.environ.get(CPU_DEVICE_ENV, "0")))


class _RerunCuda(_BackendAwareCuda):
    """``torch.cuda`` for the rerun state machine: the device is a placement identity."""

    def current_device(self) -> Any:
        if backend_uses_cuda():
            return self._cuda.current_device()
        return cpu_device()


class RerunMachineTorch(BackendAwareTorch):
    """``torch`` inside ``megatron.core.rerun_state_machine``."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real)
        self.cuda = _RerunCuda(real.cuda)


PATCHES: tuple[Patch, ...] = (
    backend_aware_torch_patch("megatron.core.rerun_state_machine",
                              "compat.rerun_device.rerun_state_machine", RerunMachineTorch),
)
