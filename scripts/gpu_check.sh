#!/usr/bin/env bash
# On a CUDA machine, in a Python environment that has torch, triton and timm (the package itself may
# be installed or not): the GPU tests, then the quick benchmark of every family, interleaved against
# PyTorch's own attention. Results (CSV + PNG) go to $1, default benchmarks/results/<device>/; a log
# of everything to $1/gpu_check.log. Exits non-zero if any step failed; later steps still run.
#
#   bash scripts/gpu_check.sh [RESULTS_DIR]
#
# VGGT steps run when `vggt` is importable (e.g. PYTHONPATH=path/to/vggt), FastVGGT's side by side
# when FASTVGGT_SRC points at its source.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'scripts/gpu_check.sh needs a CUDA GPU')" || exit 2
if [ -n "${1:-}" ]; then
  mkdir -p "$1"
  export ELSA_RESULTS_DIR="$(cd "$1" && pwd)"
fi
LOG="${ELSA_RESULTS_DIR:-$ROOT/benchmarks/results}/gpu_check.log"
mkdir -p "$(dirname "$LOG")"
failed=()
step() {  # step NAME COMMAND...: run, log, remember failures
  local name=$1; shift
  echo "=== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  if "$@" 2>&1 | tee -a "$LOG"; then :; else failed+=("$name"); fi
  echo "=== $name: $((SECONDS - t0)) s" | tee -a "$LOG"
}
step gpu-tests python -m pytest -q -m gpu -p no:cacheprovider tests
step attention python benchmarks/attention.py --quick ${ELSA_RESULTS_DIR:+--out "$ELSA_RESULTS_DIR"}
step windows python benchmarks/windows.py --quick ${ELSA_RESULTS_DIR:+--out "$ELSA_RESULTS_DIR"}
step models python benchmarks/models.py --quick --profile
step training python benchmarks/attention.py --train --only bf16 ${ELSA_RESULTS_DIR:+--out "$ELSA_RESULTS_DIR"}
if python -c "import vggt" 2>/dev/null; then
  step frames python benchmarks/frames.py --quick --profile ${FASTVGGT_SRC:+--fastvggt "$FASTVGGT_SRC"}
else
  echo "=== frames: skipped (vggt is not importable)" | tee -a "$LOG"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}" | tee -a "$LOG"
  exit 1
fi
echo "all steps passed" | tee -a "$LOG"
