"""megapretrain: Megatron-style 3D-parallel pretraining of decoder-only LLMs, runnable on CPU."""

__version__ = "0.1.0"
