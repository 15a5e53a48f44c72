"""A checkpoint that cannot be loaded as asked says which key, on which rank, and why.

With megatron-core 0.16 a failed load raises DCP's ``CheckpointException`` on every rank as a
wall of per-rank tracebacks; with 0.19 load planning is rank-local, so only the rank whose
key is missing raises and the others carry on with a partial load. The patched
``dist_checkpointing.load`` agrees on the outcome: each rank contributes its own cause and
every rank raises the same :class:`CheckpointLoadError`, one line per failing rank naming
the cause (which names the key). It subclasses ``CheckpointException`` so existing handlers
keep working; the local failures (with tracebacks) stay in ``failures``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from ._patching import Patch
from .collective import CollectiveError, agree

_HINTS = {
    "Missing key in checkpoint state_dict": "the checkpoint has no entry for this key: it was "
    "saved without it (or under another sharding); load with a template of what was saved",
    "not in state dict": "the checkpoint has no tensor under this key",
    "Size mismatch": "the checkpoint holds this key with another global shape",
}


def _cause(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    hints = [hint for pattern, hint in _HINTS.items() if pattern in text]
    return text + (f" ({hints[0]})" if hints else "")


class CheckpointLoadError(CheckpointException):
    """Raised on every rank when a checkpoint cannot be loaded as requested."""

    def __init__(self, checkpoint_dir: Any, causes: dict[int, str],
                 local_failures: dict[int, Any]) -> None:
        super().__init__(f"cannot load {checkpoint_dir}", local_failures)
        self.causes = causes
        lines = [f"  rank {rank}: {cause}" for rank, cause in sorted(causes.items())]
        self.summary = (f"cannot load checkpoint {checkpoint_dir} as requested; "
                        f"{len(causes)} rank(s) failed:\n" + "\n".join(lines))

    def __str__(self) -> str:
        return self.summary


def _report(exc: BaseException, rank: int) -> tuple[dict[int, str], dict[int, Any]]:
    """The failures this rank saw, keyed as its exception keyed them, and the raw ones."""
    if isinstance(exc, CheckpointException):
        return {r: _cause(e) for r, (e, _tb) in exc.failures.items()}, exc.failures
    return {rank: _cause(exc)}, {rank: (exc, None)}


def attribute(reports: dict[int, dict[int, str]]) -> dict[int, str]:
    """Which rank failed and why, from what each failing rank saw.

    A load that planned collectively (megatron-core 0.16) gives every rank the same gathered
    failures, keyed by the real ranks. A rank-local load (0.19 loads with ``no_dist``) keys
    its own failures as rank 0 and only the failing ranks see anything: then each failure
    belongs to the rank that saw it.
    """
    views = list(reports.values())
    if len(views) > 1 and all(view == views[0] for view in views):
        return dict(sorted(views[0].items()))
    return {rank: "; ".join(sorted(set(view.values()))) for rank, view in sorted(reports.items())}


def clear_load_errors(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        rank = dist.get_rank() if dist.is_initialized() else 0
        report: dict[int, str] | None = None
        failures: dict[int, Any] = {}
        result = None
        try:
            result = original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        except (CheckpointException, Exception) as exc:  # noqa: BLE001 - agreed below
            report, failures = _report(exc, rank)
        try:
            agree(False, report, f"loading {checkpoint_dir}")
        except CollectiveError as exc:
            raise CheckpointLoadError(checkpoint_dir, attribute(exc.errors), failures) from None
        return result

    return load


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="load.clear_errors",
        target="megatron.core.dist_checkpointing.serialization",
        attr="load",
        build=clear_load_errors,
        aliases=("megatron.core.dist_checkpointing",),
        why="a failed load names the key, the rank and the cause, the same on every rank",
    ),
)
