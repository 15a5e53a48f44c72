"""Structure signature and signature-checked cached-plan saves.

Reading order: :mod:`.signature` (what a structure is) -> :mod:`.guard` (the collective
decision to replan) -> :mod:`.cached_save` and :mod:`.integrity` (where it enters megatron-core).
"""

from megatron_ckpt_fixes.fixes.structure.cached_save import PATCHES as _SAVE_PATCHES
from megatron_ckpt_fixes.fixes.structure.guard import StructureGuard
from megatron_ckpt_fixes.fixes.structure.integrity import PATCHES as _INTEGRITY_PATCHES
from megatron_ckpt_fixes.fixes.structure.signature import (StructureDiff, StructureSignature,
    compute_signature)

PATCHES = _SAVE_PATCHES + _INTEGRITY_PATCHES

__all__ = ["PATCHES", "StructureDiff", "StructureGuard", "StructureSignature",
           "compute_signature"]
