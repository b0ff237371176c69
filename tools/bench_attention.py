"""Peak memory and time of document-masked attention per kernel: megapretrain.commands.bench_attention."""

import sys

try:
    from megapretrain.commands.bench_attention import main
except ModuleNotFoundError as exc:  # a checkout that is not installed
    if not (exc.name or "").startswith("megapretrain"):
        raise
    print(f"error: {exc}: install the package, from the repository root: pip install -e .", file=sys.stderr)
    sys.exit(2)
if __name__ == "__main__":  # not in the fresh processes it spawns per case (they import this file)
    raise SystemExit(main())
