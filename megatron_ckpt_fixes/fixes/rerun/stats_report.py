"""``--rerun-mode report_determinism_stats`` crashes when it reports (megatron-core 0.16).

``RerunStateMachine._maybe_report_stats`` logs ``caller.filename`` and ``caller.lineno``, but
``Caller`` only has ``message`` and ``rank``: the first report raises ``AttributeError``
(megatron-core 0.19 logs the message instead). The patch gives ``Caller`` the two read-only
attributes the report reads, naming the validation call by its message, so the unchanged
report runs. Applied only where the report's code still reads them (detected from that code,
not from a version number).
"""

from __future__ import annotations

import inspect
from typing import Callable

from megatron_ckpt_fixes.core.patching import Patch

_CALLER = "megatron.core.rerun_state_machine:Caller"


def _report_reads_missing(field: str) -> Callable[[], str | None]:
    """Detects, from the report's own code, whether it still reads a field Caller lacks."""

    def not_needed() -> str | None:
        from megatron.core.rerun_state_machine import Caller, RerunStateMachine

        if field in Caller._fields:
            return f"Caller has {field}"
        if f"caller.{field}" not in inspect.getsource(RerunStateMachine._maybe_report_stats):
            return f"the determinism report does not read caller.{field}"
        return None

    return not_needed


#: The attributes the 0.16 report reads, and what they show for a call named by its message.
_READ_BY_REPORT = {
    "filename": lambda caller: f"validation call '{caller.message}'",
    "lineno": lambda caller: f"n/a (rank {caller.rank})",
}

PATCHES: tuple[Patch, ...] = tuple(
    Patch(
        name=f"rerun.stats_report.{field}",
        target=_CALLER,
        attr=field,
        build=lambda _missing, show=show: property(show),
        adds=True,
        reads=(f"{_CALLER}.message", f"{_CALLER}.rank",
               "megatron.core.rerun_state_machine:RerunStateMachine._maybe_report_stats"),
        not_needed=_report_reads_missing(field),
        why=f"report_determinism_stats reads Caller.{field}, which Caller does not have",
    )
    for field, show in _READ_BY_REPORT.items()
)
