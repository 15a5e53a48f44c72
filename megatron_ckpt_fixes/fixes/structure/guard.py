"""The decision to replan: did the structure change on any rank since the last save?

One guard lives on each caching strategy object. Before a cached plan may be reused, every
rank compares its signature with the one from its previous save and all ranks agree in one
tiny collective (:func:`megatron_ckpt_fixes.core.agreement.agree`). A change on a single rank
therefore makes every rank replan; a rank that cannot even describe its state dict makes
every rank raise the same error instead of leaving the others in a collective. A save that
failed on a rank counts as a change at that rank's next save, so after a failure on any rank
every rank drops its caches together (a rank-local reset would leave the others reusing
plans that the failed rank no longer has).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from megatron_ckpt_fixes.core.agreement import agree, rank_and_size
from megatron_ckpt_fixes.fixes.structure.signature import StructureSignature, compute_signature

logger = logging.getLogger(__name__)


@dataclass
class StructureGuard:
    """Remembers the last saved structure of one rank, and whether that save failed."""

    previous: StructureSignature | None = None
    failed: bool = False

    def should_replan(self, sharded_state_dict: Any, what: str, group: Any = None,
                      log_level: int = logging.WARNING) -> bool:
        """Collective: True on every rank iff some rank's structure changed since its last
        save, or its last save failed.

        The first save of a guard has nothing to compare with and reports no change: the
        strategy's caches are then empty, or hold metadata loaded from a checkpoint, whose
        reuse megatron-core verifies against a freshly built plan.
        """
        error: str | None = None
        current: StructureSignature | None = None
        changed = self.failed
        try:
            current = compute_signature(sharded_state_dict)
            changed |= self.previous is not None and self.previous.digest != current.digest
        except Exception as exc:  # reported collectively below, then raised on every rank
            error = f"cannot describe the sharded state dict: {type(exc).__name__}: {exc}"
        rank = rank_and_size(group)[0]
        if changed and self.failed:
            logger.log(log_level, "rank %d: the previous save failed; dropping cached save "
                                  "plans and replanning on every rank", rank)
        elif changed:
            assert self.previous is not None and current is not None
            logger.log(
                log_level,
                "rank %d: sharded state dict structure changed since the previous save "
                "(%s); dropping cached save plans and replanning on every rank",
                rank, self.previous.diff(current).summary(),
            )
        replan = agree(changed, error, what, group)
        if replan and not changed:
            logger.log(min(log_level, logging.INFO), "another rank's structure changed or its "
                                                     "save failed; replanning")
        self.previous = current
        self.failed = False
        return replan

    def save_failed(self) -> None:
        """Nothing cached can be trusted after a failed save: the next save replans on every
        rank (agreed at that save, see :meth:`should_replan`)."""
        self.failed = True
