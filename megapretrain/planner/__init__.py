"""Memory and time of a run under a parallel layout, before any GPU hour is spent.

- :mod:`.model`: the estimate of one layout (memory by part, step time by part, MFU) and
  :func:`~.model.search`, every layout of a GPU count ranked;
- :mod:`.plan`: a config's plan on a GPU count (its layouts searched or its own checked, the
  run's length), as ``tools/plan.py`` prints it;
- :mod:`.goodput`: the goodput expected under failures and the checkpoint interval that
  maximises it (Young/Daly), from the layout's checkpoint bytes;
- :mod:`.published`: the published runs the model is checked against;
- :mod:`.emit`: a plan written as a config, a launch script, a DeepSpeed or Accelerate config.

The names below are the model's, imported from here by the rest of the package and the tests.
"""

from .model import (
    ATTENTION,
    GIB,
    Estimate,
    Layout,
    activation_bytes_per_token,
    context_gather_bytes,
    context_sizes,
    estimate,
    estimate_run,
    gemm_s,
    layer_params,
    layouts,
    search,
    split_layers,
    state_bytes_per_param,
)

__all__ = ["ATTENTION", "GIB", "Estimate", "Layout", "activation_bytes_per_token",
           "context_gather_bytes", "context_sizes", "estimate", "estimate_run", "gemm_s",
           "layer_params", "layouts", "search", "split_layers", "state_bytes_per_param"]
