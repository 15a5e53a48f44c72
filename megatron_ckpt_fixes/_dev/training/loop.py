"""The training loop: Megatron-LM's ``train``/``train_step`` shape, with its exit codes.

Per step (``train_step``): the rerun state machine decides whether to (re)run forward and
backward, validates the loss, and may then ask to checkpoint and exit: 16 (resume to
disambiguate: the job must be relaunched from this fault checkpoint, on another device) or 17
(validation failed). The optimizer steps only after that, so a fault checkpoint holds the
state from *before* the suspicious step, which the relaunched job reruns.

Between steps: save every ``--save-interval`` iterations, save and exit 0 at
``--exit-interval``, save at the end. Exit code 0 is a normal end.

A job that cannot go on (an unreadable checkpoint, a failed save, flags it cannot run with)
ends with exit code 1 and one line per cause: an error every rank raised identically (agreed
by the package) is printed once for the job, by rank 0; any other error by each rank that
raised it; a line that would be longer than a screen lists the first keys and a count
(:mod:`megatron_ckpt_fixes.core.messages`). The traceback is printed only with ``--verbose`` (or
``MEGATRON_CKPT_FIXES_VERBOSE=1``, or logging at DEBUG). Bad flags end earlier, in
:mod:`.args` (exit code 2). A CPU job that lacks ``training.cpu_support`` (zero-code
activation without it) is told so before megatron-core's first CUDA call.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.rerun_state_machine import RerunDataIterator, RerunStateMachine
from torch.distributed.checkpoint import CheckpointException

import megatron_ckpt_fixes

from megatron_ckpt_fixes.core.agreement import AgreementError, describe_error
from megatron_ckpt_fixes.fixes.checksums.load import ChecksumError
from megatron_ckpt_fixes.compat.device import backend_uses_cuda
from megatron_ckpt_fixes.core.errors import MegatronCkptFixesError, UnsupportedVersionError
from megatron_ckpt_fixes.fixes.load_errors import CheckpointLoadError
from megatron_ckpt_fixes.core.messages import shorten
from megatron_ckpt_fixes.fixes.structure.integrity import ShardingValidationError
from megatron_ckpt_fixes.core.verbosity import verbose_requested
from megatron_ckpt_fixes._dev.training import rerun, rng
from megatron_ckpt_fixes._dev.training.args import parse_args
from megatron_ckpt_fixes._dev.training.checkpointing import (Checkpointer, CheckpointOptions,
    TrainState)
from megatron_ckpt_fixes._dev.training.data import SyntheticTokens
from megatron_ckpt_fixes._dev.training.errors import ConfigError
from megatron_ckpt_fixes._dev.training.freeze import EmbeddingFreeze
from megatron_ckpt_fixes._dev.training.model import (
    ModelShape,
    allreduce_data_parallel_grads,
    build_model,
    build_optimizer,
    data_parallel_mean,
    forward_loss,
)
from megatron_ckpt_fixes._dev.training.strategies import StrategyOptions

logger = logging.getLogger(__name__)

#: Features for ``--upstream-only``: megatron-core's own behaviour, made runnable on gloo.
UPSTREAM_FEATURES = ("compat.cpu", "compat.rerun_device")


@dataclass
class Job:
    """Everything one launch trains with."""

    args: Any
    model: Any
    optimizer: Any
    machine: RerunStateMachine
    checkpointer: Checkpointer
    state: TrainState
    data: RerunDataIterator
    freeze: EmbeddingFreeze | None = None


def init_distributed() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))


def checkpoint_options(args: Any) -> CheckpointOptions:
    return CheckpointOptions(
        save=args.save, load=args.load, load_optim=not args.no_load_optim,
        load_rng=not args.no_load_rng, verify_checksums=args.ckpt_verify_checksums,
        strictness=args.dist_ckpt_strictness,
        require_checkpoint=args.exit_on_missing_checkpoint,
        strategy=StrategyOptions(
            ckpt_format=args.ckpt_format,
            assume_constant_structure=args.ckpt_assume_constant_structure,
            fully_parallel_save=args.ckpt_fully_parallel_save,
            fully_parallel_load=args.ckpt_fully_parallel_load,
            async_save=args.async_save, async_strategy=args.async_strategy))


#: What a CPU job without ``training.cpu_support`` is told (megatron-core's training code
#: would stop at its first CUDA call with ``Torch not compiled with CUDA enabled``).
CPU_SUPPORT_NEEDED = (
    "this job runs on CPU (gloo) and training.cpu_support is not installed: megatron-core's "
    "model and optimizer code call CUDA; with --no-install, add it to the activation "
    "(MEGATRON_CKPT_FIXES=default,training.cpu_support or megatron-ckpt-fixes run --features "
    "default,training.cpu_support), or drop --no-install")


def setup(args: Any) -> Job:
    if not args.no_install:
        megatron_ckpt_fixes.install(UPSTREAM_FEATURES if args.upstream_only else None)
    if not backend_uses_cuda():
        if args.clip_grad > 0:
            raise ConfigError("--clip-grad > 0 needs CUDA: megatron-core's "
                              "clip_grad_by_total_norm_fp32 asserts CUDA tensors")
        if not args.no_install:
            megatron_ckpt_fixes.install(["training.cpu_support"])
        if "training.cpu_support" not in megatron_ckpt_fixes.installed_features():
            raise ConfigError(CPU_SUPPORT_NEEDED)
    if args.ckpt_fully_parallel_save_deprecated and dist.get_rank() == 0:
        print("--ckpt-fully-parallel-save flag is deprecated and has no effect. Use "
              "--no-ckpt-fully-parallel-save to disable parallel save.", flush=True)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size)
    rng.seed_all(args.seed)
    shape = ModelShape(args.num_layers, args.hidden_size, args.num_attention_heads,
                       args.vocab_size, args.seq_length)
    model = build_model(shape, args.tensor_model_parallel_size)
    optimizer = build_optimizer(model, args.lr, args.clip_grad)
    freeze = (None if args.freeze_embedding_until is None
              else EmbeddingFreeze.of(model, args.freeze_embedding_until))
    machine = rerun.init_machine(args.rerun_mode, args.error_injection_rate,
                                 args.error_injection_type, args.result_rejected_tracker_filename)
    checkpointer = Checkpointer(checkpoint_options(args), freeze)
    state = (checkpointer.load(model, optimizer, machine) if args.load else None) or TrainState()
    data = RerunDataIterator(SyntheticTokens(
        seed=args.seed, vocab_size=args.vocab_size, seq_length=args.seq_length,
        global_batch_size=args.global_batch_size,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        position=state.consumed_batches))
    return Job(args, model, optimizer, machine, checkpointer, state, data, freeze)


def train_step(job: Job) -> tuple[float | None, int | None]:
    """One step. Returns (reported loss, exit code or None to go on)."""
    args, machine = job.args, job.machine
    if job.freeze is not None:
        job.freeze.before_step(job.state.iteration + 1, job.optimizer)
    loss = None
    while machine.should_run_forward_backward(job.data):
        job.optimizer.zero_grad()
        loss = forward_loss(job.model, next(job.data))
        rerun.validate_loss(machine, loss, args.check_for_nan_in_loss_and_grad,
                            args.check_for_spiky_loss)
        loss.backward()
        allreduce_data_parallel_grads(job.model)
    reported = data_parallel_mean(loss) if loss is not None else None
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
    if should_checkpoint:
        if args.save is None:
            logger.error("the rerun state machine asks for a checkpoint but there is no --save: "
                         "a relaunch cannot rerun this step")
        else:
            _save(job, fault=True)
    if should_exit:
        return reported, exit_code
    job.optimizer.step()
    return reported, None


def _log_step(job: Job, iteration: int, loss: float | None, exit_code: int | None) -> None:
    """Megatron's per-iteration line; with --log-file also one JSON line per step outcome."""
    if dist.get_rank() != 0:
        return
    state = job.machine.state.name
    text = "n/a" if loss is None else f"{loss:.6E} ({loss.hex()})"
    suffix = "" if exit_code is None else f" | exit code {exit_code}"
    print(f" iteration {iteration:8d}/{job.args.train_iters:8d} | lm loss: {text} | "
          f"rerun state: {state}{suffix}", flush=True)
    if job.args.log_file is not None and loss is not None:
        record = {"iteration": iteration, "loss": loss.hex(), "rerun_state": state,
                  "exit_code": exit_code}
        with open(job.args.log_file, "a") as f:
            f.write(json.dumps(record) + "\n")


