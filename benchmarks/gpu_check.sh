#!/usr/bin/env bash
# GPU check of the kernels in one call: gpu tests, then timings (see gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
