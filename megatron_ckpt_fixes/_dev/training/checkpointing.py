"""Save and load everything a bitwise resume needs, through megatron-core's dist_checkpointing.

One :class:`Checkpointer` per job, following Megatron-LM's ``save_checkpoint`` /
``load_checkpoint`` (the strategies and what is kept between calls: :mod:`.strategies`):

- a checkpoint holds the sharded model and optimizer state, each rank's RNG states, the
  iteration, the data position and the rerun state machine's state (``state_dict`` /
  ``load_state_dict`` of the machine, the key present only when the machine emits it, as in
  Megatron-LM);
- a save is committed only when every rank has finalized it: the commit step is itself a
  collective, and only then does rank 0 publish the directory and the tracker
  (:mod:`.layout`). With ``--async-save`` the same commit runs as the last finalize function
  of megatron-core's ``AsyncCallsQueue``;
- every step a single rank can fail in (its own I/O, building its state dict, reading the
  checkpoint, restoring what was loaded) is agreed before the next collective
  (:mod:`megatron_ckpt_fixes.core.agreement`), so a failure on one rank is the same
  :class:`~.errors.CheckpointSaveError` / :class:`~.errors.CheckpointReadError` on every
  rank instead of a hang. A write that fails in megatron-core's writers is reported by
  upstream on the coordinator only (the other ranks get an empty ``CheckpointException``);
  the ``writer_failures`` feature agrees on the causes inside megatron-core's finalize,
  and without it (``--upstream-only``) they are agreed here, so every rank names them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.rerun_state_machine import RerunStateMachine
from torch.distributed.checkpoint import CheckpointException

from megatron_ckpt_fixes.core.agreement import check, describe_error, rank_and_size, run
from megatron_ckpt_fixes.fixes.checksums import verify_checkpoint
from megatron_ckpt_fixes.tools.preflight import check_loadable
from megatron_ckpt_fixes.fixes.writer_failures.outcome import WriteFailedError
from megatron_ckpt_fixes._dev.training import layout, rng
from megatron_ckpt_fixes._dev.training.args import missing_checkpoint
from megatron_ckpt_fixes._dev.training.errors import (CheckpointReadError, CheckpointSaveError,
    ConfigError)
from megatron_ckpt_fixes._dev.training.freeze import EmbeddingFreeze
from megatron_ckpt_fixes._dev.training.strategies import (
    CheckpointingContext,
    StrategyOptions,
    async_calls_queue,
    check_fully_parallel_load,
    load_strategy,
    resolve_async_strategy,
    save_strategy,
)

logger = logging.getLogger(__name__)

RERUN_KEY = "rerun_state_machine"


@dataclass
class TrainState:
    """What the loop owns besides model, optimizer and RNG: Megatron's iteration counter and
    data position (global batches consumed by *completed* steps)."""

    iteration: int = 0
    consumed_batches: int = 0


@dataclass(frozen=True)
class CheckpointOptions:
    save: Path | None
    load: Path | None
    strategy: StrategyOptions = field(default_factory=StrategyOptions)
    load_optim: bool = True
    load_rng: bool = True
    verify_checksums: bool = False
    strictness: str = "assume_ok_unexpected"  # --dist-ckpt-strictness
    require_checkpoint: bool = False  # --exit-on-missing-checkpoint


def _sharded_parts(model: Any, optimizer: MegatronOptimizer, *, optim: bool, rng_state: bool,
                   is_loading: bool) -> dict[str, Any]:
    model_sd = model.sharded_state_dict()
    parts: dict[str, Any] = {"model": model_sd}
    if optim:
        parts["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    if rng_state:
        parts[rng.RNG_KEY] = rng.sharded()
    return parts


def _write_failure(what: str, reports: dict[int, dict[int, str]]) -> CheckpointSaveError:
    """One error from what each rank knows of a failed write: megatron-core gives the
    coordinator every failing rank's cause and the other ranks none."""
    causes: dict[int, str] = {}
    for report in reports.values():
        causes.update(report)
    return CheckpointSaveError(what, causes or {r: "write failed (no cause reported)"
                                                for r in reports})


def _prepare_staging(staging: Path) -> None:
    """Rank 0 empties the save's staging directory (a leftover of a killed save of this
    iteration is incomplete by construction)."""
    if rank_and_size()[0] != 0:
        return
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)


