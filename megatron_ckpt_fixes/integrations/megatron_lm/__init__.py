"""Fixes inside Megatron-LM's training package (``megatron.training``), applied when it is
imported: :mod:`.rng_state` (each rank's own RNG states in its checkpoints)."""
