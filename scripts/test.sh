#!/usr/bin/env bash
# Set up the venv (scripts/setup.sh), lint (ruff, rules in pyproject.toml), then run the test suite
# (GPU tests are deselected without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
"$PY" -m ruff check .
exec "$PY" -m pytest -q --durations=15 "$@"
