"""Write a small real-text corpus for demos and smoke tests: megapretrain.commands.build_demo_corpus."""

import sys

try:
    from megapretrain.commands.build_demo_corpus import main
except ModuleNotFoundError as exc:  # a checkout that is not installed
    if not (exc.name or "").startswith("megapretrain"):
        raise
    print(f"error: {exc}: install the package, from the repository root: pip install -e .", file=sys.stderr)
    sys.exit(2)
raise SystemExit(main())
