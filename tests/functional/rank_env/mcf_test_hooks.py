"""Test-only behaviour patched into the ranks of ``scripts/train.py`` (see ``sitecustomize``).

The library carries no test switches; the functional tests put this directory on the ranks'
``PYTHONPATH`` and ask for a hook by environment variable:

- ``MCF_TEST_KILL_DURING_SAVE_ITER=N``: rank 1 SIGKILLs itself in the save of iteration N,
  after writing its shards and before the save is finalized (megatron-core's finalize
  functions, then the commit, never run on it);
- ``MCF_TEST_DUMP_STATE=PATH``: when the job ends normally, rank 0 writes the full
  (tensor-parallel-gathered) weights and Adam state to PATH, so runs with different TP sizes
  can be compared bitwise.

With ``TORCHDYNAMO_DISABLE=1`` (the jobs' environment), ``torch.compile`` returns the
function it is given, as in Megatron-LM's ranks (``scripts/mcore_suite/eager_compile.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts" / "mcore_suite"))
import eager_compile  # noqa: E402

KILL_DURING_SAVE_ENV = "MCF_TEST_KILL_DURING_SAVE_ITER"
DUMP_STATE_ENV = "MCF_TEST_DUMP_STATE"

logger = logging.getLogger(__name__)


# -- full state (for exact checks) ---------------------------------------------------------

def _full(tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().cpu().clone()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim).cpu()


def full_state(model: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``, identical for any TP size.

    Collective over the tensor-parallel group: call on every rank.
    """
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    states = {p: opt.optimizer.state[p] for opt in inner for p in opt.get_parameters()}
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        out[f"param/{name}"] = _full(param, param)
        for key in ("exp_avg", "exp_avg_sq"):
            if key in states.get(param, {}):
                out[f"{key}/{name}"] = _full(states[param][key], param)
    return out


def _dump_after(run_job: Any, path: str) -> Any:
    @functools.wraps(run_job)
    def run(job: Any) -> int:
        code = run_job(job)
        if code == 0:
            full = full_state(job.model, job.optimizer)
            if dist.get_rank() == 0:
                torch.save({"iteration": job.state.iteration, "tensors": full}, path)
        return code

    return run


# -- SIGKILL mid-save ------------------------------------------------------------------------

def _sigkill_self() -> None:
    logger.warning("%s: rank %d kills itself mid-save", KILL_DURING_SAVE_ENV, dist.get_rank())
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_in(execute: Any, iteration: int) -> Any:
    @functools.wraps(execute)
    def run(self: Any, request: Any, what: str) -> None:
        if f"saving iteration {iteration} " in what and dist.get_rank() == 1:
            # Runs after this rank's shards are written, before the metadata is finalized.
            request.finalize_fns.insert(0, _sigkill_self)
        execute(self, request, what)

    return run


def install() -> None:
    """Patch the requested hooks into the training package (called at interpreter start)."""
    eager_compile.install()
    kill, dump = os.environ.get(KILL_DURING_SAVE_ENV), os.environ.get(DUMP_STATE_ENV)
    if kill is None and dump is None:
        return
    from megatron_ckpt_fixes._dev.training import checkpointing, loop

    if kill is not None:
        checkpointing.Checkpointer._execute = _kill_in(checkpointing.Checkpointer._execute,
                                                       int(kill))
    if dump is not None:
        loop.run_job = _dump_after(loop.run_job, dump)
