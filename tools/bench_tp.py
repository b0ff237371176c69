"""Benchmark tensor-parallel communication overlapped with the GEMMs or not: megapretrain.commands.bench_tp."""

import sys

try:
    from megapretrain.commands.bench_tp import main
except ModuleNotFoundError as exc:  # a checkout that is not installed
    if not (exc.name or "").startswith("megapretrain"):
        raise
    print(f"error: {exc}: install the package, from the repository root: pip install -e .", file=sys.stderr)
    sys.exit(2)
if __name__ == "__main__":  # its ranks are spawned processes, which import this file again
    raise SystemExit(main())
