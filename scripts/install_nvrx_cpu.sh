#!/usr/bin/env bash
# nvidia-resiliency-ext's asynchronous checkpointing, for the tests on CPU (idempotent).
#
# megatron-core 0.19+ needs nvidia-resiliency-ext >= 0.6.0 for --async-strategy nvrx; its
# only Linux wheels are tagged manylinux_2_39 (glibc 2.39), so pip will not install them on
# an older glibc (Debian 12: 2.36). Its checkpointing code is pure Python: this unpacks the
# wheel (no dependencies: the async checkpointing needs none beyond torch) into
# .venv-nvrx-cpu/py<major>.<minor>/ beside the repository's venvs (the wheel holds one module
# compiled for its CPython), for tests/functional/test_nvrx_snapshot.py, which puts it on the
# path of its own processes only (installed into a venv, it would make megatron-core's default
# --async-save strategy importable for every other test too). Installs for the `python` on
# PATH (PYTHON=/path/to/python to choose).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
version=0.6.0
python_version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
target=.venv-nvrx-cpu/py$python_version
if [ -f "$target/nvidia_resiliency_ext-$version.dist-info/METADATA" ]; then
  exit 0
fi
download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$python_version" --platform manylinux_2_39_x86_64 -d "$download" \
  "nvidia-resiliency-ext==$version"
rm -rf "$target"
mkdir -p "$target"
"$PYTHON" -m zipfile -e "$download"/nvidia_resiliency_ext-*.whl "$target"
echo "nvidia-resiliency-ext $version unpacked into $target"
