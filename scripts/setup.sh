#!/usr/bin/env bash
# Create/refresh the project venv: CPU torch 2.13.0 first (a bare `torch` would pull a CUDA build),
# then moe_comm editable with its dev extras. Prints the venv's python path.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MOE_COMM_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
"$VENV/bin/python" -m pip install -q -e ".[dev,plot]" >&2
# The framework plug-ins' tests (moe_comm.integrations) run against these; MOE_COMM_FRAMEWORKS=0 skips them.
# torchtitan without its dependencies: they would replace CPU torch.
if [ "${MOE_COMM_FRAMEWORKS:-1}" != "0" ]; then
  "$VENV/bin/python" -m pip install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" >&2
  "$VENV/bin/python" -m pip install -q tyro "megatron-core==0.16.1" >&2
fi
echo "$VENV/bin/python"
