"""Every rank learns a save's outcome with every cause, and the coordinator's own write
failing cannot leave the others waiting.

megatron-core's ``save_state_dict_async_finalize`` ends every torch_dist save (synchronous,
forked, persistent worker): each rank hands its write results (or its writers' failure) to
the coordinator; the coordinator writes ``.metadata`` (``FileSystemWriterAsync.finish``)
when no rank failed, then broadcasts one flag, and every rank raises
``CheckpointException`` when it is set. Two gaps:

- the causes stay on the coordinator: every other rank raises a ``CheckpointException``
  that names no rank and no cause (``CheckpointException ranks:dict_keys([])``);
- the coordinator's ``.metadata`` write (with this package, the checksum record's too)
  raises before the broadcast on ENOSPC or EIO: the coordinator leaves, the other ranks
  wait in the broadcast forever (with NCCL: until its timeout).

The patched finalize holds the coordinator's ``finish`` failure until upstream's finalize
has run its broadcast on every rank, then agrees on the outcome in one collective
(:mod:`megatron_ckpt_fixes.core.agreement`): every rank raises the same
:class:`WriteFailedError`, a ``CheckpointException`` like upstream's, naming each failing
rank and its cause. A finalize that returns is a save whose every writer reported its bytes
written and fsynced, and whose ``.metadata`` was written.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from megatron_ckpt_fixes.core.patching import Declared, Layer, Patch
from megatron_ckpt_fixes.core.rehearsal import as_rank_0
from megatron_ckpt_fixes.core.agreement import agree, describe_error, describe_failures
from megatron_ckpt_fixes.core.entry_points import WRITER_FINISH
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError
from megatron_ckpt_fixes.fixes.writer_failures.processes import writer_death_note

_SAVER = "megatron.core.dist_checkpointing.strategies.state_dict_saver"
_WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync"

_held = threading.local()  # .failures: the coordinator's finish failures of this finalize


class WriteFailedError(MegatronCkptFixesError, CheckpointException):
    """A save failed on some rank; raised identically on every rank, naming every failing
    rank and its cause. ``failures`` maps each failing rank to ``(exception, traceback)``
    as torch DCP's ``CheckpointException`` does (the traceback stays on the rank it
    happened on)."""

    def __init__(self, what: str, causes: dict[int, str]) -> None:
        self.summary = describe_failures(what, causes)
        CheckpointException.__init__(self, self.summary,
                                     {rank: (RuntimeError(cause), "")
                                      for rank, cause in causes.items()})
        self.causes = causes

    def __str__(self) -> str:
        return self.summary


@contextmanager
def _holding_finish_failures() -> Iterator[list[str]]:
    outer = getattr(_held, "failures", None)
    _held.failures = failures = []
    try:
        yield failures
    finally:
        _held.failures = outer


def held_finish(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``FileSystemWriterAsync.finish``: inside the patched finalize, a failure is held
    for the agreement instead of raised before upstream's broadcast."""

    @functools.wraps(original)
    def finish(self: Any, metadata: Any, results: Any) -> None:
        held = getattr(_held, "failures", None)
        if held is None:
            return original(self, metadata, results)
        try:
            return original(self, metadata, results)
        except Exception as exc:  # noqa: BLE001 - every rank raises it after the broadcast
            held.append(f"writing the checkpoint's metadata: {describe_error(exc)}")
            return None

    return finish


def _global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _report(exc: CheckpointException, group: Any) -> dict[int, str]:
    """The causes a failed finalize knows, by global rank: the coordinator knows every
    rank's reported failure, each rank how its own asynchronous writer process ended (a
    killed one reported nothing: upstream's cause is then ``results_queue should not be
    empty``)."""
    failures = exc.failures if isinstance(getattr(exc, "failures", None), dict) else {}
    causes = {_global(group, rank): describe_error(failure[0] if isinstance(failure, tuple)
                                                   else failure)
              for rank, failure in failures.items()}
    death = writer_death_note()
    if death is not None:
        causes[dist.get_rank()] = death
    return causes


