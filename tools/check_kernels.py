"""Compile every Triton kernel ahead of time for sm_80/sm_90/sm_100 at the shipped configs' shapes, through
the project's own ops (exit 1 on a spill or an error): megapretrain.commands.check_kernels."""

import sys

try:
    from megapretrain.commands.check_kernels import main
except ModuleNotFoundError as exc:  # a checkout that is not installed
    if not (exc.name or "").startswith("megapretrain"):
        raise
    print(f"error: {exc}: install the package, from the repository root: pip install -e .", file=sys.stderr)
    sys.exit(2)
raise SystemExit(main())
