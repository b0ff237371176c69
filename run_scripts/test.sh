#!/usr/bin/env bash
# Install what the tests need (into .venv) and run the test suite on CPU.
# Extra arguments go to pytest, e.g.: bash run_scripts/test.sh -m "not slow" -x
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
python -m pytest tests "$@"
