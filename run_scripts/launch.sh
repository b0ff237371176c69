#!/usr/bin/env bash
# Launch megapretrain on one node or many, with torchrun; SLURM-aware; restarts a failed job.
#   bash run_scripts/launch.sh configs/NAME.yaml [--dry-run] [--section.key VALUE ...]
# On one machine it uses every GPU (or NPROC_PER_NODE processes). Under SLURM (sbatch with one
# task per node) it reads the node count and the first node's address from SLURM. Without SLURM
# set NNODES and MASTER_ADDR (and MASTER_PORT) yourself on every node (NODE_RANK too: it is checked,
# and names the node in messages; the rendezvous assigns the ranks).
#
# Restarts: torchrun restarts every process of the job, up to MAX_RESTARTS times (default 3), when
# one fails (a crash, an exit, the hang watchdog's exit 5); the training resumes from its latest
# checkpoint. The rendezvous (c10d, on MASTER_ADDR:MASTER_PORT; one node: torchrun --standalone)
# survives a restart. Each node runs torchrun through megapretrain/launcher.py, which names every
# attempt by its rendezvous round (the same on every node, where torchrun's restart count is not)
# and ends the job on every node, with no restart, when a worker exits with a status no restart
# can change: 2 bad input, 3 recovery gave up, 4 out of memory, 6 a crash loop (every launcher
# exits with that status). A lost node: the others' workers fail, their agents wait for it in a
# new rendezvous for RDZV_JOIN_TIMEOUT seconds (default 120; raise it where the nodes of a large
# job take longer than that to start), then exit non-zero: relaunch the job on healthy nodes.
# RDZV_LAST_CALL_TIMEOUT (default 30) and RDZV_CLOSE_TIMEOUT (default 30) are the rendezvous's
# other timeouts (torch's dynamic rendezvous: --rdzv-conf).
# Under SLURM, submit with `#SBATCH --requeue --signal=B:USR1@300`: on that signal (or SIGTERM)
# the training saves at its next step boundary and stops, and the job is requeued (REQUEUE=0:
# not); it resumes from that checkpoint when it starts again.
#
# --dry-run launches nothing: it checks that the python it would use ($PYTHON, default
# .venv/bin/python) has torch, validates the config, its data paths and its tokenizer at the world
# size this launch would have (nodes × processes per node), prints the plan of that layout
# (tools/plan.py --check, on PLAN_DEVICE, default h100) and the exact torchrun command of every node.
# When a dry run finds neither SLURM nor NNODES / NPROC_PER_NODE, it uses the run script's
# DEFAULT_NNODES / DEFAULT_NPROC_PER_NODE (the size its config is laid out for).
set -euo pipefail
CONFIG="${1:?usage: launch.sh configs/NAME.yaml [--dry-run] [--section.key VALUE ...]}"
shift
DRY_RUN=0
ARGS=()
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then DRY_RUN=1; else ARGS+=("$arg"); fi
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

