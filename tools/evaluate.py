"""Score multiple-choice task files on a checkpoint: megapretrain.commands.evaluate."""

import sys

try:
    from megapretrain.commands.evaluate import main
except ModuleNotFoundError as exc:  # a checkout that is not installed
    if not (exc.name or "").startswith("megapretrain"):
        raise
    print(f"error: {exc}: install the package, from the repository root: pip install -e .", file=sys.stderr)
    sys.exit(2)
raise SystemExit(main())
