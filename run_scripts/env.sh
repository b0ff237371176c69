# Sourced by the run scripts: create (once) and activate the project's virtualenv in .venv.
# torch comes first and pinned: the CPU build on this kind of machine (a bare 'torch' requirement
# would pull a multi-GB CUDA build). Set TORCH_SPEC to install another build, e.g. on a GPU node.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
STAMP=".venv/.installed-$(cat setup.py | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
  quiet_pip() {  # this machine's pip config lists index folders that may be absent: hide that noise
    python -m pip install --quiet "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
  }
  echo "env.sh: installing torch (${TORCH_SPEC:-torch==2.13.0}) and megapretrain's dependencies" \
       "into .venv, once: a few minutes on a first run" >&2
  quiet_pip --upgrade pip
  quiet_pip "${TORCH_SPEC:-torch==2.13.0}"
  quiet_pip -e ".[dev,hf]"
  touch "$STAMP"
fi