die() { echo "error: $*" >&2; exit 2; }
whole() {  # NAME VALUE LOW [HIGH] MEANING: VALUE is a whole number in [LOW, HIGH]
  local name=$1 value=$2 low=$3 high=$4 meaning=$5 range="from $3 up"
  [ -z "$high" ] || range="from $low to $high"
  if ! [[ "$value" =~ ^[0-9]+$ ]] || (( 10#$value < low )) || { [ -n "$high" ] && (( 10#$value > high )); }; then
    die "$name=$value must be a whole number $range ($meaning)"
  fi
}
[ -f "$CONFIG" ] || die "config file '$CONFIG' not found (see configs/)"
if [ -z "${PYTHON:-}" ]; then
  PYTHON="$ROOT/.venv/bin/python"
  [ -x "$PYTHON" ] || PYTHON=python3
fi
if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" >/dev/null 2>&1; then
  die "PYTHON=$PYTHON cannot import torch: run 'bash run_scripts/env.sh' once to make .venv, or set PYTHON to a python with torch and megapretrain"
fi

expand_nodelist() {  # SLURM's compressed node list (gpu[01-03,07],login1) -> one host per line
  if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "$1"
    return
  fi
  "$PYTHON" - "$1" <<'EOF'
import re, sys
for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", sys.argv[1]):
    match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if not match:
        print(item)
        continue
    prefix, ranges, suffix = match.groups()
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            print(f"{prefix}{i:0{len(lo)}d}{suffix}")
EOF
}

wait_for() {  # PID: its exit status, waiting again when a trapped signal interrupted the wait
  local status
  while :; do
    status=0
    wait "$1" || status=$?
    kill -0 "$1" 2>/dev/null || return "$status"
  done
}

if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${SLURM_STEP_ID:-}" ] && [ "$DRY_RUN" = 0 ]; then
  # the batch script itself: one launcher per node (each runs torchrun for its GPUs); a pre-emption
  # or time-limit signal goes to them (the training saves and stops), then the job is requeued
  REQUEUE="${REQUEUE:-1}"
  [[ "$REQUEUE" =~ ^[01]$ ]] || die "REQUEUE=$REQUEUE must be 1 (requeue the job after a stop signal) or 0"
  srun --ntasks-per-node 1 bash "${BASH_SOURCE[0]}" "$CONFIG" ${ARGS[@]+"${ARGS[@]}"} &
  STEP=$!
  SIGNALLED=""
  on_signal() { SIGNALLED=$1; echo "launch: SIG$1: the training saves and stops" >&2; kill -s "$1" "$STEP" 2>/dev/null || true; }
  trap 'on_signal USR1' USR1
  trap 'on_signal TERM' TERM
  status=0
  wait_for "$STEP" || status=$?
  if [ -n "$SIGNALLED" ] && [ "$REQUEUE" = 1 ]; then
    echo "launch: requeueing job $SLURM_JOB_ID; it resumes from the checkpoint just saved" >&2
    scontrol requeue "$SLURM_JOB_ID"
  fi
  exit "$status"
fi

for name in NNODES NODE_RANK NPROC_PER_NODE DEFAULT_NNODES DEFAULT_NPROC_PER_NODE MAX_RESTARTS MASTER_PORT \
            OMP_NUM_THREADS RDZV_JOIN_TIMEOUT RDZV_LAST_CALL_TIMEOUT RDZV_CLOSE_TIMEOUT; do
  [ -z "${!name+set}" ] || [ -n "${!name}" ] || die "$name is set but empty: give it a value or unset it"
done
[ -z "${DEFAULT_NNODES:-}" ] || whole DEFAULT_NNODES "$DEFAULT_NNODES" 1 "" "the nodes a dry run assumes"
[ -z "${DEFAULT_NPROC_PER_NODE:-}" ] || whole DEFAULT_NPROC_PER_NODE "$DEFAULT_NPROC_PER_NODE" 1 "" \
  "the processes per node a dry run assumes"
HOSTS=()
if [ -n "${SLURM_JOB_ID:-}" ]; then
  NNODES="${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}"
  NODE_RANK="${SLURM_NODEID:-0}"
  mapfile -t HOSTS < <(expand_nodelist "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}")
  [ "${#HOSTS[@]}" -gt 0 ] || die "SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST names no host"
  MASTER_ADDR="${HOSTS[0]}"
  [ -z "${SLURM_GPUS_ON_NODE:-}" ] || NPROC_PER_NODE="${NPROC_PER_NODE:-$SLURM_GPUS_ON_NODE}"
elif [ "$DRY_RUN" = 1 ]; then
  NNODES="${NNODES:-${DEFAULT_NNODES:-1}}"
fi
if [ "$DRY_RUN" = 1 ]; then  # this machine's GPUs say nothing about the nodes the run is for
  NPROC_PER_NODE="${NPROC_PER_NODE:-${DEFAULT_NPROC_PER_NODE:-}}"
fi
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-megapretrain}}"
RDZV_JOIN_TIMEOUT="${RDZV_JOIN_TIMEOUT:-120}"
RDZV_LAST_CALL_TIMEOUT="${RDZV_LAST_CALL_TIMEOUT:-30}"
RDZV_CLOSE_TIMEOUT="${RDZV_CLOSE_TIMEOUT:-30}"
whole NNODES "$NNODES" 1 "" "the nodes of the job"
whole NODE_RANK "$NODE_RANK" 0 "$((10#$NNODES - 1))" "this node's place among the NNODES=$NNODES nodes"
whole MASTER_PORT "$MASTER_PORT" 1 65535 "the rendezvous port on MASTER_ADDR"
whole MAX_RESTARTS "$MAX_RESTARTS" 0 "" "how often torchrun restarts a failed job"
whole RDZV_JOIN_TIMEOUT "$RDZV_JOIN_TIMEOUT" 1 "" "seconds every node has to join a rendezvous"
whole RDZV_LAST_CALL_TIMEOUT "$RDZV_LAST_CALL_TIMEOUT" 1 "" \
  "seconds a rendezvous waits for more nodes once it has enough"
