"""Structure changes that Megatron-LM's own flags cause inside a run, under the cached plan.

With ``--ckpt-assume-constant-structure`` megatron-core plans the first save and reuses the
plan for every later save of the job. Two things in ``megatron/training`` change what a
save holds in the middle of a job, and each becomes a scenario here: one of Megatron-LM's
own functional cases, with the flags that make the change fall under a warm cache (a save
before it), run with and without the fixes:

- :data:`FAULT_SAVE`: the rerun state machine's fault checkpoint. Before megatron-core 0.18
  its ``ShardedObject`` exists only while a fault is pending; the fault save reuses a plan
  made without it. With the case's own ``--dist-ckpt-strictness log_all`` the relaunch does
  not fail: Megatron-LM logs ``Unable to restore RerunMachine from checkpoint: 'sharded'``
  and the job exits 17 without rerunning the step: the diagnosis the fault was saved for is
  silently lost. (0.18 and later emit the object always: upstream works; asked of
  upstream by :func:`megatron_ckpt_fixes.fixes.rerun.sentinel.upstream_emits_sentinel`.)
- :data:`ADAM_STATE_LATER`: optimizer state that appears after the first save. With
  ``--fp16`` the dynamic loss scale starts at 2^32 and the first iterations overflow and are
  skipped: no optimizer step, no Adam state. A save in that phase plans without
  ``exp_avg``/``exp_avg_sq``, and every later save reuses that plan; the resume (CI's
  ``ckpt-resume`` flow, from the middle checkpoint) logs ``Unexpected keys (not found in
  the checkpoint)`` for every Adam moment and trains on with zeros, so its losses leave the
  uninterrupted run's. Every release.

Others looked at in ``megatron/training/checkpointing.py`` and found constant within a run:
the RNG states (one object per rank, every save), the optimizer's common state and
scheduler (common state, not planned), the metadata plugged in from the load strategy (its
reuse is verified against the new plan by megatron-core), and a change of sharding type or
parallelism (only between runs, where the first save plans anew).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from megatron_ckpt_fixes.fixes.rerun.sentinel import upstream_emits_sentinel

if TYPE_CHECKING:
    from run_case import CaseResult


@dataclass(frozen=True)
class Scenario:
    name: str
    case: str
    #: flags every job of the case gets (with ``--ckpt-assume-constant-structure``).
    flags: tuple[tuple[str, object], ...]
    change: str
    #: asks the installed megatron-core whether its own code handles the change (returns
    #: why, or None); None: no release does.
    upstream_handles: Callable[[], str | None] | None
    #: what plain upstream logs when the change is lost (in the job that loads).
    upstream_evidence: str
    #: what a job that loaded the change correctly logs, if anything (None: the bitwise
    #: comparison is the proof).
    diagnosis: str | None = None

    def kept(self, result: "CaseResult") -> tuple[bool, str]:
        """Whether the change survived the run of ``result`` (every job's logs, its
        bitwise comparisons), and what shows it, in a few words."""
        logs = "\n".join(result.logs(job) for job in result.job_dirs)
        if self.upstream_evidence in logs:
            return False, f"logged `{self.upstream_evidence}`"
        diagnosed = self.diagnosis is not None and self.diagnosis in logs
        if self.diagnosis is not None and not diagnosed:
            return False, f"the relaunch never logs `{self.diagnosis}`"
        compared = sum(len(c.iterations) for c in result.comparisons)
        differing = sum(len(c.differing) for c in result.comparisons)
        if not compared or differing:
            return False, f"{differing} of {compared} compared iterations differ"
        return True, ("rerun diagnosed; " if diagnosed else "") + \
            f"{compared} iterations bitwise"

    def upstream_fails(self) -> bool:
        """Whether the installed megatron-core, plain, loses it (asked of its behaviour)."""
        return self.upstream_handles is None or self.upstream_handles() is None


FAULT_SAVE = Scenario(
    name="fault-save",
    case="gpt3_mcore_reruns_persistent_1",
    flags=(("--save-interval", 1), ("--train-iters", 20)),
    change="the fault checkpoint holds the rerun state machine's ShardedObject; the saves "
           "before it did not",
    upstream_handles=upstream_emits_sentinel,
    upstream_evidence="Unable to restore RerunMachine from checkpoint: 'sharded'. Skipping.",
    diagnosis="Second rerun: unexpected result is not reproducible on a different GPU",
)

ADAM_STATE_LATER = Scenario(
    name="adam-state-later",
    case="gpt3_mcore_tp1_pp2_resume_torch_dist",
    flags=(("--save-interval", 10), ("--train-iters", 40)),
    change="with --fp16 the first iterations overflow and are skipped: the save at "
           "iteration 10 has no Adam state, the later ones have it",
    upstream_handles=None,
    upstream_evidence="Unexpected keys (for this rank): {'optimizer.state.exp_avg",
)

SCENARIOS: tuple[Scenario, ...] = (FAULT_SAVE, ADAM_STATE_LATER)