def agreed_finalize(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``save_state_dict_async_finalize``: the outcome, agreed (see the module)."""

    @functools.wraps(original)
    def save_state_dict_async_finalize(storage_writer: Any, global_metadata: Any,
                                       dist_wrapper: Any, *args: Any, **kwargs: Any) -> None:
        group = dist_wrapper.group if dist_wrapper.use_dist else None
        report: dict[int, str] | None = None
        with _holding_finish_failures() as held:
            try:
                original(storage_writer, global_metadata, dist_wrapper, *args, **kwargs)
            except CheckpointException as exc:
                report = _report(exc, group)
        if held:
            report = {**(report or {}), dist.get_rank(): "; ".join(held)}
        what = f"saving {storage_writer.checkpoint_dir}"

        def raise_as(_what: str, reports: dict[int, dict[int, str]]) -> BaseException:
            causes: dict[int, str] = {}
            for known in reports.values():
                causes.update(known)
            for rank, known in reports.items():  # what a rank knows of itself comes first
                own = _global(group, rank)
                if own in known:
                    causes[own] = known[own]
            return WriteFailedError(what, causes or {_global(group, r): "write failed (no "
                                                     "cause reported)" for r in reports})

        if dist_wrapper.use_dist:
            agree(False, report, what, group, raise_as=raise_as)
        elif report is not None:
            raise raise_as(what, {0: report})

    return save_state_dict_async_finalize


class _Finished(Exception):
    """Ends a rehearsed finalize at its ``.metadata`` write, before any collective."""


class _Coordinator:
    """Stands for the writer and the process group of a one-rank save whose writes
    succeeded; its ``finish`` ends the finalize (what follows, the failure flag's broadcast,
    is a collective, which one rank rehearsing alone must never enter)."""

    is_coordinator = True
    use_dist = False

    def retrieve_write_results(self) -> list:
        return []

    def gather_object(self, results: Any) -> list:
        return [results]

    def finish(self, metadata: Any, results: Any) -> None:
        raise _Finished


def _finalize_problems() -> list[str]:
    """The coordinator's ``.metadata`` write happens inside the finalize (watched on a save
    whose writes succeeded), where the patched finalize holds its failure."""
    from megatron.core.dist_checkpointing.strategies import state_dict_saver

    coordinator = _Coordinator()
    finalize = inspect.unwrap(state_dict_saver.save_state_dict_async_finalize)
    with as_rank_0():
        try:
            finalize(coordinator, object(), coordinator)
        except _Finished:
            return []
        except Exception:  # noqa: BLE001 - it failed before the write
            pass
    return ["save_state_dict_async_finalize did not call the writer's finish on the "
            "coordinator: its metadata write would not be held"]


def _holders_by_name(module: str, name: str) -> tuple[str, ...]:
    """The imported megatron-core modules that hold ``module.name`` under its own name
    (``from ... import``): 0.16's ``strategies.torch`` does, 0.19's looks it up when it
    saves."""
    import importlib
    import sys

    importlib.import_module("megatron.core.dist_checkpointing.strategies.torch")
    original = getattr(importlib.import_module(module), name)
    return tuple(sorted(m for m, mod in list(sys.modules.items())
                        if m.startswith("megatron.core.") and m != module
                        and vars(mod).get(name) is original))


PATCHES: tuple[Declared, ...] = (
    Patch(
        name="writer_failures.outcome.finalize",
        target=_SAVER,
        attr="save_state_dict_async_finalize",
        build=agreed_finalize,
        aliases=_holders_by_name(_SAVER, "save_state_dict_async_finalize"),
        probes=(_finalize_problems,),
        why="a failed save raises the same error on every rank, naming every failing rank and "
            "its cause (upstream: the causes on the coordinator only)",
    ),
    Layer(
        name="writer_failures.outcome.finish",
        entry=WRITER_FINISH,
        build=held_finish,
        probes=(_finalize_problems,),
        why="the coordinator's metadata write failing (ENOSPC, EIO) fails the save on every "
            "rank instead of leaving the others in megatron-core's broadcast",
    ),
)
