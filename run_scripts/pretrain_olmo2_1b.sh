#!/usr/bin/env bash
# Pretrain configs/olmo2_1b.yaml on 2 nodes of 8 GPUs. Layout and recipe: see the config's first lines.
# SLURM:   sbatch run_scripts/pretrain_olmo2_1b.sh
# By hand: NNODES=2 NODE_RANK=<i> MASTER_ADDR=<node 0> bash run_scripts/pretrain_olmo2_1b.sh   (on every node)
# Check:   bash run_scripts/pretrain_olmo2_1b.sh --dry-run   (validates at 16 GPUs, prints the plan and each node's command)
# Extra arguments are config overrides, e.g. --data.paths '[0.7, web_text_document, 0.3, code_text_document]'
#SBATCH --job-name=olmo2_1b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --requeue
# 5 min before the time limit: save, stop and requeue (run_scripts/launch.sh)
#SBATCH --signal=B:USR1@300
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# sbatch runs a spooled copy of this script: then the repository is where the job was submitted
[ -f "$ROOT/run_scripts/launch.sh" ] || ROOT="${SLURM_SUBMIT_DIR:?submit from the repository root}"
export DEFAULT_NNODES=2 DEFAULT_NPROC_PER_NODE=8  # what --dry-run assumes without SLURM or NNODES
exec bash "$ROOT/run_scripts/launch.sh" "$ROOT/configs/olmo2_1b.yaml" "$@"
