#!/usr/bin/env bash
# Launch megapretrain on one node or many, with torchrun; SLURM-aware.
#   bash run_scripts/launch.sh configs/NAME.yaml [--section.key VALUE ...]
# On one machine it uses every GPU (or NPROC_PER_NODE processes). Under SLURM (sbatch with one
# task per node) it reads the node count, this node's rank and the first node's address from SLURM.
# Without SLURM set NNODES, NODE_RANK and MASTER_ADDR (and MASTER_PORT) yourself on every node.
set -euo pipefail
CONFIG="${1:?usage: launch.sh configs/NAME.yaml [--section.key VALUE ...]}"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3

if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${SLURM_STEP_ID:-}" ]; then
  # the batch script itself: start one launcher per node, each runs torchrun for its GPUs
  exec srun --ntasks-per-node 1 bash "${BASH_SOURCE[0]}" "$CONFIG" "$@"
fi
if [ -n "${SLURM_JOB_ID:-}" ]; then
  NNODES="${SLURM_NNODES}"
  NODE_RANK="${SLURM_NODEID}"
  MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
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
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  -m megapretrain.train --config "$CONFIG" "$@"