class Checkpointer:
    """Megatron-style ``save``/``load`` of one training job."""

    def __init__(self, options: CheckpointOptions, freeze: EmbeddingFreeze | None = None) -> None:
        check_fully_parallel_load(options.strategy)
        self.options = options
        self.freeze = freeze
        self.context = CheckpointingContext()
        self.async_strategy = resolve_async_strategy(options.strategy)
        self.async_queue = (async_calls_queue(self.async_strategy)
                            if options.strategy.async_save else None)
        self._in_flight: str | None = None

    # -- save ---------------------------------------------------------------------------

    def save(self, state: TrainState, model: Any, optimizer: MegatronOptimizer,
             machine: RerunStateMachine, data_iterator: Any, fault: bool = False) -> None:
        """Save iteration ``state.iteration``; returns once scheduled (async) or committed.
        ``fault``: the rerun state machine asked for it (its log line says so)."""
        root = self.options.save
        assert root is not None, "save() needs --save"
        self.finalize(blocking=True)  # one save in flight at a time
        iteration = state.iteration
        staging = layout.staging_dir(root, iteration)
        what = f"saving iteration {iteration} to {staging}"
        run(functools.partial(_prepare_staging, staging), what, raise_as=CheckpointSaveError)
        sharded = run(lambda: self._state_to_save(state, model, optimizer, machine,
                                                  data_iterator),
                      what, raise_as=CheckpointSaveError)
        strategy, validate = save_strategy(self.options.strategy, self.context)
        kwargs = {} if self.async_strategy is None else {"async_strategy": self.async_strategy}
        request = dist_checkpointing.save(sharded, str(staging), strategy,
                                          validate_access_integrity=validate,
                                          async_sharded_save=True, **kwargs)
        request.add_finalize_fn(functools.partial(self._commit, root, iteration, fault))
        self._execute(request, what)

    def _state_to_save(self, state: TrainState, model: Any, optimizer: MegatronOptimizer,
                       machine: RerunStateMachine, data_iterator: Any) -> dict[str, Any]:
        sharded = _sharded_parts(model, optimizer, optim=True, rng_state=True, is_loading=False)
        sharded.update(
            iteration=state.iteration,
            consumed_batches=state.consumed_batches,
            world_size=dist.get_world_size(),
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        )
        rerun_state = machine.state_dict(data_iterator, self.options.strategy.ckpt_format)
        if rerun_state is not None:
            sharded[RERUN_KEY] = rerun_state
        return sharded

    def _execute(self, request: Any, what: str) -> None:
        """Run a save request (sync) or hand it to the async queue."""
        if self.async_queue is not None:
            self.async_queue.schedule_async_request(request)
            self._in_flight = what
            return
        with agreed_write_failure(what):
            request.execute_sync()

    @staticmethod
    def _commit(root: Path, iteration: int, fault: bool) -> None:
        # Every rank reaching this point has finalized its part; the collective proves that
        # all of them did before the tracker may name the checkpoint.
        check(None, f"finalizing the checkpoint of iteration {iteration}",
              raise_as=CheckpointSaveError)
        error = None
        if dist.get_rank() == 0:
            try:
                replaces = layout.iteration_dir(root, iteration).exists()
                logger.info("%s", saved_line(layout.publish(root, iteration), iteration,
                                             fault, replaces))
            except OSError as exc:
                error = describe_error(exc)
        check(error, f"publishing the checkpoint of iteration {iteration} in {root}",
              raise_as=CheckpointSaveError)

    def finalize(self, blocking: bool = False) -> None:
        """Finish async saves that are done (all of them when ``blocking``)."""
        if self.async_queue is None or self._in_flight is None:
            return
        with agreed_write_failure(self._in_flight):
            self.async_queue.maybe_finalize_async_calls(blocking=blocking)
        if not self.async_queue.get_num_unfinalized_calls():
            self._in_flight = None

    def close(self) -> None:
        if self.async_queue is not None:
            self.finalize(blocking=True)
            self.async_queue.close()

    # -- load ---------------------------------------------------------------------------

    def load(self, model: Any, optimizer: MegatronOptimizer,
             machine: RerunStateMachine) -> TrainState | None:
        """Load the checkpoint the tracker names; None when there is none yet (one warning;
        a :class:`~.errors.ConfigError` with ``require_checkpoint``)."""
        root = self.options.load
        assert root is not None, "load() needs --load"
        what = f"reading the checkpoint to resume from in {root}"
        found = run(functools.partial(_locate, root), what, raise_as=CheckpointReadError)
        if found is None:  # the same on every rank: read from the same tracker
            if self.options.require_checkpoint:
                raise ConfigError(missing_checkpoint(root))
            if dist.get_rank() == 0:
                logger.warning("%s: starting from scratch (--exit-on-missing-checkpoint "
                               "stops instead)", layout.no_checkpoint(root))
            return None
        ckpt, common = found
        what = f"loading {ckpt}"
        template = run(lambda: self._load_template(ckpt, common, model, optimizer, machine),
                       what, raise_as=CheckpointReadError)
        if self.options.verify_checksums:
            self._verify(template, ckpt)
        loaded = dist_checkpointing.load(template, ckpt,
                                         load_strategy(self.options.strategy, self.context, ckpt),
                                         strict=self.options.strictness)
        return run(lambda: self._restore(loaded, ckpt, model, optimizer, machine), what,
                   raise_as=CheckpointReadError)

    @staticmethod
    def _verify(template: dict, ckpt: str) -> None:
        """``--ckpt-verify-checksums``, collective: first the pre-flight (every requested key,
        shape, chunk and dtype, and the record: metadata only), then every item's bytes. A
        checkpoint that cannot load into this model, or cannot be checked (no record), raises
        the same error on every rank before any tensor data is read. Without the flag the
        load still checks every item it reads (checksums.reader)."""
        report = check_loadable(template, ckpt, checksums_required=True)
        summary = verify_checkpoint(ckpt, required=True)
        if dist.get_rank() == 0:
            logger.info("pre-flight of %s: %s", ckpt, report)
            logger.info("checksums of %s: %s", ckpt, summary)

    def _load_template(self, ckpt: str, common: dict[str, Any], model: Any,
                       optimizer: MegatronOptimizer, machine: RerunStateMachine) -> dict:
        saved_world, world = common["world_size"], dist.get_world_size()
        if self.options.load_rng and saved_world != world:
            raise ValueError(
                f"{ckpt} holds per-rank RNG states of {saved_world} ranks, this job has "
                f"{world}; resume with --no-load-rng to start fresh RNG streams")
        template = _sharded_parts(model, optimizer, optim=self.options.load_optim,
                                  rng_state=self.options.load_rng, is_loading=True)
        if self.freeze is not None and self.options.load_optim:
            self.freeze.prune_load_template(template["optimizer"], common["iteration"])
        saved_rerun = common.get(RERUN_KEY)
        if saved_rerun is not None:
            # The machine's state is per rank, like the RNG states: it loads only onto the same
            # number of ranks. An idle state has nothing to restore; a pending fault cannot move.
            if saved_world == world:
                template[RERUN_KEY] = machine.state_dict(None, self.options.strategy.ckpt_format,
                                                         force=True)
            elif machine.validate_state_dict(saved_rerun):
                raise ValueError(
                    f"{ckpt} is a fault checkpoint of {saved_world} ranks (rerun state "
                    f"{saved_rerun['state'].name}); only {saved_world} ranks can rerun its step")
        return template

    def _restore(self, loaded: dict[str, Any], ckpt: str, model: Any,
                 optimizer: MegatronOptimizer, machine: RerunStateMachine) -> TrainState:
        model.load_state_dict(loaded["model"])
        if self.options.load_optim:
            optimizer.load_state_dict(loaded["optimizer"])
        if self.options.load_rng:
            rng.restore(loaded[rng.RNG_KEY])
        if RERUN_KEY in loaded and machine.validate_state_dict(loaded[RERUN_KEY]):
            machine.load_state_dict(loaded[RERUN_KEY])
        if dist.get_rank() == 0:
            logger.info("loaded %s (iteration %d, saved with TP=%d)", ckpt,
                        loaded["iteration"], loaded["tensor_model_parallel_size"])
        return TrainState(loaded["iteration"], loaded["consumed_batches"])