whole RDZV_CLOSE_TIMEOUT "$RDZV_CLOSE_TIMEOUT" 1 "" "seconds a rendezvous has to close"
[[ "$MASTER_ADDR" =~ ^[A-Za-z0-9_.:-]+$ ]] || die "MASTER_ADDR='$MASTER_ADDR' must be node 0's host name or address"
[[ "$RDZV_ID" =~ ^[A-Za-z0-9_.-]+$ ]] || die "RDZV_ID='$RDZV_ID' must be letters, digits, '.', '_' or '-' (the same on every node)"
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # (checked before any python here loads OpenMP, which rejects a bad one)
whole OMP_NUM_THREADS "$OMP_NUM_THREADS" 1 "" "the CPU threads of each process"
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE="$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')"
fi
whole NPROC_PER_NODE "$NPROC_PER_NODE" 1 "" "the training processes on each node, one per GPU"
NNODES=$((10#$NNODES)) NODE_RANK=$((10#$NODE_RANK)) NPROC_PER_NODE=$((10#$NPROC_PER_NODE))
export OMP_NUM_THREADS
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"  # keeps TP comms ordered before compute
# segments that grow in place: no fragmentation from the changing sizes of a ramp-up, eval or a long run
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

# one node: a rendezvous on a free local port; several: c10d on node 0, which outlives a restart
if [ "$NNODES" = 1 ]; then
  RENDEZVOUS=(--standalone)
else
  RENDEZVOUS=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
              --rdzv-conf "join_timeout=$((10#$RDZV_JOIN_TIMEOUT)),last_call_timeout=$((10#$RDZV_LAST_CALL_TIMEOUT)),close_timeout=$((10#$RDZV_CLOSE_TIMEOUT))")
fi
TORCHRUN=(-m megapretrain.launcher --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE"
          --max-restarts "$MAX_RESTARTS" "${RENDEZVOUS[@]}"
          -m megapretrain.train --config "$CONFIG" ${ARGS[@]+"${ARGS[@]}"})

if [ "$DRY_RUN" = 1 ]; then
  WORLD=$((NNODES * NPROC_PER_NODE))
  echo "dry run: $CONFIG on $NNODES node(s) × $NPROC_PER_NODE processes = $WORLD; nothing is launched"
  # the checkout's package even where $PYTHON has none installed (tools/*.py import it)
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  status=0
  WORLD_SIZE="$WORLD" "$PYTHON" -m megapretrain.train --config "$CONFIG" --check ${ARGS[@]+"${ARGS[@]}"} || status=$?
  [ "$status" = 0 ] || { echo "dry run: the config, its data or its tokenizer is not ready (see above)" >&2; exit 2; }
  plan_err="$(mktemp)"
  trap 'rm -f "$plan_err"' EXIT
  status=0
  "$PYTHON" "$ROOT/tools/plan.py" --config "$CONFIG" --gpus "$WORLD" --check --device "${PLAN_DEVICE:-h100}" \
    ${ARGS[@]+"${ARGS[@]}"} 2> "$plan_err" || status=$?
  cat "$plan_err" >&2
  if grep -q "^Traceback (most recent call last):" "$plan_err"; then
    echo "dry run: the planner failed (its traceback is above): nothing could be checked of the layout" >&2
    exit 1
  elif [ "$status" = 2 ]; then
    echo "dry run: the config does not validate at world size $WORLD (see above)" >&2
    exit 2
  elif [ "$status" != 0 ]; then
    echo "dry run: warning: the planner estimates this layout does not fit on ${PLAN_DEVICE:-h100} GPUs" >&2
  fi
  if [ "$NNODES" -gt 1 ] && [ "$MASTER_ADDR" = 127.0.0.1 ]; then
    echo "dry run: warning: MASTER_ADDR is 127.0.0.1; set it to node 0's address on every node" >&2
  fi
  echo "environment: OMP_NUM_THREADS=$OMP_NUM_THREADS CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"
  for ((i = 0; i < NNODES; i++)); do
    line="$(printf '%q ' "$PYTHON" "${TORCHRUN[@]}")"
    echo "node $i${HOSTS[$i]:+ (${HOSTS[$i]})}: ${line% }"
  done
  exit 0
fi

# bad input is one line now, not one per restart of every process
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" WORLD_SIZE=$((NNODES * NPROC_PER_NODE)) \
  "$PYTHON" -m megapretrain.train --config "$CONFIG" --check ${ARGS[@]+"${ARGS[@]}"} || exit $?

# torchrun in the background: a stop signal (SIGTERM, SLURM's SIGUSR1) goes to the training
# processes themselves, which save at the next step boundary and exit 0 (torchrun itself would
# kill them after a short grace period, possibly in the middle of the save)
"$PYTHON" "${TORCHRUN[@]}" &
AGENT=$!
stop() { echo "launch: SIG$1 on node $NODE_RANK: the training saves at its next step and stops" >&2; pkill "-$1" -P "$AGENT" || true; }
trap 'stop USR1' USR1
trap 'stop TERM' TERM
status=0
wait_for "$AGENT" || status=$?
exit "$status"
