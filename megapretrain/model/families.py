"""The model families, by ``model.family``: each is a module with its layer choices
(``layer_spec(args) -> LayerSpec``) and its Hugging Face adapter (``HF``). Adding a family is a
module beside model/llama.py and model/gpt_neox.py, its adapter, and one line here (plus its name
in model/args.py's ``FAMILIES`` and its shape rules in ``check_family``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

from . import gpt_neox, llama
from .hf_adapter import ConvertError, HFAdapter
from .layers import GeluMLP, LayerNorm, LayerSpec


class Family(Protocol):
    NAME: str
    HF: HFAdapter

    def layer_spec(self, args) -> LayerSpec: ...


FAMILIES: dict[str, ModuleType] = {llama.NAME: llama, gpt_neox.NAME: gpt_neox}


def family(name: str) -> Family:
    """The family ``model.family`` names (validated by model/args.py's check_model)."""
    return FAMILIES[name]


def family_of_hf(hf: dict, where: str) -> Family:
    """The family whose adapter reads a Hugging Face ``config.json``: by its ``model_type``, or
    without one by its ``architectures``."""
    archs = hf.get("architectures") or []
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)) or \
            not isinstance(hf.get("model_type", ""), (str, type(None))):
        raise ConvertError(f"{where}: model_type={hf.get('model_type')!r}, architectures={archs!r}: expected a "
                           "string and a list of strings; the file is damaged or hand-edited")
    for fam in FAMILIES.values():
        if hf.get("model_type") in fam.HF.model_types or (not hf.get("model_type") and archs
                                                          and archs[0] in fam.HF.architectures):
            return fam
    known = ", ".join(t for fam in FAMILIES.values() for t in fam.HF.model_types)
    raise ConvertError(f"{where}: model_type={hf.get('model_type')!r} (architectures {hf.get('architectures')}) "
                       f"is not a family megapretrain converts (model_type: {known})")


def torch_only_layers(spec: LayerSpec) -> list[str]:
    """The layers of ``spec`` without a Triton kernel (they run torch's ops under model.kernels=triton)."""
    return [name for name, used in (("LayerNorm", spec.norm is LayerNorm), ("GELU", spec.mlp is GeluMLP)) if used]
