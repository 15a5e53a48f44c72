#!/usr/bin/env bash
# TorchRec on CPU next to torch 2.13.0+cpu, for the managed-collision resharding tests.
#
# torchrec 1.8.0 runs with fbgemm-gpu-cpu 1.8.0, but torchrec's metadata asks for the GPU
# `fbgemm-gpu` package (whose import fails without libtorch_cuda.so), so a plain
# `pip install torchrec` (or a pip extra) cannot give a working set. Line 1 installs the two
# binary packages without their declared dependencies; line 2 installs torchrec's
# pure-Python dependencies (its METADATA: tensordict, torchmetrics==1.0.3, pyre-extensions,
# tqdm; fbgemm-gpu-cpu needs numpy), which pulls nothing GPU. Idempotent: run it again and
# pip finds everything satisfied. Use the pip of the environment to install into
# (default: the `pip` on PATH; PIP="python -m pip" to choose).
set -euo pipefail
PIP=${PIP:-pip}
$PIP install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0
$PIP install tensordict "torchmetrics==1.0.3" pyre-extensions tqdm "numpy<2.5"
