#!/usr/bin/env bash
# Launch megapretrain on one node or many, with torchrun; SLURM-aware.
#   bash run_scripts/launch.sh configs/NAME.yaml [--dry-run] [--section.key VALUE ...]
# On one machine it uses every GPU (or NPROC_PER_NODE processes). Under SLURM (sbatch with one
# task per node) it reads the node count, this node's rank and the first node's address from SLURM.
# Without SLURM set NNODES, NODE_RANK and MASTER_ADDR (and MASTER_PORT) yourself on every node.
#
# --dry-run launches nothing: it validates the config at the world size this launch would have
# (nodes × processes per node), prints the plan of that layout (tools/plan.py --check, on
# PLAN_DEVICE, default h100) and the exact torchrun command of every node. When a dry run finds
# neither SLURM nor NNODES / NPROC_PER_NODE, it uses the run script's DEFAULT_NNODES /
# DEFAULT_NPROC_PER_NODE (the size its config is laid out for).
set -euo pipefail
CONFIG="${1:?usage: launch.sh configs/NAME.yaml [--dry-run] [--section.key VALUE ...]}"
shift
DRY_RUN=0
ARGS=()
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then DRY_RUN=1; else ARGS+=("$arg"); fi
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3

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

if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${SLURM_STEP_ID:-}" ] && [ "$DRY_RUN" = 0 ]; then
  # the batch script itself: start one launcher per node, each runs torchrun for its GPUs
  exec srun --ntasks-per-node 1 bash "${BASH_SOURCE[0]}" "$CONFIG" ${ARGS[@]+"${ARGS[@]}"}
fi
HOSTS=()
if [ -n "${SLURM_JOB_ID:-}" ]; then
  NNODES="${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}"
  NODE_RANK="${SLURM_NODEID:-0}"
  mapfile -t HOSTS < <(expand_nodelist "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}")
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
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE="$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"  # keeps TP comms ordered before compute
# segments that grow in place: no fragmentation from the changing sizes of a ramp-up, eval or a long run
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

torchrun_command() {  # the command node $1 runs, shell-quoted
  local line
  line="$(printf '%q ' "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node_rank "$1" --nproc_per_node "$NPROC_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    -m megapretrain.train --config "$CONFIG" ${ARGS[@]+"${ARGS[@]}"})"
  echo "${line% }"
}

if [ "$DRY_RUN" = 1 ]; then
  WORLD=$((NNODES * NPROC_PER_NODE))
  echo "dry run: $CONFIG on $NNODES node(s) × $NPROC_PER_NODE processes = $WORLD; nothing is launched"
  status=0
  # the checkout's package even where $PYTHON has none installed (tools/*.py import it)
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" "$ROOT/tools/plan.py" --config "$CONFIG" --gpus "$WORLD" --check --device "${PLAN_DEVICE:-h100}" \
    ${ARGS[@]+"${ARGS[@]}"} || status=$?
  if [ "$status" = 2 ]; then
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
    echo "node $i${HOSTS[$i]:+ (${HOSTS[$i]})}: $(torchrun_command "$i")"
  done
  exit 0
fi
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m megapretrain.train --config "$CONFIG" ${ARGS[@]+"${ARGS[@]}"}
