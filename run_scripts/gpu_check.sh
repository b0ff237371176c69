#!/usr/bin/env bash
# The one-GPU check of the fused kernels, for a single H100/H200, in under 8 minutes, offline:
#   1. the environment: a CUDA build of torch, a GPU, triton, pytest (says what is missing; installs nothing
#      from the network — megapretrain itself, if not installed, is installed from this tree with --no-index)
#   2. the kernel tests on real CUDA (tests/test_kernels*.py, no interpreter)
#   3. tools/bench_kernels.py (bandwidth against the measured copy bandwidth, loss memory at 32k/128k vocab)
#   4. tools/bench_train.py on configs/gpu/bench_1b.yaml (~1.2B Llama, bf16): kernels torch, kernels
#      triton (+ optim.impl triton), kernels triton + train.compile — tokens/s, TFLOP/s and MFU
#   5. a short training run of configs/tiny.yaml on the NCCL backend (torchrun, one rank)
# Everything goes to one file: --output FILE, else $OUT/gpu_check.txt when $OUT is set, else
# runs/gpu_check/gpu_check_<time>.txt. Each step has its own time limit; a step that fails or runs out
# of time is recorded as such and the next one runs.
#   bash run_scripts/gpu_check.sh [--output FILE] [--dry-run]
# Environment: PYTHON (default: .venv/bin/python when it has CUDA, else python3), PEAK_TFLOPS (dense bf16
# peak for the MFU; default 989, H100 SXM and H200), BUDGET_S (default 450: the steps' total limit).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# the checkout's package for every step, whether or not $PYTHON has it installed (tools/*.py import it)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

OUTPUT="" DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --output) OUTPUT="$2"; shift 2 ;;
    --output=*) OUTPUT="${1#--output=}"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (use --output FILE or --dry-run)" >&2; exit 2 ;;
  esac
done
if [ -z "$OUTPUT" ]; then
  if [ -n "${OUT:-}" ]; then OUTPUT="$OUT/gpu_check.txt"; else OUTPUT="runs/gpu_check/gpu_check_$(date -u +%Y%m%dT%H%M%SZ).txt"; fi
fi
mkdir -p "$(dirname "$OUTPUT")"
: > "$OUTPUT"

PEAK_TFLOPS="${PEAK_TFLOPS:-989}"
BUDGET_S="${BUDGET_S:-450}"
CONFIG=configs/gpu/bench_1b.yaml
START=$(date +%s)
SUMMARY=()

log() { printf '%s\n' "$*" | tee -a "$OUTPUT"; }

cuda_python() {  # does "$1" import a CUDA build of torch that sees a GPU?
  "$1" -c "import torch, sys; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)" 2>/dev/null
}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ -x .venv/bin/python ] && cuda_python .venv/bin/python; then PYTHON=.venv/bin/python; fi
fi

# run NAME LIMIT_S CMD...: the command's output into the file, its status and time into the summary
run() {
  local name="$1" limit="$2"; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if [ "$left" -lt 20 ]; then
    SUMMARY+=("$(printf '%-22s SKIPPED (time budget of %ss spent)' "$name" "$BUDGET_S")"); return
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  log ""
  log "=== $name (limit ${limit}s): $*"
  if [ "$DRY_RUN" = 1 ]; then SUMMARY+=("$(printf '%-22s dry run' "$name")"); return; fi
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" env -u TRITON_INTERPRET "$@" 2>&1 | tee -a "$OUTPUT"
  rc=${PIPESTATUS[0]}
  local status="ok"
  [ "$rc" -ne 0 ] && status="FAILED (exit $rc)"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="TIMED OUT after ${limit}s"
  SUMMARY+=("$(printf '%-22s %-28s %4ss' "$name" "$status" "$(( SECONDS - t0 ))")")
}

log "gpu_check.sh — $(date -u +%Y-%m-%dT%H:%M:%SZ) — $(hostname) — $(git rev-parse --short HEAD 2>/dev/null || echo no-git)$(git diff --quiet 2>/dev/null || echo ' (modified tree)')"
log "python: $PYTHON"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$OUTPUT"

# -- 1. the environment ------------------------------------------------------------------------------
MISSING=$("$PYTHON" - <<'EOF' 2>&1 | tee -a "$OUTPUT" | sed -n 's/^MISSING: //p'
import importlib.util
try:
    import torch
except ImportError:
    print("MISSING: torch (a CUDA build: pip download it elsewhere and install the wheel)")
    raise SystemExit
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}")
if not torch.version.cuda:
    print("MISSING: a CUDA build of torch (this one is CPU-only)")
