"""megapretrain: Megatron-style 3D-parallel pretraining of decoder-only LLMs, runnable on CPU."""

import importlib.abc
import importlib.machinery
import os
import sys

__version__ = "0.1.0"


class _CheckoutKernels(importlib.abc.MetaPathFinder):
    """``megapretrain.kernels`` where no install maps it: a checkout that is not installed
    (``python -m megapretrain.train`` from the repository root), or an editable install (whose
    finder maps regular packages only). setup.py installs the root's ``kernels/`` under that name;
    it is a namespace portion (no ``__init__.py``), so a regular package named ``kernels`` found
    anywhere on the path (the hub's, which transformers imports) is what the bare name gives, even
    with the repository root first on ``sys.path``. Asked last: an installed package always wins."""

    def find_spec(self, name, path=None, target=None):
        if name != f"{__name__}.kernels":
            return None
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        kernels = os.path.join(root, "kernels")
        if not (os.path.isfile(os.path.join(kernels, "dispatch.py"))
                and os.path.isfile(os.path.join(root, "setup.py"))):
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [kernels]
        return spec


if not any(type(finder).__name__ == "_CheckoutKernels" for finder in sys.meta_path):
    sys.meta_path.append(_CheckoutKernels())
