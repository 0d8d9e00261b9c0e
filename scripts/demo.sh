#!/usr/bin/env bash
# Set up the venv (scripts/setup.sh) and run the main job: a 4-rank CPU dispatch demo on gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/setup.sh)
exec "$PY" -m moe_comm.tools.cli demo "$@"
