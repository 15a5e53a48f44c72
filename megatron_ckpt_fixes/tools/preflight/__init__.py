"""Will this checkpoint load into this model? Answered before any tensor data is read.

``verify`` judges a checkpoint by its files alone: it cannot know what a model will ask of
it. A checkpoint that plain megatron-core saved without one parameter's optimizer state
verifies as OK and then fails to resume (megatron-core 0.16: ``KeyError ... not in state
dict``, wrapped in DCP's ``CheckpointException``), and only after the common state, and under
``--ckpt-verify-checksums`` every byte of the checkpoint, was read. The pre-flight compares
each rank's load template with the checkpoint's metadata, collectively:

    from megatron_ckpt_fixes.tools.preflight import check_loadable
    report = check_loadable(sharded_state_dict, ckpt_dir)   # every rank, its own template
    dist_checkpointing.load(sharded_state_dict, ckpt_dir)

Reading order: :mod:`.compare` (the rules: key, kind, shape, chunk, dtype), :mod:`.records`
(the checksum record: present, this save's, covering the requested items, the whole files
matching it), :mod:`.check` (the collective and its error). The project's trainer runs it
before the load under ``--ckpt-verify-checksums`` (:mod:`megatron_ckpt_fixes._dev.training`).
"""

from megatron_ckpt_fixes.tools.preflight.check import LoadableReport, check_loadable, requests_of

__all__ = ["LoadableReport", "check_loadable", "requests_of"]
