#!/usr/bin/env bash
# Everything the test suite needs beyond `pip install -e ".[test]"`, for the systems that no
# pip extra can express: TorchRec on CPU (the torchrec / fbgemm-gpu-cpu pair for the installed
# torch), TorchEasyRec's test dependencies (tzrec itself comes from its snapshot), NeMo
# Automodel 0.7.0 and what MLite's checkpoint module imports (MLite from its snapshot),
# nvidia-resiliency-ext's pure-Python async checkpointing (megatron-core >= 0.19's default
# async strategy; its wheels need a newer glibc than many machines have), and last the
# upstream source snapshots: ../shared/upstream when there, else each pinned commit fetched
# from GitHub (scripts/fetch_upstream_snapshots.py; one error line per commit it cannot get).
# Each step is its own script, idempotent, and says what it does; none touches torch or numpy.
# Installs into the environment of `python` on PATH (PYTHON=/path/to/python to choose).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/install_torchrec_cpu.sh"
bash "$here/install_tzrec_test_deps.sh"
bash "$here/install_nemo_automodel.sh"
bash "$here/install_nvrx_cpu.sh"
"${PYTHON:-python}" "$here/fetch_upstream_snapshots.py"
