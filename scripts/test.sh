#!/usr/bin/env bash
# Set up the environment from nothing and run the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=cpu HYBRAX_CACHE_DIR="${HYBRAX_CACHE_DIR:-$(mktemp -d)}"
exec .venv/bin/python -m pytest "$@"
