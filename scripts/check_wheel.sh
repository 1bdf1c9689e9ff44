#!/usr/bin/env bash
# Builds the wheel (python -m build) and installs it into a fresh virtualenv with its dependencies,
# then imports the package, its kernels and adapters from there (not from this checkout) and runs
# one attention call on the CPU (reference backend). Not part of CI (it installs torch again).
#
#   bash scripts/check_wheel.sh [WORKDIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$(mktemp -d)}"
PY="${PYTHON:-python3}"
"$PY" -m venv "$WORK/build-env"
"$WORK/build-env/bin/python" -m pip install -q build
"$WORK/build-env/bin/python" -m build --wheel --outdir "$WORK/dist" "$ROOT"
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q "torch==2.14.1"
"$WORK/venv/bin/python" -m pip install -q "$WORK"/dist/elsa_vision-*.whl
cd "$WORK"  # away from the checkout: the installed package is what gets imported
"$WORK/venv/bin/python" - <<'PY'
import importlib
import torch
import elsa_vision
assert "site-packages" in elsa_vision.__file__, elsa_vision.__file__
for mod in ("kernels.attention", "kernels.window", "kernels.rope", "kernels.nearest", "kernels.position_bias",
            "kernels.native", "adapters.timm", "adapters.vggt", "adapters.vggt.lean"):
    importlib.import_module(f"elsa_vision.{mod}")
from elsa_vision.kernels import native
assert native._SOURCE.is_file(), native._SOURCE  # (the eager replay's C++ source ships, built on first use)
q = torch.randn(1, 2, 9, 16)
out = elsa_vision.attention(q, q, q)
assert torch.allclose(out, elsa_vision.attention(q, q, q, backend="reference"))
print("wheel ok:", elsa_vision.__file__)
PY
