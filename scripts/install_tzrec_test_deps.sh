#!/usr/bin/env bash
# What the TorchEasyRec tests need beside TorchRec (scripts/install_torchrec_cpu.sh first):
# grpcio-tools, at tzrec's own pin (its requirements: grpcio-tools<1.63.0), to generate tzrec's
# protobuf modules at test time (tests/functional/tzrec_harness.py). It brings grpcio and
# protobuf (<5), nothing that touches torch. tzrec itself is not installed: it comes from the
# snapshot in shared/upstream/torcheasyrec. Idempotent. Use the pip of the environment to
# install into (default: the `pip` on PATH; PIP="python -m pip" to choose).
set -euo pipefail
PIP=${PIP:-pip}
$PIP install "grpcio-tools<1.63.0"
