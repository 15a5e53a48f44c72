#!/usr/bin/env bash
# The fixes' own tests on CUDA/NCCL, for a machine with GPUs. Not part of CI (CI has no GPU)
# and nothing depends on it; last run on one H200 (single-process tests only:
# docs/compatibility.md, Known limits; docs/development.md, The GPU check).
#
#   bash scripts/gpu_check.sh                     # the python3 on PATH holds a CUDA torch
#   MCF_WHEELS=.whl bash scripts/gpu_check.sh     # + wheels to install offline (megatron-core,
#                                                 #   xxhash, transformer-engine, ...), --no-deps
# The MLite wiring tests read the snapshots (MCF_UPSTREAM_SNAPSHOTS: its folder needs only
# SHA256SUMS, with ../megatron-lite beside it); the NeMo Automodel ones need nemo-automodel
# 0.7.0 and transformers 5.18.0 among the wheels.
#
# The test ranks' process groups are "cpu:gloo,cuda:nccl" (MCF_TEST_BACKEND, read by
# megatron_ckpt_fixes._dev.testing and the tests' single-rank fixture), each rank on its own GPU:
# CPU tensors go over gloo as in CI, every CUDA tensor over NCCL, and the package's CPU
# stand-ins step aside (collectives run on CUDA), so megatron-core's own CUDA code runs.
# What runs, by path or by marker, whatever of it exists in this checkout:
#   1. structure-signature agreement over NCCL: test_cached_structure.py, test_collective_errors.py,
#      test_pg_dist_cache.py, test_signature.py;
#   2. checksums (device tensors where the tests make them): test_checksum*.py;
#   3. the async snapshot with pinned buffers: test_*snapshot*.py, test_persistent_async.py;
#   4. DTensor helpers: test_dtensor_*.py;
#   5. every test marked `cuda` (pytest -m cuda), wherever it is.
# Multi-rank tests need one GPU per rank (NCCL refuses two ranks on one GPU): with fewer GPUs
# than 2, only the single-process tests of that selection run. Transformer Engine: where it
# is importable (install it from MCF_WHEELS), megatron-core takes its TE paths in these runs
# (its layers, fused kernels, TE's FP8 _extra_state); the first line says whether it was.
# Output: a summary line per step, and each step's pytest log in $OUT or .gpu-check/.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
logs=${OUT:-.gpu-check}
mkdir -p "$logs"

if [[ -n ${MCF_WHEELS:-} ]]; then
  site=$(mktemp -d)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    "$MCF_WHEELS"/*.whl || { echo "gpu_check: the wheels in $MCF_WHEELS do not install"; exit 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"  # the package from this tree

gpus=$("$PYTHON" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device (torch {torch.__version__}): nothing to check here")
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(len(names), file=sys.stdout)
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL "
      f"{'.'.join(map(str, torch.cuda.nccl.version()))}, {len(names)} GPU(s): {names}",
      file=sys.stderr)
EOF
) || exit 1
"$PYTHON" -c "import megatron.core, xxhash" 2>/dev/null \
  || { echo "gpu_check: megatron-core and xxhash must be importable (MCF_WHEELS=DIR of wheels)"; exit 1; }

export MCF_TEST_BACKEND="cpu:gloo,cuda:nccl"
selection=()
for pattern in tests/functional/test_cached_structure.py tests/functional/test_collective_errors.py \
               tests/functional/test_pg_dist_cache.py tests/unit/test_signature.py \
               tests/*/test_checksum*.py tests/*/test_*snapshot*.py \
               tests/functional/test_persistent_async.py tests/*/test_dtensor_*.py; do
  for path in $pattern; do [[ -e $path ]] && selection+=("$path"); done
done
if (( gpus < 2 )); then
  echo "gpu_check: $gpus GPU: the multi-rank tests need one GPU per rank; single-process tests only"
  selection=(); for path in tests/unit/test_signature.py tests/unit/test_dtensor_*.py \
                            tests/unit/test_checksum*.py tests/unit/test_*snapshot*.py; do
    [[ -e $path ]] && selection+=("$path"); done
fi

failed=0
step() {  # step NAME PYTEST-ARGS...: one pytest run, its log kept, one summary line
  local name=$1; shift
  "$PYTHON" -m pytest -q -p no:cacheprovider "$@" > "$logs/$name.log" 2>&1
  local code=$?
  # pytest's exit 5: nothing collected (no such tests in this checkout yet)
  (( code == 5 )) && { echo "gpu_check: $name: no tests"; return 0; }
  echo "gpu_check: $name: $(tail -1 "$logs/$name.log") (exit $code; $logs/$name.log)"
  (( code == 0 )) || failed=1
}

if te=$("$PYTHON" -c "import transformer_engine.pytorch as te; print(te.__version__)" 2>/dev/null); then
  echo "gpu_check: transformer-engine $te is importable: megatron-core takes its TE paths below"
else
  echo "gpu_check: transformer-engine is not importable: the runs below are without it"
fi
if (( ${#selection[@]} )); then step selection "${selection[@]}"; fi
# Collecting every test module needs every optional system (TorchRec, ...) importable: only
# when some test carries the marker.
if grep -rqs --include='*.py' "mark.cuda" tests; then step marked-cuda -m cuda tests
else echo "gpu_check: marked-cuda: no tests"; fi
exit $failed
