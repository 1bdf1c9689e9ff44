#!/usr/bin/env bash
# Creates (or reuses) the project virtualenv at .venv and installs elsa-vision with its extras.
# Sourced by scripts/test.sh and scripts/quickstart.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VENV="${ELSA_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip setuptools wheel
# torchvision (for timm) must match torch; this pair is a CUDA build that also runs on CPU.
python -c "import torch, torchvision" 2>/dev/null || python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
python -m pip install -q -e "$ROOT[timm,test,demo]"
