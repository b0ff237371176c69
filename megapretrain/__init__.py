"""megapretrain: Megatron-style 3D-parallel pretraining of decoder-only LLMs, runnable on CPU."""

import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"


class _CheckoutKernels(importlib.abc.MetaPathFinder):
    """``megapretrain.kernels`` in a checkout that is not installed (``python -m megapretrain.train``
    from the repository root): setup.py installs the root's ``kernels/`` under that name, and without
    an install nothing else maps it. Asked last, so an installed (or editable) package always wins."""

    def find_spec(self, name, path=None, target=None):
        if name != f"{__name__}.kernels":
            return None
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        init = os.path.join(root, "kernels", "__init__.py")
        if not (os.path.isfile(init) and os.path.isfile(os.path.join(root, "setup.py"))):
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[os.path.dirname(init)])


if not any(type(finder).__name__ == "_CheckoutKernels" for finder in sys.meta_path):
    sys.meta_path.append(_CheckoutKernels())
