"""Rerun state machine checkpointing: the always-present sentinel ShardedObject."""

from .sentinel import PATCHES, RERUN_STATE_KEY

__all__ = ["PATCHES", "RERUN_STATE_KEY"]
