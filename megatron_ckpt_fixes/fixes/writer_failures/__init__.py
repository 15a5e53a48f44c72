"""No success without the bytes: a writer failure of any kind fails the save on every rank.

Reading order: :mod:`.processes` (a forked writer that dies: SIGKILL, the OOM killer) ->
:mod:`.threads` (a writer thread's exception: megatron-core's threaded writer, torch DCP's
``FileSystemWriter``) -> :mod:`.outcome` (every rank raises the same error naming every
failing rank and its cause; the coordinator's own metadata write cannot leave the others
waiting). A dead persistent worker: :mod:`megatron_ckpt_fixes.fixes.async_worker`.
"""

from megatron_ckpt_fixes.fixes.writer_failures import outcome, processes, threads

PATCHES = processes.PATCHES + threads.PATCHES + outcome.PATCHES
