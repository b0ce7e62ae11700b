#!/usr/bin/env bash
# The supported bounds: build the wheel, install it in a fresh venv per bound (the oldest: jax 0.10.2 on
# Python 3.11; the newest: jax 0.12.1 on Python 3.13 where present) and run a smoke suite against the installed
# wheel, from outside the source tree so that `src/` is never imported.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
bash scripts/setup.sh >/dev/null
WORK=$(mktemp -d)
.venv/bin/python -m pip wheel -q --no-deps -w "$WORK/dist" . 2>&1 | grep -v '^WARNING' || true
WHEEL=$(ls "$WORK"/dist/hybrax-*.whl)
SMOKE=(tests/test_package.py tests/test_readme.py tests/ops/kda/test_api.py)

find_python() {  # the first of these interpreters that runs (pyenv's shims exist for versions not selected)
  local version
  for version in "$@"; do
    if "python$version" --version >/dev/null 2>&1; then command -v "python$version"; return; fi
    for candidate in "$(pyenv root 2>/dev/null)"/versions/"$version"*/bin/python"$version"; do
      if [ -x "$candidate" ]; then echo "$candidate"; return; fi
    done
  done
  echo python3
}

run_bound() {  # python, jax version
  local python=$1 jax=$2 venv="$WORK/venv-$2"
  echo "== hybrax wheel on jax $jax, $($python --version)"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "$WHEEL" "jax==$jax" "jaxlib==$jax" pytest hypothesis 2>&1 | grep -v '^WARNING' || true
  (cd "$WORK" && JAX_PLATFORMS=cpu HYBRAX_CACHE_DIR="$WORK/cache" "$venv/bin/python" -m pytest -q -x \
      -p no:cacheprovider --rootdir "$ROOT" -c "$ROOT/pyproject.toml" "${SMOKE[@]/#/$ROOT/}")
}

run_bound "$(find_python 3.11)" 0.10.2
run_bound "$(find_python 3.13 3.12)" 0.12.1
