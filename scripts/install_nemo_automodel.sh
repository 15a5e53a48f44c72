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
# `pip install --dry-run transformers==5.18.0`), and leaves the installed numpy where it is.
# Idempotent: run it again and pip finds everything satisfied. Installs into the environment
# of `python` on PATH (PYTHON=/path/to/python to choose).
set -euo pipefail
PYTHON=${PYTHON:-python}
"$PYTHON" -m pip install --no-deps nemo-automodel==0.7.0
echo "install_nemo_automodel.sh: pip may now print an ERROR line \"nemo-automodel 0.7.0 requires" \
     "...\": expected, its CUDA requirements are left out on purpose (see the top of this script)"
"$PYTHON" -m pip install transformers==5.18.0 safetensors
