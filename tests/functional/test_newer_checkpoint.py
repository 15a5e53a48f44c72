"""A checkpoint written by a newer megatron-core, loaded by one that cannot read it.

Newer releases (0.19.2 here) keep the common state as a ``common_state`` object inside the
torch_dist checkpoint and write no ``common.pt``; megatron-core 0.16.1 reads the common state
from ``common.pt`` only and ends, on every rank, with ``AttributeError: 'str' object has no
attribute 'iterdir'``. With ``install()`` every rank raises the same one line naming what
happened and what is missing (still an ``AttributeError`` for callers that catch it).

The newer layout is written with the installed release: saved with the ``common_state``
object exactly as 0.19's ``dist_checkpointing.save`` adds it, and ``common.pt`` removed where
this release writes one. A release that reads the object loads the checkpoint, fixes or not.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_ckpt_fixes._dev.testing import run_ranks, shared_temp_dir

WS = 2
ITERATION = 7


def _state(rank: int, value: float) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {"iteration": ITERATION,
            "w": ShardedTensor.from_rank_offsets("w", torch.full((2, 3), value), (0, rank, WS))}


def write_as_newer_release(rank: int, ckpt: str) -> None:
    """The layout a newer megatron-core writes: common state inside, no common.pt."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    sd = _state(rank, 1.0 + rank)
    if not _writes_common_object():
        sd["common_state"] = ShardedObject("common_state", {"iteration": ITERATION}, (1,), (0,),
                                           replica_id=rank)
    dc.save(sd, ckpt)
    dist.barrier()
    if rank == 0 and os.path.exists(os.path.join(ckpt, COMMON_STATE_FNAME)):
        os.remove(os.path.join(ckpt, COMMON_STATE_FNAME))
    dist.barrier()


def _writes_common_object() -> bool:
    """Whether this release's save puts the common state inside the checkpoint itself."""
    import inspect

    from megatron.core.dist_checkpointing import serialization

    return 'key="common_state"' in inspect.getsource(serialization.save)


def load_newer_worker(rank: int, ws: int, features: list[str] | None) -> dict:
    import megatron_ckpt_fixes
    from megatron.core import dist_checkpointing as dc

    megatron_ckpt_fixes.install(features)
    with shared_temp_dir() as root:
        ckpt = os.path.join(root, "iter_0000007")
        if rank == 0:
            os.makedirs(ckpt)
        dist.barrier()
        write_as_newer_release(rank, ckpt)
        try:
            loaded = dc.load(_state(rank, 0.0), ckpt)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcome = {"error": f"{type(exc).__name__}: {exc}",
                       "classes": [c.__name__ for c in type(exc).__mro__]}
        else:
            outcome = {"iteration": loaded["iteration"], "w": loaded["w"].tolist()}
    return outcome


def test_a_checkpoint_from_a_newer_release_is_one_clear_line_on_every_rank():
    upstream = [r.value for r in run_ranks(load_newer_worker, WS, ["compat.cpu"])]
    fixed = [r.value for r in run_ranks(load_newer_worker, WS, None)]
    if "error" not in upstream[0]:  # this release reads the common_state object itself
        assert all(u["iteration"] == ITERATION for u in upstream), upstream
        assert fixed == upstream
        return
    # The upstream twin: megatron-core 0.16.1's own failure, which names nothing.
    assert all(u["error"] == "AttributeError: 'str' object has no attribute 'iterdir'"
               for u in upstream), upstream
    ckpt_line = fixed[0]["error"]
    assert all(f["error"] == ckpt_line for f in fixed), fixed
    assert "\n" not in ckpt_line, ckpt_line
    assert ckpt_line.startswith("CheckpointLoadError: cannot load checkpoint ")
    assert "iter_0000007: written by a newer megatron-core" in ckpt_line
    assert "'common_state' object inside the torch_dist checkpoint" in ckpt_line
    assert "there is no common.pt" in ckpt_line
    assert all("AttributeError" in f["classes"] for f in fixed), fixed


def test_a_training_job_resuming_from_a_checkpoint_of_megatron_core_0_19(tmp_path, beside):
    """The training flow reads the common state first (``load_common_state_dict``: the
    iteration, the world size), before any load. A checkpoint that megatron-core 0.19.2's own
    save wrote through ``scripts/train.py`` (0.19.2 installed beside this environment), resumed
    with the installed release: a release that reads it resumes; one that cannot (0.16.1) ends
    with one line naming the checkpoint and the newer writer on every rank, where upstream's
    every rank ends with ``AttributeError: 'str' object has no attribute 'iterdir'``."""
    from training_runs import RANK_ENV, run_job

    from megatron_ckpt_fixes._dev.training import layout

    ckpt = tmp_path / "ckpt"
    job = ["--seed", "1237", "--tensor-model-parallel-size", "2"]
    newer = beside("megatron-core==0.19.2")["PYTHONPATH"]
    written = run_job(tmp_path, [*job, "--train-iters", "2", "--save", str(ckpt)],
                      env={"PYTHONPATH": os.pathsep.join([newer, str(RANK_ENV)])},
                      name="written-by-0.19.2")
    assert written.exit_codes == [0], written.output[-6000:]
    iteration = layout.iteration_dir(ckpt, 2)
    assert not (iteration / "common.pt").exists()  # 0.19's layout: common state inside

    resume = [*job, "--train-iters", "3", "--load", str(ckpt)]
    upstream = run_job(tmp_path, [*resume, "--upstream-only"], name="upstream")
    fixed = run_job(tmp_path, resume, name="fixed")
    if upstream.exit_codes == [0]:  # this release reads the common_state object itself
        assert fixed.exit_codes == [0], fixed.output[-6000:]
        assert list(fixed.losses()) == list(upstream.losses()) == [3]
        assert fixed.losses() == upstream.losses()
        return
    assert upstream.exit_codes == [1], upstream.output[-6000:]
    for rank in (0, 1):
        assert f"  rank {rank}: AttributeError: 'str' object has no attribute 'iterdir'\n" \
            in upstream.output, upstream.output[-6000:]
    assert fixed.exit_codes == [1], fixed.output[-6000:]
    errors = [line for line in fixed.output.splitlines() if line.startswith("train.py: error")]
    assert errors == [f"train.py: error: reading the checkpoint to resume from in {ckpt} "
                      "failed on 2 rank(s):"], fixed.output[-6000:]
    cause = (f"cannot load checkpoint {iteration}: written by a newer "
             "megatron-core: its common state is the 'common_state' object inside the "
             "torch_dist checkpoint and there is no common.pt")
    for rank in (0, 1):
        assert f"  rank {rank}: {cause}" in fixed.output, fixed.output[-6000:]
    assert "Traceback" not in fixed.output


def test_the_probe_agrees_with_what_this_release_writes():
    """The newer-writer line asks the release itself (a tiny checkpoint of the newer layout):
    a release whose save writes the ``common_state`` object reads one; 0.16.1 does not."""
    from megatron.core import dist_checkpointing

    from megatron_ckpt_fixes.fixes.newer_checkpoint import reads_common_object

    assert reads_common_object(dist_checkpointing.load_common_state_dict) \
        == _writes_common_object()
