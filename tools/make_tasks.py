"""Make a multiple-choice task file from a tokenized corpus: megapretrain.commands.make_tasks."""

import sys

try:
    from megapretrain.commands.make_tasks import main
except ModuleNotFoundError as exc:  # a checkout that is not installed
    if not (exc.name or "").startswith("megapretrain"):
        raise
    print(f"error: {exc}: install the package, from the repository root: pip install -e .", file=sys.stderr)
    sys.exit(2)
raise SystemExit(main())
