"""The training loop: Megatron-LM's ``train``/``train_step`` shape, with its exit codes.

Per step (``train_step``): the rerun state machine decides whether to (re)run forward and
backward, validates the loss, and may then ask to checkpoint and exit: 16 (resume to
disambiguate: the job must be relaunched from this fault checkpoint, on another device) or 17
(validation failed). The optimizer steps only after that, so a fault checkpoint holds the
state from *before* the suspicious step, which the relaunched job reruns.

Between steps: save every ``--save-interval`` iterations, save and exit 0 at
``--exit-interval``, save at the end. Exit code 0 is a normal end.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.rerun_state_machine import RerunDataIterator, RerunStateMachine

import megatron_ckpt_fixes

from ..compat.device import backend_uses_cuda
from . import rerun, rng, snapshot
from .args import parse_args
from .checkpointing import Checkpointer, CheckpointOptions, TrainState
from .data import SyntheticTokens
from .model import (
    ModelShape,
    allreduce_data_parallel_grads,
    build_model,
    build_optimizer,
    data_parallel_mean,
    forward_loss,
)

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


def init_distributed() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))


def setup(args: Any) -> Job:
    if not args.no_install:
        megatron_ckpt_fixes.install(UPSTREAM_FEATURES if args.upstream_only else None)
    if not backend_uses_cuda():
        if args.clip_grad > 0:
            raise SystemExit("--clip-grad > 0 needs CUDA: megatron-core's "
                             "clip_grad_by_total_norm_fp32 asserts CUDA tensors")
        if not args.no_install:
            megatron_ckpt_fixes.install(["training.cpu_support"])
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size)
    rng.seed_all(args.seed)
    shape = ModelShape(args.num_layers, args.hidden_size, args.num_attention_heads,
                       args.vocab_size, args.seq_length)
    model = build_model(shape, args.tensor_model_parallel_size)
    optimizer = build_optimizer(model, args.lr, args.clip_grad)
    machine = rerun.init_machine(args.rerun_mode, args.error_injection_rate,
                                 args.error_injection_type, args.result_rejected_tracker_filename)
    checkpointer = Checkpointer(CheckpointOptions(
        save=args.save, load=args.load, ckpt_format=args.ckpt_format,
        assume_constant_structure=args.ckpt_assume_constant_structure,
        async_save=args.async_save, load_optim=not args.no_load_optim,
        load_rng=not args.no_load_rng, verify_checksums=args.ckpt_verify_checksums))
    state = (checkpointer.load(model, optimizer, machine) if args.load else None) or TrainState()
    data = RerunDataIterator(SyntheticTokens(
        seed=args.seed, vocab_size=args.vocab_size, seq_length=args.seq_length,
        global_batch_size=args.global_batch_size,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        position=state.consumed_batches))
    return Job(args, model, optimizer, machine, checkpointer, state, data)


def train_step(job: Job) -> tuple[float | None, int | None]:
    """One step. Returns (reported loss, exit code or None to go on)."""
    args, machine = job.args, job.machine
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
            _save(job)
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


def _save(job: Job) -> int:
    job.checkpointer.save(job.state, job.model, job.optimizer, job.machine, job.data)
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
        if args.save is not None and args.save_interval and state.iteration % args.save_interval == 0:
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


def _dump(job: Job) -> None:
    full = snapshot.full_state(job.model, job.optimizer)
    if dist.get_rank() == 0:
        torch.save({"iteration": job.state.iteration, "tensors": full}, job.args.dump_state)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format=f"[rank{os.environ.get('RANK', '?')}] %(levelname)s %(name)s: "
                               "%(message)s")
    logging.getLogger("megatron_ckpt_fixes.training").setLevel(logging.INFO)
    init_distributed()
    try:
        job = setup(args)
        code = train(job)
        job.checkpointer.close()
        if code == 0 and args.dump_state is not None:
            _dump(job)
        return code
    finally:
        dist.destroy_process_group()
