#!/usr/bin/env bash
# Pretrain configs/llama3_70b.yaml. Layout and size: see the config's first line.
# SLURM:   sbatch --nodes 64 --ntasks-per-node 1 --gpus-per-node 8 run_scripts/pretrain_llama3_70b.sh
# By hand: NNODES=64 NODE_RANK=<i> MASTER_ADDR=<node 0> bash run_scripts/pretrain_llama3_70b.sh   (on every node)
# Extra arguments are config overrides, e.g. --data.paths '[0.7, web_text_document, 0.3, code_text_document]'
#SBATCH --job-name=llama3_70b
#SBATCH --exclusive
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# sbatch runs a spooled copy of this script: then the repository is where the job was submitted
[ -f "$ROOT/run_scripts/launch.sh" ] || ROOT="${SLURM_SUBMIT_DIR:?submit from the repository root}"
exec bash "$ROOT/run_scripts/launch.sh" "$ROOT/configs/llama3_70b.yaml" "$@"
