#!/usr/bin/env bash
# Installs everything into .venv and runs the test suite. Without a GPU the Triton kernels run in
# Triton's CPU interpreter (set in tests/conftest.py); with one, add `-m gpu` for the GPU tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m pytest -q -n "${ELSA_TEST_WORKERS:-2}" "$@"
