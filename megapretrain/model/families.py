"""The registry of model families: ``model.family`` → its :class:`~.family.Family` (the
``FAMILY`` of model/llama.py, model/gpt_neox.py,
model/olmo.py), looked up here once by name; everything after
asks the object. Adding a family is its module and one entry in ``FAMILIES``.

Also the model's rules as a whole (:func:`check_model`: the family's, then the shape's of
model/args.py) and the family of a Hugging Face ``config.json``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ..errors import ConfigError
from . import gpt_neox, llama, olmo
from .args import ModelArgs, check_shape
from .family import Family
from .hf_adapter import ConvertError
from .layers import LayerSpec

if TYPE_CHECKING:
    from ..config import ModelConfig

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, gpt_neox.FAMILY,
                                                   olmo.FAMILY)}


def family(name: str) -> Family:
    """The family ``model.family`` names; a ConfigError naming the valid ones for any other."""
    if name not in FAMILIES:
        raise ConfigError(f"model.family={name!r} is not a model family "
                          f"(valid: {', '.join(FAMILIES)})")
    return FAMILIES[name]


@functools.lru_cache(maxsize=1024)  # the planner asks it for every stage of every layout it weighs
def layer_spec(args: ModelArgs) -> LayerSpec:
    """The parts of ``args``'s decoder layers, as its family chooses them (a frozen spec:
    shared)."""
    return family(args.family).layer_spec(args)


def check_model(m: ModelConfig, tp: int) -> None:
    """The model's rules: what its family's layers implement of the options, then the shape's and
    what tensor parallelism over ``tp`` ranks may split of it (model/args.py's ``check_shape``)."""
    family(m.family).check(m)
    check_shape(m, tp)


def family_of_hf(hf: dict, where: str) -> Family:
    """The family whose adapter reads a Hugging Face ``config.json``: by its ``model_type``, or
    without one by its ``architectures``."""
    archs = hf.get("architectures") or []
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)) or \
            not isinstance(hf.get("model_type", ""), (str, type(None))):
        raise ConvertError(f"{where}: model_type={hf.get('model_type')!r}, "
                           f"architectures={archs!r}: expected a string and a list of strings; the "
                           "file is damaged or hand-edited")
    for fam in FAMILIES.values():
        if hf.get("model_type") in fam.hf.model_types or (not hf.get("model_type") and archs
                                                          and archs[0] in fam.hf.architectures):
            return fam
    known = ", ".join(t for fam in FAMILIES.values() for t in fam.hf.model_types)
    raise ConvertError(f"{where}: model_type={hf.get('model_type')!r} (architectures "
                       f"{hf.get('architectures')}) is not a family megapretrain converts "
                       f"(model_type: {known})")
