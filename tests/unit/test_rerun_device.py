"""The unchanged RerunStateMachine runs on gloo/CPU with the compat.rerun_device feature."""

from __future__ import annotations

import random

import torch

from megatron_ckpt_fixes.compat import rerun_device


def test_machine_reduces_saves_rng_and_names_a_cpu_device(single_rank_group, clean_install,
                                                           monkeypatch):
    from megatron.core import rerun_state_machine as rsm

    clean_install.install(features=("compat.rerun_device",))
    machine = rsm.RerunStateMachine(mode=rsm.RerunMode.VALIDATE_RESULTS)

    assert machine._reduce_any(True) is True
    assert machine._reduce_any([False, True]) == (False, True)

    random.seed(3)
    torch.manual_seed(3)
    machine._save_state()
    first = (random.random(), torch.rand(2))
    machine._restore_state()  # without CUDA the CUDA RNG part is a no-op, the rest restores
    again = (random.random(), torch.rand(2))
    assert again[0] == first[0] and torch.equal(again[1], first[1])

    assert rsm.torch.cuda.current_device() == torch.device("cpu", 0)
    monkeypatch.setenv(rerun_device.CPU_DEVICE_ENV, "3")
    assert rsm.torch.cuda.current_device() == torch.device("cpu", 3)


def test_uninstall_restores_upstream_torch(clean_install):
    from megatron.core import rerun_state_machine as rsm

    clean_install.install(features=("compat.rerun_device",))
    assert isinstance(rsm.torch, rerun_device.RerunMachineTorch)
    clean_install.uninstall()
    assert rsm.torch is torch