def saved_line(path: Path, iteration: int, fault: bool, replaces: bool) -> str:
    """What a committed save logs. A fault checkpoint is taken before the step's update, at
    an iteration that may have its checkpoint already: it replaces that one."""
    what = "the fault checkpoint" if fault else "checkpoint"
    line = f"saved {what} {path}"
    if replaces:
        line += f": it replaces the checkpoint saved at iteration {iteration} before"
    if fault:
        line += (f" (the rerun state machine saves before step {iteration + 1}'s update; the "
                 "relaunched job reruns that step from it)")
    return line


def _locate(root: Path) -> tuple[str, dict[str, Any]] | None:
    """The checkpoint the tracker names and its common state; None without a tracker."""
    iteration = layout.read_tracker(root)
    if iteration is None:
        return None
    ckpt = str(layout.checkpoint_dir(root, iteration))
    return ckpt, dist_checkpointing.load_common_state_dict(ckpt)


@contextlib.contextmanager
def agreed_write_failure(what: str) -> Iterator[None]:
    """Turn megatron-core's failed write (a ``CheckpointException`` raised on every rank after
    its finalize broadcast, with the causes on the coordinator only) into one
    :class:`~.errors.CheckpointSaveError` naming every cause, on every rank."""
    try:
        yield
    except WriteFailedError as exc:  # agreed already (writer_failures): the same everywhere
        raise CheckpointSaveError(what, exc.causes) from exc
    except CheckpointException as exc:
        report = {rank: describe_error(error) for rank, (error, _trace) in exc.failures.items()}
        check(report, what, raise_as=_write_failure)
        raise  # not reached: check() raised on every rank
