"""Benchmark the pipeline schedules (1F1B, ZB-H1, ZB-V) on pp CPU ranks: megapretrain.commands.bench_pipeline."""

import sys

try:
    from megapretrain.commands.bench_pipeline import main
except ModuleNotFoundError as exc:  # a checkout that is not installed
    if not (exc.name or "").startswith("megapretrain"):
        raise
    print(f"error: {exc}: install the package, from the repository root: pip install -e .", file=sys.stderr)
    sys.exit(2)
if __name__ == "__main__":  # its ranks are spawned processes, which import this file again
    raise SystemExit(main())
