"""``--rerun-mode report_determinism_stats`` crashes when it reports (megatron-core 0.16).

``RerunStateMachine._maybe_report_stats`` logs ``caller.filename`` and ``caller.lineno``, but
``Caller`` only has ``message`` and ``rank``: the first report raises ``AttributeError``
(megatron-core 0.19 logs the message instead). The patch gives ``Caller`` the two read-only
attributes the report reads, naming the validation call by its message, so the unchanged
report runs. Applied only where the report still reads them.
"""

from __future__ import annotations

import inspect

from .._patching import Patch

_CALLER = "megatron.core.rerun_state_machine:Caller"


def _report_reads_missing(field: str):
    def needed() -> bool:
        from megatron.core.rerun_state_machine import Caller, RerunStateMachine

        source = inspect.getsource(RerunStateMachine._maybe_report_stats)
        return f"caller.{field}" in source and field not in Caller._fields

    return needed


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
        needed=_report_reads_missing(field),
        why=f"report_determinism_stats reads Caller.{field}, which Caller does not have",
    )
    for field, show in _READ_BY_REPORT.items()
)
