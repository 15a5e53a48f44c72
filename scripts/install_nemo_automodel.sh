#!/usr/bin/env bash
# NeMo Automodel 0.7.0 on CPU next to torch 2.13.0+cpu, for the dtensor.nemo_automodel tests;
# also what MLite's checkpoint module imports beyond torch (safetensors, numpy), for the
# dtensor.mlite tests (MLite itself comes from its snapshot, see scripts/upstream_snapshots.py).
#
# nemo-automodel's declared requirements pull CUDA packages (quack-kernels -> cuda-python,
# nvidia-cutlass-dsl, megatron-fsdp, torchao, ...) that its state-dict adapters and its
# Checkpointer never import, so it is installed without them (line 1). Its adapters import
# transformers, pinned to the release 0.7.0 was built against; transformers 5.18.0 pulls only
# pure-Python packages (huggingface_hub, tokenizers, safetensors, ...), never torch (check:
# `pip install --dry-run transformers==5.18.0`). Idempotent: run it again and pip finds
# everything satisfied. Use the pip of the environment to install into (default: the `pip`
# on PATH; PIP="python -m pip" to choose).
set -euo pipefail
PIP=${PIP:-pip}
$PIP install --no-deps nemo-automodel==0.7.0
$PIP install transformers==5.18.0 safetensors "numpy<2.5"
