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


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="rerun.stats_report.filename",
        target=_CALLER,
        attr="filename",
        build=lambda _missing: property(lambda caller: f"validation call '{caller.message}'"),
        needed=_report_reads_missing("filename"),
        why="report_determinism_stats reads Caller.filename, which Caller does not have",
    ),
    Patch(
        name="rerun.stats_report.lineno",
        target=_CALLER,
        attr="lineno",
        build=lambda _missing: property(lambda caller: f"n/a (rank {caller.rank})"),
        needed=_report_reads_missing("lineno"),
        why="report_determinism_stats reads Caller.lineno, which Caller does not have",
    ),
)