def _save(job: Job, fault: bool = False) -> int:
    job.checkpointer.save(job.state, job.model, job.optimizer, job.machine, job.data, fault)
    return job.state.iteration


def train(job: Job) -> int:
    args, state = job.args, job.state
    if dist.get_rank() == 0:
        print(f" starting at iteration {state.iteration} (rerun state "
              f"{job.machine.state.name})", flush=True)
    saved_at = state.iteration if args.load else None
    while state.iteration < args.train_iters:
        job.checkpointer.finalize(blocking=False)
        loss, exit_code = train_step(job)
        _log_step(job, state.iteration + 1, loss, exit_code)
        if exit_code is not None:
            return exit_code
        state.iteration += 1
        state.consumed_batches += 1
        if args.save is not None and args.save_interval \
                and state.iteration % args.save_interval == 0:
            saved_at = _save(job)
        if args.exit_interval and state.iteration % args.exit_interval == 0:
            if args.save is not None and saved_at != state.iteration:
                _save(job)
            if dist.get_rank() == 0:
                print(f" exiting at iteration {state.iteration} (--exit-interval)", flush=True)
            return 0
    if args.save is not None and saved_at != state.iteration:
        _save(job)
    return 0


#: Errors every rank raises identically (agreed, or decided from the same inputs): the job
#: prints them once. Any other error is printed by each rank that raised it.
SAME_ON_EVERY_RANK: tuple[type[BaseException], ...] = (
    AgreementError, ChecksumError, CheckpointLoadError, ShardingValidationError, ConfigError,
    UnsupportedVersionError)


