"""megatron-core's rerun state machine, set up and fed the way Megatron-LM does it.

The machine itself is upstream's, unchanged (on CPU it runs through the ``compat.rerun_device``
feature). Megatron-LM validates the local loss every step: NaN and Inf checks that are fatal
(a reproducible bad result means checkpoint, exit 16, rerun elsewhere, exit 17 when judged),
and optionally a spiky-loss check that is not. Errors are injected by upstream's
``RerunErrorInjector`` (``--error-injection-rate``/``--error-injection-type``).
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.rerun_state_machine import (
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunStateMachine,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)

#: Megatron-LM's threshold for "spiky loss": 10x the largest loss seen so far.
SPIKY_LOSS_FACTOR = 10


def init_machine(mode: str, injection_rate: int, injection_type: str,
                 tracker_filename: str | None) -> RerunStateMachine:
    destroy_rerun_state_machine()
    initialize_rerun_state_machine(
        mode=RerunMode(mode),
        error_injector=RerunErrorInjector(
            error_injection_rate=injection_rate,
            error_injection_type=RerunDiagnostic(injection_type),
        ),
        result_rejected_tracker_filename=tracker_filename,
    )
    return get_rerun_state_machine()


def validate_loss(machine: RerunStateMachine, loss: torch.Tensor, check_nan: bool,
                  check_spiky: bool) -> None:
    """The checks of Megatron-LM's ``loss_func`` (pretrain_gpt.py)."""
    if check_nan:
        machine.validate_result(result=loss, rejection_func=torch.isnan,
                                message="found NaN in local forward loss calculation",
                                tolerance=0.0, fatal=True)
        machine.validate_result(result=loss, rejection_func=torch.isinf,
                                message="found Inf in local forward loss calculation",
                                tolerance=0.0, fatal=True)
    if check_spiky:
        machine.validate_result(
            result=loss,
            rejection_func=partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                   context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)
