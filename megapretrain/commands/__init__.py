"""What users run on a job, one module per command, each with ``main(argv) -> int``.

``tools/NAME.py`` (the documented paths) and the ``megapretrain-*`` console scripts only call
``megapretrain.commands.NAME.main``; ``python -m megapretrain.commands.NAME`` runs it as well.
Benchmarks and developer checks are scripts under tools/ that import the package, outside it.
"""
