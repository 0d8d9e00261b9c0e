#!/usr/bin/env bash
# Set up a virtual environment (CPU torch from the local wheel cache, never a CUDA build) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MOE_COMM_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[dev]"
exec "$VENV/bin/python" -m pytest -q "$@"
