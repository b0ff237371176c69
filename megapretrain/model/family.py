"""What a model family is: :class:`Family`, one instance in each family's module (``FAMILY`` in
model/llama.py, model/gpt_neox.py), registered by ``model.family`` in model/families.py.

A family owns every fact that differs between families — its layer choices (a
:class:`~.layers.LayerSpec` of the shared layers), its Hugging Face adapter, the rules of what
its layers implement of the ``model.*`` options, the values a null option takes in it — and
everything else asks the object (``families.family(name)``), never the family's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .args import FAMILY_DEFAULTS, ModelArgs
from .hf_adapter import HFAdapter
from .layers import GeluMLP, LayerSpec, RMSNorm, SwiGLU

if TYPE_CHECKING:
    from ..config import ModelConfig

# the norms and MLPs kernels/ has a Triton kernel for, their variants included (RoPE: all)
TRITON_LAYERS = (RMSNorm, SwiGLU)
SHOWN = {GeluMLP: "GELU"}  # a part's name in messages, where not its class's


@dataclass(frozen=True)
class Family:
    """One model family: its name, layers, Hugging Face adapter, rules and defaults."""
    name: str  # the model.family value that selects it
    build_spec: Callable[[ModelArgs], LayerSpec]  # its layer choices (args: its defaults filled)
    hf: HFAdapter  # its Hugging Face names and config.json, both ways
    check: Callable[[ModelConfig], None]  # refuse (ConfigError) options its layers do not implement
    defaults: Mapping[str, object] = field(default_factory=dict)  # FAMILY_DEFAULTS' null values

    def __post_init__(self):
        if set(self.defaults) != set(FAMILY_DEFAULTS):  # a programming error: fail at import
            raise TypeError(f"family {self.name}: defaults {sorted(self.defaults)} must give "
                            f"exactly model/args.py's FAMILY_DEFAULTS {list(FAMILY_DEFAULTS)}")

    def args(self, args: ModelArgs) -> ModelArgs:
        """``args`` with the family's value in each field the config left null."""
        nulls = {k: v for k, v in self.defaults.items() if getattr(args, k) is None}
        return dataclasses.replace(args, **nulls) if nulls else args

    def layer_spec(self, args: ModelArgs) -> LayerSpec:
        """The parts of the family's decoder layers for ``args``."""
        return self.build_spec(self.args(args))

    def torch_only_layers(self, args: ModelArgs) -> list[str]:
        """Its layers that kernels/ has no Triton kernel for (under model.kernels=triton they run
        torch's ops)."""
        spec = self.layer_spec(args)
        return [SHOWN.get(part, part.__name__) for part in (spec.norm, spec.mlp)
                if not issubclass(part, TRITON_LAYERS)]
