"""Rerun state machine checkpointing: the always-present sentinel ShardedObject
(:mod:`.sentinel`) and the determinism-stats report (:mod:`.stats_report`)."""

from .sentinel import RERUN_STATE_KEY

__all__ = ["RERUN_STATE_KEY"]
