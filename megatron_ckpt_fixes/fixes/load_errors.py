"""A checkpoint that cannot be loaded as asked says which key, on which rank, and why.

With megatron-core 0.16 a failed load raises DCP's ``CheckpointException`` on every rank as a
wall of per-rank tracebacks; with 0.19 load planning is rank-local, so only the rank whose
key is missing raises and the others carry on with a partial load. The patched
``dist_checkpointing.load`` agrees on the outcome: each rank contributes its own cause and
every rank raises the same :class:`CheckpointLoadError`, one line per failing rank naming
the cause (which names the key). A checkpoint that a newer megatron-core wrote, in a format
this one cannot read, is one line instead, the same on every rank: what happened and what is
missing (:mod:`.newer_checkpoint`); so is ``load_common_state_dict`` on such a checkpoint,
which training flows call first. A template whose dtype would round saved values is refused
the same way, before any tensor data is read (:mod:`.load_casts`), and so is a ``.metadata``
that differs from its recorded checksum (:mod:`.checksums.file_reader`).

The raised error keeps the class upstream raised: it is built as a subclass of both
:class:`CheckpointLoadError` and the class the (lowest) failing rank saw, so
``except CheckpointingException`` (a missing directory, strict-mode key mismatches),
``except CheckpointException`` (DCP's failures) and ``except Exception`` catch exactly what
they caught upstream. The local failures (with tracebacks) stay in ``failures``.
"""

from __future__ import annotations

import functools
import importlib
import traceback
from typing import Any, Callable

from torch.distributed.checkpoint import CheckpointException

from megatron_ckpt_fixes.fixes import load_casts, strictness
from megatron_ckpt_fixes.core.patching import Patch
from megatron_ckpt_fixes.core.agreement import agree, check, rank_and_size
from megatron_ckpt_fixes.fixes.checksums.files import FileChecksumError
from megatron_ckpt_fixes.fixes.checksums.record import RecordError
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError
from megatron_ckpt_fixes.core.messages import shorten
from megatron_ckpt_fixes.fixes.newer_checkpoint import PREFIX as NEWER_WRITER
from megatron_ckpt_fixes.fixes.newer_checkpoint import newer_writer_reason
from megatron_ckpt_fixes.fixes.rerun import relaunch_bound

_HINTS = {
    "Missing key in checkpoint state_dict": "the checkpoint has no entry for this key: it was "
    "saved without it (or under another sharding); load with a template of what was saved",
    "not in state dict": "the checkpoint has no tensor under this key",
    "Size mismatch": "the checkpoint holds this key with another global shape",
}


def _cause(exc: BaseException) -> str:
    text = shorten(f"{type(exc).__name__}: {exc}".strip())
    hints = [hint for pattern, hint in _HINTS.items() if pattern in text]
    return text + (f" ({hints[0]})" if hints else "")


class CheckpointLoadError(MegatronCkptFixesError):
    """Raised on every rank when a checkpoint cannot be loaded as requested.

    Every raised instance is also an instance of the upstream exception class (see the
    module docstring; :func:`load_error_type`). ``causes`` maps each failing rank to its
    cause; ``failures`` holds this rank's raw failures, as DCP's ``CheckpointException``
    does.
    """

    def __init__(self, checkpoint_dir: Any, causes: dict[int, str],
                 local_failures: dict[int, Any]) -> None:
        lines = [f"  rank {rank}: {cause}" for rank, cause in sorted(causes.items())]
        newer = {cause for cause in causes.values() if cause.startswith(NEWER_WRITER)}
        if len(newer) == 1 and len(set(causes.values())) == 1:
            self.summary = f"cannot load checkpoint {checkpoint_dir}: {newer.pop()}"
        else:
            self.summary = (f"cannot load checkpoint {checkpoint_dir} as requested; "
                            f"{len(causes)} rank(s) failed:\n" + "\n".join(lines))
        # The upstream base's own __init__ is not called: the message is ours, and what
        # its handlers read (CheckpointException.failures) is set here.
        BaseException.__init__(self, self.summary)
        self.checkpoint_dir = checkpoint_dir
        self.causes = causes
        self._failures = local_failures

    @property
    def failures(self) -> dict[int, Any]:
        return self._failures

    def __str__(self) -> str:
        return self.summary


@functools.lru_cache(maxsize=None)
def load_error_type(upstream: type[BaseException]) -> type[CheckpointLoadError]:
    """:class:`CheckpointLoadError` that is also an ``upstream`` (one class per upstream class)."""
    if issubclass(upstream, CheckpointLoadError):
        return upstream
    return type("CheckpointLoadError", (CheckpointLoadError, upstream),
                {"__module__": __name__, "__doc__": CheckpointLoadError.__doc__})


def _class_path(exc: BaseException) -> str:
    cls = type(exc)
    return f"{cls.__module__}:{cls.__qualname__}"


def _upstream_class(path: str) -> type[BaseException]:
    """The class a failing rank raised, resolved here; DCP's class if it cannot be."""
    module, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return CheckpointException
    return obj if isinstance(obj, type) and issubclass(obj, BaseException) else CheckpointException


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


