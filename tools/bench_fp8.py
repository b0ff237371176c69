"""FP8 linears against bf16 at Llama-3 8B/70B shapes: megapretrain.commands.bench_fp8."""

import sys

try:
    from megapretrain.commands.bench_fp8 import main
except ModuleNotFoundError as exc:  # a checkout that is not installed
    if not (exc.name or "").startswith("megapretrain"):
        raise
    print(f"error: {exc}: install the package, from the repository root: pip install -e .", file=sys.stderr)
    sys.exit(2)
raise SystemExit(main())
