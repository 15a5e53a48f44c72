"""Rerun state machine checkpointing: the always-present sentinel ShardedObject
(:mod:`.sentinel`), the determinism-stats report (:mod:`.stats_report`), and no checkpoint
after a transient fault (:mod:`.transient_fault`)."""

from megatron_ckpt_fixes.fixes.rerun.sentinel import RERUN_STATE_KEY

__all__ = ["RERUN_STATE_KEY"]