def report_error(exc: BaseException, verbose: bool) -> None:
    """Print why the job stops, one line per cause; the traceback only when asked for."""
    rank = os.environ.get("RANK", "0")
    if verbose or logging.getLogger().isEnabledFor(logging.DEBUG):
        traceback.print_exception(exc)
    if isinstance(exc, SAME_ON_EVERY_RANK):
        if rank == "0":
            print(shorten(f"train.py: error: {describe_error(exc)}"), file=sys.stderr,
                  flush=True)
    else:
        # The prefix counts: the whole line fits the limit, whichever key comes first.
        print(shorten(f"train.py: error on rank {rank}: {describe_error(exc)}"),
              file=sys.stderr, flush=True)


def run_job(job: Job) -> int:
    code = train(job)
    job.checkpointer.close()
    return code


class _OneLineFormatter(logging.Formatter):
    """Log records without the tracebacks libraries attach to handled errors (torch DCP
    logs one per rank when a checkpoint lacks its ``.metadata``); ``--verbose`` keeps them."""

    def format(self, record: logging.LogRecord) -> str:
        plain = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None,
                                       "stack_info": None})
        return super().format(plain)


def configure_logging(verbose: bool) -> None:
    handler = logging.StreamHandler()
    fmt = f"[rank{os.environ.get('RANK', '?')}] %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt) if verbose else _OneLineFormatter(fmt))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("megatron_ckpt_fixes._dev.training").setLevel(logging.INFO)
    # "loading ... without checking its bytes": a resume from a checkpoint without checksums
    logging.getLogger("megatron_ckpt_fixes.fixes.checksums.reader").setLevel(logging.INFO)


def main(args: Any = None) -> int:
    """Run one launch of the job; ``args`` parsed already, or None to parse ``sys.argv``.

    A job that cannot go on returns 1 after printing why (:func:`report_error`).
    """
    args = parse_args() if args is None else args
    verbose = verbose_requested(args.verbose)
    configure_logging(verbose)
    init_distributed()
    try:
        return run_job(setup(args))
    except (Exception, MegatronCkptFixesError, CheckpointException) as exc:
        report_error(exc, verbose)
        return 1
    finally:
        dist.destroy_process_group()
