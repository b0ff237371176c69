#!/usr/bin/env bash
# Every check and figure one GPU can give, in one call, under 8 minutes, offline:
#   bash run_scripts/gpu_check.sh [--output DIR] [--only PHASE ...] [--dry-run]
# The phases (environment, ahead-of-time kernel compile, CUDA kernel tests, GEMM rate, kernel
# bandwidth, attention at seq 8192, NCCL collectives and a batched send/recv to itself, bf16
# training with async checkpoints and a resume, 8B-shaped throughput and MFU with its peak memory
# against the planner's, FP8) are tools/gpu_check.py's; each result is streamed to
# DIR/gpu_check.jsonl ($OUT when set) as it comes, each phase's output unbuffered. The run ends with
# PASS n / FAIL m and exits non-zero when anything failed; a phase that could not run counts as
# failed (--only is the way to leave phases out). --dry-run prints the plan and runs nothing (any
# machine).
# Environment: PYTHON (default: .venv/bin/python when it has CUDA, else python3).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# the checkout's package for every phase, whether or not $PYTHON has it installed
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

cuda_python() {  # does "$1" import a CUDA build of torch that sees a GPU?
  "$1" -c "import torch, sys; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)" 2>/dev/null
}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ -x .venv/bin/python ] && { cuda_python .venv/bin/python || ! cuda_python python3; }; then PYTHON=.venv/bin/python; fi
fi
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "gpu_check.sh: $PYTHON has no torch; install a CUDA build of torch (offline: from a wheel) or set PYTHON" >&2
  exit 1
fi
exec "$PYTHON" "$ROOT/tools/gpu_check.py" "$@"
