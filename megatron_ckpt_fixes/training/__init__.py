"""A Megatron-style training loop around the package's fixes (used by ``scripts/train.py``).

Reading order: :mod:`.layout` (where checkpoints live and when they count), :mod:`.data` and
:mod:`.rng` (the state a bitwise resume needs besides the model), :mod:`.model`,
:mod:`.rerun` (megatron-core's rerun state machine, as Megatron-LM drives it),
:mod:`.checkpointing` (save/load through megatron-core's dist_checkpointing),
:mod:`.loop` (the training loop and its exit codes). :mod:`.cpu_support` lets megatron-core's
GPTModel and optimizer run on gloo; :mod:`.snapshot` dumps full tensors for tests.
"""
