#!/usr/bin/env bash
# Create .venv-ejkernel: ejkernel 0.0.80.3 (the seeds' library) needs jax 0.10, so it lives in its
# own environment; CPU benchmark scripts run it as a subprocess. Prints the venv's python path.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-ejkernel/bin/python ]; then
  python3.12 -m venv .venv-ejkernel 2>/dev/null || python3 -m venv .venv-ejkernel
  .venv-ejkernel/bin/python -m pip install -q ejkernel==0.0.80.3 jax==0.10.2 jaxlib==0.10.2 >&2
fi
echo "$PWD/.venv-ejkernel/bin/python"
