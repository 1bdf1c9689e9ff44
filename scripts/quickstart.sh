#!/usr/bin/env bash
# Installs everything into .venv and runs the quickstart: builds a timm ViT and Swin locally,
# patches them with ELSA, checks outputs against native attention, prints speed and memory.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/env.sh"
cd "$ROOT"
python demos/quickstart.py "$@"
