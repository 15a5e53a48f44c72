"""One thin module per system over the shared core (placement arithmetic in ``dtensor``,
value-aware resharding in ``reshard``, agreement, checksums): megatron-core's DTensor helpers,
Megatron-LM's training package, MLite, NeMo Automodel, TorchRec, TorchEasyRec and
nvidia-resiliency-ext."""
