"""The decision to replan: did the structure change on any rank since the last save?

One guard lives on each caching strategy object. Before a cached plan may be reused, every
rank compares its signature with the one from its previous save and all ranks agree in one
tiny collective (:func:`megatron_ckpt_fixes.collective.agree`). A change on a single rank
therefore makes every rank replan; a rank that cannot even describe its state dict makes
every rank raise the same error instead of leaving the others in a collective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..collective import agree
from .signature import StructureSignature, compute_signature

logger = logging.getLogger(__name__)


@dataclass
class StructureGuard:
    """Remembers the last saved structure of one rank."""

    previous: StructureSignature | None = None

    def should_replan(self, sharded_state_dict: Any, what: str, group: Any = None,
                      log_level: int = logging.WARNING) -> bool:
        """Collective: True on every rank iff some rank's structure changed since last time.

        The first save of a guard has nothing to compare with and reports no change: the
        strategy's caches are then empty, or hold metadata loaded from a checkpoint, whose
        reuse megatron-core verifies against a freshly built plan.
        """
        error: str | None = None
        current: StructureSignature | None = None
        changed = False
        try:
            current = compute_signature(sharded_state_dict)
            changed = self.previous is not None and self.previous.digest != current.digest
        except Exception as exc:  # reported collectively below, then raised on every rank
            error = f"cannot describe the sharded state dict: {type(exc).__name__}: {exc}"
        if changed:
            assert self.previous is not None and current is not None
            logger.log(
                log_level,
                "rank %d: sharded state dict structure changed since the previous save "
                "(%s); dropping cached save plans and replanning on every rank",
                dist.get_rank() if dist.is_initialized() else 0,
                self.previous.diff(current).summary(),
            )
        replan = agree(changed, error, what, group)
        if replan and not changed:
            logger.log(min(log_level, logging.INFO), "another rank's structure changed; replanning")
        self.previous = current
        return replan

    def forget(self) -> None:
        """After a failed save nothing cached can be trusted; the next save starts afresh."""
        self.previous = None
