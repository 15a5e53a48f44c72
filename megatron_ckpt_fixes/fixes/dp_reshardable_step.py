"""A ``dp_reshardable`` resume keeps the Adam step the checkpoint saved, not the loader's.

The distributed optimizer's ``dp_reshardable`` parameter state carries, per bucket entry, the
optimizer's own ``step`` wrapped in a ``LocalNonpersistentObject``: not saved, and at load
the value of the *loading* optimizer (its fresh state). ``load_state_dict`` first restores
every parameter's step from the checkpoint's ``param_groups``, then
``load_parameter_state_from_dp_reshardable`` copies each entry into the optimizer state, the
step included: the step the checkpoint saved is overwritten by the loading optimizer's. With
torch's Adam (megatron-core without Transformer Engine or Apex, as on CPU) the resumed job's
bias correction then differs from the uninterrupted run's, at any data-parallel size. The
other formats skip ``step`` there.

The patch keeps the step the optimizer holds when its parameter state is loaded, which is
the one ``load_state_dict`` restored; optimizers without a per-parameter step (Transformer
Engine's and Apex's fused Adam) are untouched.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from megatron_ckpt_fixes.core.patching import Patch


def _steps(optimizer: Any) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
    """Every per-parameter state holding a step tensor, that tensor, and a copy of its value."""
    return [(state, state["step"], state["step"].detach().clone())
            for state in optimizer.state.values()
            if isinstance(state, dict) and isinstance(state.get("step"), torch.Tensor)]


def keep_restored_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_parameter_state_from_dp_reshardable(self: Any, state_dict: Any) -> Any:
        restored = _steps(self.optimizer)
        result = original(self, state_dict)
        with torch.no_grad():
            for state, step, value in restored:
                if state.get("step") is step:  # copied into (torch's Adam)
                    step.copy_(value)
                else:  # replaced by the template's tensor
                    state["step"] = value
        return result

    return load_parameter_state_from_dp_reshardable


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="dp_reshardable_step.load_parameter_state_from_dp_reshardable",
        target="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
        attr="load_parameter_state_from_dp_reshardable",
        build=keep_restored_step,
        why="a dp_reshardable resume keeps the Adam step restored from the checkpoint's "
            "param_groups (upstream overwrites it with the loading optimizer's own step: "
            "torch's Adam)",
    ),
)
