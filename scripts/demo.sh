#!/usr/bin/env bash
# Set up the environment from nothing and run the demo: every operation on the CPU, checked against
# its float64 reference and timed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec .venv/bin/python -m hybrax.demo "$@"
