#!/usr/bin/env bash
# TorchRec on CPU next to the installed torch, for the managed-collision resharding tests.
#
# Which pair: FBGEMM's compiled operators load only into the torch minor they were built for,
# so scripts/torchrec_pair.py picks the torchrec / fbgemm-gpu-cpu pair from FBGEMM's own
# compatibility table (torch 2.13 -> 1.8, 2.14 -> 1.9; a newer torch: the pair whose table
# names it, else one error line and exit 1, nothing installed).
#
# Why two pip commands: torchrec's metadata asks for the GPU `fbgemm-gpu` package (whose import
# fails without libtorch_cuda.so), so a plain `pip install torchrec` (or a pip extra) cannot
# give a working set. Line 1 installs the two binary packages without their declared
# dependencies; line 2 installs torchrec's pure-Python dependencies (its METADATA: tensordict,
# torchmetrics==1.0.3, pyre-extensions, tqdm; fbgemm-gpu-cpu needs numpy), which pulls nothing
# GPU. numpy stays at the version already installed (a constraint, never a silent downgrade).
# Idempotent: run it again and pip finds everything satisfied. Installs into the environment of
# `python` on PATH (PYTHON=/path/to/python to choose).
set -euo pipefail
PYTHON=${PYTHON:-python}
here=$(cd "$(dirname "$0")" && pwd)
read -r torchrec fbgemm < <("$PYTHON" "$here/torchrec_pair.py") || exit 1
torch=$("$PYTHON" -c "from importlib.metadata import version; print(version('torch'))")
echo "install_torchrec_cpu.sh: torch $torch -> torchrec $torchrec + fbgemm-gpu-cpu $fbgemm" \
     "(FBGEMM's compatibility table)"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
if numpy=$("$PYTHON" -c "from importlib.metadata import version; print(version('numpy'))" \
           2>/dev/null); then
  echo "numpy==$numpy" > "$constraints"
  echo "install_torchrec_cpu.sh: keeping numpy $numpy"
fi
"$PYTHON" -m pip install --no-deps "torchrec==$torchrec" "fbgemm-gpu-cpu==$fbgemm"
echo "install_torchrec_cpu.sh: pip may now print an ERROR line \"torchrec $torchrec requires" \
     "fbgemm-gpu, which is not installed\": expected, fbgemm-gpu-cpu $fbgemm provides the same" \
     "fbgemm_gpu modules for CPU (pip cannot know that)"
"$PYTHON" -m pip install -c "$constraints" tensordict "torchmetrics==1.0.3" pyre-extensions tqdm numpy
