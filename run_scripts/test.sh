#!/usr/bin/env bash
# Install what the tests need (into .venv) and run the test suite on CPU.
# Extra arguments go to pytest, e.g.: bash run_scripts/test.sh -m "not slow" -x
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# DeepSpeed (for the test that reads tools/plan.py --emit deepspeed with DeepSpeed's own parser) ships
# only a source build: build it against the installed torch, without its ops; its test skips without it
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
  DS_BUILD_OPS=0 python -m pip install --quiet --no-build-isolation "deepspeed>=0.14" 2>&1 \
    | { grep -v "^WARNING: Location 'file://" || true; } \
    || echo "warning: deepspeed did not install: tests/test_planner.py's DeepSpeed check will skip" >&2
fi
python -m pytest tests "$@"
