#!/usr/bin/env bash
# Set up the venv (scripts/setup.sh) and run the test suite (GPU tests are deselected without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
exec "$PY" -m pytest -q "$@"
