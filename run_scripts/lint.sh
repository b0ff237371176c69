#!/usr/bin/env bash
# Lint the code with ruff (rules in pyproject.toml), installed into .venv by env.sh.
# Extra arguments go to ruff, e.g.: bash run_scripts/lint.sh --fix
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ruff check . "$@"
