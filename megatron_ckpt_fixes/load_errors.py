"""A checkpoint that cannot be loaded as asked says which key, on which rank, and why.

DCP already fails a load on every rank together (its planning gathers all ranks'
failures), but what reaches the user is a wall of per-rank tracebacks. The patched
``dist_checkpointing.load`` raises :class:`CheckpointLoadError` instead: one line per
failing rank naming the cause (which names the key), the same text on every rank. It
subclasses ``CheckpointException`` so existing handlers keep working, and keeps the
original failures (with tracebacks) in ``failures``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch.distributed.checkpoint import CheckpointException

from ._patching import Patch

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

    def __init__(self, checkpoint_dir: Any, failures: dict[int, Any]) -> None:
        super().__init__(f"cannot load {checkpoint_dir}", failures)
        lines = [f"  rank {rank}: {_cause(exc)}" for rank, (exc, _trace) in
                 sorted(failures.items())]
        self.summary = (f"cannot load checkpoint {checkpoint_dir} as requested; "
                        f"{len(failures)} rank(s) failed:\n" + "\n".join(lines))

    def __str__(self) -> str:
        return self.summary


def clear_load_errors(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        except CheckpointLoadError:
            raise
        except CheckpointException as exc:
            raise CheckpointLoadError(checkpoint_dir, exc.failures) from exc

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