elif not torch.cuda.is_available():
    print("MISSING: a visible GPU (torch.cuda.is_available() is False: driver, CUDA_VISIBLE_DEVICES?)")
else:
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
for name, why in (("triton", "the kernels"), ("pytest", "the kernel tests")):
    spec = importlib.util.find_spec(name)
    if spec is None:
        print(f"MISSING: {name} ({why})")
    else:
        mod = __import__(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
for name in ("liger_kernel", "apex", "transformers"):
    print(f"{name}: {'present' if importlib.util.find_spec(name) else 'absent (optional)'}")
EOF
)
if ! "$PYTHON" -c "import megapretrain.kernels" 2>/dev/null; then
  log "megapretrain is not installed for $PYTHON: installing this tree, offline (--no-index --no-deps -e .)"
  "$PYTHON" -m pip install --no-index --no-deps --no-build-isolation --quiet -e . 2>&1 | tee -a "$OUTPUT"
  "$PYTHON" -c "import megapretrain.kernels" 2>/dev/null || MISSING+=$'\n'"megapretrain (pip install -e . failed offline)"
fi
if [ -n "$MISSING" ]; then
  log ""
  log "cannot run the GPU checks; missing:"
  printf '%s\n' "$MISSING" | sed '/^$/d; s/^/  - /' | tee -a "$OUTPUT"
  if [ "$DRY_RUN" = 0 ]; then log "results: $OUTPUT"; exit 1; fi
fi

# -- 2. the kernel tests on CUDA --------------------------------------------------------------------
run "kernel tests" 150 "$PYTHON" -m pytest tests/test_kernels.py tests/test_kernels_loss.py tests/test_kernels_model.py \
  tests/test_kernels_compile.py -q -p no:cacheprovider --durations=5

# -- 3. kernel benchmarks ---------------------------------------------------------------------------
run "bench_kernels" 90 "$PYTHON" tools/bench_kernels.py --json "$(dirname "$OUTPUT")/bench_kernels.json"

# -- 4. training throughput of the ~1B model --------------------------------------------------------
BENCH=("$PYTHON" tools/bench_train.py --config "$CONFIG" --steps 6 --warmup 2)
run "train kernels=torch" 60 "${BENCH[@]}" --model.kernels torch --optim.impl torch
run "train kernels=triton" 60 "${BENCH[@]}" --model.kernels triton --optim.impl triton
run "train triton+compile" 100 "${BENCH[@]}" --model.kernels triton --optim.impl triton --train.compile true

# -- 5. the NCCL backend: a short real training run (one rank: NCCL's start-up, barrier and the
#       trainer's CUDA path; more ranks need more GPUs) ------------------------------------------------
NCCL_DIR="$(dirname "$OUTPUT")/nccl"
run "nccl corpus" 30 bash -c "mkdir -p '$NCCL_DIR' && '$PYTHON' tools/build_demo_corpus.py --output '$NCCL_DIR/corpus.jsonl' \
  --max-mb 2 && '$PYTHON' tools/preprocess_data.py --input '$NCCL_DIR/corpus.jsonl' --output-prefix '$NCCL_DIR/corpus' \
  --tokenizer-type ByteTokenizer --json-keys text --append-eod --workers 2"
run "train nccl" 60 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 -m megapretrain.train \
  --config configs/tiny.yaml --parallel.backend nccl --train.device cuda --train.iters 20 \
  --train.eval_interval 10 --checkpoint.interval 0 --logging.tensorboard false \
  --run.dir "$NCCL_DIR/run" --data.paths "[$NCCL_DIR/corpus_text_document]"

# -- summary ----------------------------------------------------------------------------------------
log ""
log "=== summary ($(( $(date +%s) - START ))s in all; MFU against ${PEAK_TFLOPS} TFLOP/s dense bf16)"
for line in "${SUMMARY[@]}"; do log "$line"; done
awk -v peak="$PEAK_TFLOPS" '
  /^=== train / { name = $0; sub(/^=== /, "", name); sub(/ \(limit.*/, "", name) }
  /^megapretrain +step/ { for (i = 1; i <= NF; i++) { if ($i == "tokens/s") tok = $(i - 1); if ($i == "TFLOP/s") tf = $(i - 1) }
                          printf "%-22s %12s tokens/s  %7.1f TFLOP/s  MFU %5.1f%%\n", name, tok, tf, 100 * tf / peak }
' "$OUTPUT" > "$OUTPUT.mfu"
tee -a "$OUTPUT" < "$OUTPUT.mfu" && rm -f "$OUTPUT.mfu"
log "results: $OUTPUT"