def _release_failed_load(exc: BaseException) -> None:
    """Let the failed load's frames go now, not at some later garbage collection.

    torch DCP catches a rank's failure in ``_DistWrapper`` and keeps it in a local of the
    frame the exception's own traceback holds: a reference cycle. Through the frames' callers
    it holds everything the caller's frames hold, a training script's model and optimizer
    among them, and with them megatron-core's process-group handles (every parallel layer
    keeps its ``tp_group``). Left to the garbage collector, they are destroyed after the job
    has called ``destroy_process_group()``, often during interpreter shutdown, where
    destroying a gloo process group can end the process in ``std::terminate`` ("terminate
    called without an active exception", exit 134, after the agreed error: 1 run in ~34 on
    a loaded machine). Clearing the locals of the finished frames of the error, of what it
    was raised from (megatron-core 0.19 re-raises DCP's failure) and of the ranks' failures
    it carries breaks the cycles, and the failures this rank keeps (``failures``) drop their
    tracebacks, whose frames lead back to the caller (torch DCP's failures keep a summary of
    theirs beside them; the causes were taken before)."""
    pending, seen = [exc], set()
    while pending:  # the error, what it was raised from, and the ranks' failures it carries
        error = pending.pop()
        if not isinstance(error, BaseException) or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        if error is not exc:  # kept in ``failures``: its frames reach back to this one
            error.__traceback__ = None
        pending += [error.__cause__, error.__context__]
        pending += [f[0] if isinstance(f, tuple) else f
                    for f in (getattr(error, "failures", None) or {}).values()]


def _refusal(sharded_state_dict: Any, checkpoint_dir: Any) -> str | None:
    """This rank's cause for refusing a load from what ``.metadata`` says, before any tensor
    data is read: it would round saved values (:mod:`.load_casts`),
    or whose ``.metadata`` (or checksum record) is not what was saved: found here, where it is
    first read, the cause keeps its class (torch DCP's load would fold it into an
    ``AssertionError``); None also when the metadata cannot be read for another reason (the
    load itself says why)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    try:
        saved = load_casts.saved_dtypes(checkpoint_dir)
    except (FileChecksumError, RecordError) as exc:
        return _cause(exc)
    except Exception:  # noqa: BLE001 - reported by the load that follows
        return None
    tensors = [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]
    return load_casts.lossy_cast_error(load_casts.casts(tensors, saved))


def _refuse(checkpoint_dir: Any, cause: str | None) -> None:
    """Every rank raises the same error if any rank has a cause (:func:`_refusal`), before any
    rank reads tensor data (collective)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    def raise_as(_what: str, causes: dict[int, str]) -> BaseException:
        return load_error_type(CheckpointingException)(checkpoint_dir, causes, {})

    check(cause, f"loading {checkpoint_dir}", raise_as=raise_as)


def clear_load_errors(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(sharded_state_dict: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        rank = rank_and_size()[0]
        _refuse(checkpoint_dir, _refusal(sharded_state_dict, checkpoint_dir))
        report: tuple[str, dict[int, str]] | None = None
        failures: dict[int, Any] = {}
        result = None
        # A logging strictness: the mismatches are returned, then logged as one agreed line
        # on every rank (strictness.py) instead of upstream's per-rank warnings.
        call_args, call_kwargs, logging_strict = strictness.as_returning(
            original, (sharded_state_dict, checkpoint_dir, *args), kwargs)
        try:
            result = original(*call_args, **call_kwargs)
        except (CheckpointException, Exception) as exc:  # noqa: BLE001 - agreed below
            causes, failures = _report(exc, rank)
            newer = newer_writer_reason(checkpoint_dir)
            if newer is not None:
                causes = {r: newer for r in causes}
            report = (_class_path(exc), causes)
            _release_failed_load(exc)

        def raise_as(_what: str, reports: dict[int, tuple[str, dict[int, str]]]) -> BaseException:
            upstream = _upstream_class(reports[min(reports)][0])
            causes = attribute({r: causes for r, (_cls, causes) in reports.items()})
            return load_error_type(upstream)(checkpoint_dir, causes, failures)

        agree(False, report, f"loading {checkpoint_dir}", raise_as=raise_as)
        # The checkpoint a relaunch resumed from: where rerun/relaunch_bound.py counts.
        relaunch_bound.note_loaded(checkpoint_dir)
        if logging_strict is not None:
            result = strictness.report(checkpoint_dir, logging_strict, result)
        return result

    return load


def clear_newer_writer(original: Callable[..., Any]) -> Callable[..., Any]:
    """``load_common_state_dict`` (what a training flow reads first: the iteration, the
    arguments) names a checkpoint a newer megatron-core wrote, as ``load`` does. Rank-local
    like the original: the reason comes from the files, the same on every rank."""

    @functools.wraps(original)
    def load_common_state_dict(checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(checkpoint_dir, *args, **kwargs)
        except Exception as exc:
            newer = newer_writer_reason(checkpoint_dir)
            if newer is None:
                raise
            rank = rank_and_size()[0]
            raise load_error_type(type(exc))(checkpoint_dir, {rank: newer},
                                             {rank: (exc, None)}) from exc

    return load_common_state_dict


def _entry_point(attr: str, build: Callable[[Any], Any], why: str,
                 reads: tuple[str, ...] = ()) -> Patch:
    """A patch of one of ``dist_checkpointing``'s entry points (re-exported by the package)."""
    return Patch(name=f"load_errors.{attr}",
                 target="megatron.core.dist_checkpointing.serialization", attr=attr,
                 build=build, aliases=("megatron.core.dist_checkpointing",), why=why,
                 reads=reads)


PATCHES: tuple[Patch, ...] = (
    _entry_point("load", clear_load_errors,
                 "a failed load names the key, the rank and the cause, the same on every "
                 "rank; a template that would round saved values is refused",
                 reads=("megatron.core.dist_checkpointing.dict_utils:nested_values",
                        "megatron.core.dist_checkpointing.mapping:ShardedTensor",
                        "megatron.core.dist_checkpointing.core:CheckpointingException",
                        "megatron.core.dist_checkpointing.validation:StrictHandling",
                        "megatron.core.dist_checkpointing.validation:parse_strict_flag")),
    _entry_point("load_common_state_dict", clear_newer_writer,
                 "reading the common state of a checkpoint a newer megatron-core wrote says so "
                 "in one line (the training flow reads it before the load)"),
)
