#!/usr/bin/env bash
# Create .venv with Python 3.12 and install csa_jax with the pinned (CI) versions.
# Usage: bash scripts/setup.sh [BACKEND...]   (idempotent; re-running only re-checks the install)
#   no BACKEND: CPU (what CI runs). BACKEND: one or more of the pyproject extras
#   cuda12 | cuda13 | rocm7 | tpu | gluon, e.g. `bash scripts/setup.sh cuda12 gluon`.
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS=dev
for b in "$@"; do
  case "$b" in
    cuda12|cuda13|rocm7|tpu|gluon) EXTRAS="$EXTRAS,$b" ;;
    *) echo "setup: error: unknown backend '$b'; choose from cuda12, cuda13, rocm7, tpu, gluon (none = CPU)" >&2
       exit 2 ;;
  esac
done

find_python() {
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c 'import sys' >/dev/null 2>&1; then
    command -v python3.12; return 0
  fi
  local roots=()
  if command -v pyenv >/dev/null 2>&1; then roots+=("$(pyenv root)/versions"); fi
  roots+=("${PYENV_ROOT:-$HOME/.pyenv}/versions" "$HOME/.pyenv/versions")
  local r c
  for r in "${roots[@]}"; do
    for c in "$r"/3.12*/bin/python3.12; do
      if [ -x "$c" ]; then echo "$c"; return 0; fi
    done
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  if ! PY=$(find_python); then
    echo "setup: error: Python 3.12 is required (jax >= 0.11 needs it) but none was found." >&2
    echo "setup: looked for python3.12 on PATH and under \$(pyenv root)/versions/3.12* and ~/.pyenv/versions/3.12*." >&2
    echo "setup: install it (e.g. 'pyenv install 3.12') and run this again." >&2
    exit 1
  fi
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[$EXTRAS]"
# csa_jax first: on a machine without an accelerator it keeps jax from probing the installed
# libtpu (csa_jax/platforms.py), whose start-up errors would otherwise follow this line.
.venv/bin/python -c 'import csa_jax, jax, flax, optax; print(f"setup: ok: jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}")'
