"""A Megatron-style training loop around the package's fixes (used by ``scripts/train.py``).

Reading order: :mod:`.layout` (where checkpoints live and when they count), :mod:`.data` and
:mod:`.rng` (the state a bitwise resume needs besides the model), :mod:`.model`,
:mod:`.freeze` (gradual unfreezing: a structure change in the middle of a run),
:mod:`.rerun` (megatron-core's rerun state machine, as Megatron-LM drives it),
:mod:`.strategies` (the save/load strategies, built as Megatron-LM builds them),
:mod:`.checkpointing` (save/load through megatron-core's dist_checkpointing, every failure
agreed), :mod:`.loop` (the training loop, its exit codes and its one-line errors).
:mod:`.cpu_support` lets megatron-core's GPTModel and optimizer run on gloo.
"""
