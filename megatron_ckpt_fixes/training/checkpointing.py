"""Save and load everything a bitwise resume needs, through megatron-core's dist_checkpointing.

One :class:`Checkpointer` per job, like Megatron-LM's ``save_checkpoint``/``load_checkpoint``:

- the save strategy is built once and kept across saves, so
  ``--ckpt-assume-constant-structure`` (``TorchDistSaveShardedStrategy(cached_metadata=True)``)
  really reuses its cached plans from the third save on, as in Megatron-LM;
- a checkpoint holds the sharded model and optimizer state, each rank's RNG states, the
  iteration, the data position and the rerun state machine's state (``state_dict`` /
  ``load_state_dict`` of the machine, the key present only when the machine emits it, as in
  Megatron-LM);
- a save is committed only when every rank has finalized it: the commit step is itself a
  collective, and only then does rank 0 publish the directory and the tracker
  (:mod:`.layout`). With ``--async-save`` the same commit runs as the last finalize function
  of megatron-core's ``AsyncCallsQueue``.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.rerun_state_machine import RerunStateMachine

from ..agreement import check
from ..checksums import verify_checkpoint
from . import layout, rng

logger = logging.getLogger(__name__)

RERUN_KEY = "rerun_state_machine"

#: Dev/test only: the iteration whose save rank 1 dies in (SIGKILL), after writing its shards
#: and before the save is finalized.
KILL_DURING_SAVE_ENV = "MCF_TEST_KILL_DURING_SAVE_ITER"


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
    ckpt_format: str = "torch_dist"
    assume_constant_structure: bool = False
    async_save: bool = False
    load_optim: bool = True
    load_rng: bool = True
    verify_checksums: bool = False


def _sharded_parts(model: Any, optimizer: MegatronOptimizer, *, optim: bool, rng_state: bool,
                   is_loading: bool) -> dict[str, Any]:
    model_sd = model.sharded_state_dict()
    parts: dict[str, Any] = {"model": model_sd}
    if optim:
        parts["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    if rng_state:
        parts[rng.RNG_KEY] = rng.sharded()
    return parts


def _sigkill_self() -> None:
    logger.warning("%s: rank %d kills itself mid-save", KILL_DURING_SAVE_ENV, dist.get_rank())
    os.kill(os.getpid(), signal.SIGKILL)


class Checkpointer:
    """Megatron-style ``save``/``load`` of one training job."""

    def __init__(self, options: CheckpointOptions) -> None:
        if options.ckpt_format != "torch_dist":
            raise ValueError(f"--ckpt-format {options.ckpt_format} is not supported; "
                             "use torch_dist")
        self.options = options
        self.save_strategy = TorchDistSaveShardedStrategy(
            "torch_dist", 1, cached_metadata=options.assume_constant_structure)
        self.async_queue = AsyncCallsQueue() if options.async_save else None

    # -- save ---------------------------------------------------------------------------

    def save(self, state: TrainState, model: Any, optimizer: MegatronOptimizer,
             machine: RerunStateMachine, data_iterator: Any) -> None:
        """Save iteration ``state.iteration``; returns once scheduled (async) or committed."""
        root = self.options.save
        assert root is not None, "save() needs --save"
        self.finalize(blocking=True)  # one save in flight at a time
        staging = layout.staging_dir(root, state.iteration)
        if dist.get_rank() == 0:
            # A leftover of a killed save of this iteration is incomplete by construction.
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        dist.barrier()

        sharded = _sharded_parts(model, optimizer, optim=True, rng_state=True, is_loading=False)
        sharded.update(
            iteration=state.iteration,
            consumed_batches=state.consumed_batches,
            world_size=dist.get_world_size(),
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        )
        rerun_state = machine.state_dict(data_iterator, self.options.ckpt_format)
        if rerun_state is not None:
            sharded[RERUN_KEY] = rerun_state

        request = dist_checkpointing.save(sharded, str(staging), self.save_strategy,
                                          async_sharded_save=True)
        self._maybe_arm_kill(request, state.iteration)
        request.add_finalize_fn(functools.partial(self._commit, root, state.iteration))
        if self.async_queue is not None:
            self.async_queue.schedule_async_request(request)
        else:
            request.execute_sync()

    @staticmethod
    def _maybe_arm_kill(request: AsyncRequest, iteration: int) -> None:
        target = os.environ.get(KILL_DURING_SAVE_ENV)
        if target is not None and int(target) == iteration and dist.get_rank() == 1:
            # Runs after this rank's shards are written, before the metadata is finalized.
            request.finalize_fns.insert(0, _sigkill_self)

    @staticmethod
    def _commit(root: Path, iteration: int) -> None:
        # Every rank reaching this point has finalized its part; the collective proves that
        # all of them did before the tracker may name the checkpoint.
        check(None, f"checkpoint save of iteration {iteration}")
        if dist.get_rank() == 0:
            final = layout.publish(root, iteration)
            logger.info("saved checkpoint %s", final)
        dist.barrier()

    def finalize(self, blocking: bool = False) -> None:
        """Finish async saves that are done (all of them when ``blocking``)."""
        if self.async_queue is not None:
            self.async_queue.maybe_finalize_async_calls(blocking=blocking)

    def close(self) -> None:
        if self.async_queue is not None:
            self.async_queue.maybe_finalize_async_calls(blocking=True)
            self.async_queue.close()

    # -- load ---------------------------------------------------------------------------

    def load(self, model: Any, optimizer: MegatronOptimizer,
             machine: RerunStateMachine) -> TrainState | None:
        """Load the checkpoint the tracker names; None when there is none yet."""
        root = self.options.load
        assert root is not None, "load() needs --load"
        iteration = layout.read_tracker(root)
        if iteration is None:
            logger.info("no checkpoint in %s: starting from scratch", root)
            return None
        ckpt = str(layout.checkpoint_dir(root, iteration))
        if self.options.verify_checksums:
            # Collective: a mismatch raises the same ChecksumError on every rank.
            summary = verify_checkpoint(ckpt)
            if dist.get_rank() == 0:
                logger.log(logging.INFO if summary.status == "verified" else logging.WARNING,
                           "checksums of %s: %s", ckpt, summary)
        common = dist_checkpointing.load_common_state_dict(ckpt)
        saved_world = common["world_size"]
        if self.options.load_rng and saved_world != dist.get_world_size():
            raise RuntimeError(
                f"{ckpt} holds per-rank RNG states of {saved_world} ranks, this job has "
                f"{dist.get_world_size()}; resume with --no-load-rng to start fresh RNG streams")

        template = _sharded_parts(model, optimizer, optim=self.options.load_optim,
                                  rng_state=self.options.load_rng, is_loading=True)
        saved_rerun = common.get(RERUN_KEY)
        if saved_rerun is not None:
            # The machine's state is per rank, like the RNG states: it loads only onto the same
            # number of ranks. An idle state has nothing to restore; a pending fault cannot move.
            if saved_world == dist.get_world_size():
                template[RERUN_KEY] = machine.state_dict(None, self.options.ckpt_format,
                                                         force=True)
            elif machine.validate_state_dict(saved_rerun):
                raise RuntimeError(
                    f"{ckpt} is a fault checkpoint of {saved_world} ranks (rerun state "
                    f"{saved_rerun['state'].name}); only {saved_world} ranks can rerun its step")
        loaded = dist_checkpointing.load(template, ckpt)

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
