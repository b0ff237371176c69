"""What a model family's Hugging Face adapter provides (:class:`HFAdapter`), and the helpers the
adapters share: the error type of a conversion and the reading of rotary settings.

A family's adapter (model/llama_hf.py, model/gpt_neox_hf.py) owns everything that differs between
families: the Hugging Face names of the chunk's parameters, ``config.json`` in both directions and
what of a ``config.json`` the family's layers cannot compute. ``checkpoint/hf.py`` streams the
tensors, checks the logits and picks the adapter (the family's, ``model/families.py``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

from ..errors import ConfigError, UserError
from .args import ROPE_KEYS, check_rope_scaling

if TYPE_CHECKING:
    from ..config import Config
    from .args import ModelArgs


class ConvertError(UserError):
    """Bad input to a conversion; the message names the file or flag and what to do."""


class HFAdapter(Protocol):
    """One family's mapping to and from Hugging Face checkpoints."""
    model_types: tuple[str, ...]     # config.json model_type values the family reads
    architectures: tuple[str, ...]   # and its architectures (read when model_type is absent)
    ignored_suffixes: tuple[str, ...]  # buffers old exports carry (recomputed, not weights)

    def hf_name(self, name: str) -> str:
        """The Hugging Face name of the chunk's parameter ``name`` (a one-to-one map, no reshaping:
        the chunk lays each tensor out as Hugging Face does, so tp slices are row/column ranges)."""

    def hf_config(self, cfg: Config, args: ModelArgs, dtype_name: str, bos: int | None,
                  eos: int | None) -> dict:
        """``config.json`` of the Hugging Face model computing what ``cfg.model`` does (``args``:
        its shape, the family's defaults filled in)."""

    def check(self, hf: dict, where: str) -> None:
        """Raise :class:`ConvertError` for what of ``hf`` (a config.json) the family cannot
        compute."""

    def model_flags(self, hf: dict, where: str) -> dict[str, object]:
        """``model.*`` settings (field → value) describing the checkpoint's architecture."""


def rope_from_hf(hf: dict, where: str, params: dict | None = None) -> tuple[float, dict | None]:
    """(rope_theta, model.rope_scaling) of an HF config: ``rope_scaling`` (older checkpoints; it
    wins, as in transformers) or ``rope_parameters`` (transformers 5), or ``params`` when given
    (one layer type's entry of a per-type ``rope_parameters``)."""
    if params is None:
        params = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or params
    else:
        scaling = params
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or hf.get("rotary_emb_base") or
                  10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) \
        else scaling
    if kind == "default":
        return theta, None
    scaling = {"rope_type": kind, **{k: v for k, v in scaling.items() if v is not None and k not in
                                     ("rope_type", "rope_theta", "type", "partial_rotary_factor")}}
    if kind in ROPE_KEYS:
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if kind == "yarn":
        if scaling.get("truncate", True) is True:  # the default: correction range dims rounded
            scaling.pop("truncate", None)
        if "factor" not in scaling and hf.get("max_position_embeddings"):  # transformers' rule
            scaling["factor"] = hf["max_position_embeddings"] / \
                scaling["original_max_position_embeddings"]
    if kind in ROPE_KEYS:
        extra = sorted(set(scaling) - {"rope_type", *ROPE_KEYS[kind][0], *ROPE_KEYS[kind][1]})
        if extra:
            raise ConvertError(f"{where}: rope_scaling keys {extra} are not part of rope_type "
                               f"{kind}; the weights would not compute the same function")
    try:
        check_rope_scaling(scaling, f"{where}: rope_scaling")
    except ConfigError as exc:
        raise ConvertError(str(exc)) from None
    return theta, scaling


def hf_rope_scaling(rs: dict | tuple | None) -> dict | None:
    """``model.rope_scaling`` (or a layer's, as pairs) as config.json writes it: its type and the
    type's keys; None for none."""
    rs = dict(rs) if rs else None
    kind = rs.get("rope_type", rs.get("type")) if rs else None
    if kind is None or kind == "default":
        return None
    needed, optional = ROPE_KEYS[kind]
    return {"rope_type": kind, **{k: rs[k] for k in needed + optional if rs.get(k) is not None}}


def rope_config(cfg: Config) -> tuple[dict | None, int]:
    """(rope_scaling as config.json writes it, or None; max_position_embeddings) of ``cfg``."""
    scaling = hf_rope_scaling(cfg.model.rope_scaling)
    return scaling, max_positions(cfg, scaling)


def max_positions(cfg: Config, *scalings: dict | None) -> int:
    """config.json's max_position_embeddings: the training length, or the longest context a
    rotary scaling stretches to."""
    return max([cfg.train.seq_length] + [int(s["original_max_position_embeddings"] * s["factor"])
                                         for s in scalings if s])


def check_config_fields(hf: dict, where: str, counts: tuple[str, ...],
                        optional_counts: tuple[str, ...] = (), numbers: tuple[str, ...] = (),
                        flags: tuple[str, ...] = ()) -> None:
    """Refuse a ``config.json`` lacking one of ``counts`` (positive integers), or holding one of
    those, ``optional_counts`` (positive integers or null), ``numbers`` (finite, positive) or
    ``flags`` (true/false) of another type: ``hidden_size: "64"`` is named as a string, not
    diagnosed later as a shape that does not match."""
    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    missing = [k for k in counts if k not in hf]
    if missing:
        raise ConvertError(f"{where}: {', '.join(missing)} missing; the config.json of a "
                           f"{hf.get('model_type') or 'model'} needs {', '.join(counts)} (re-save "
                           "the model with save_pretrained)")
    wrong = [k for k in counts if not count(hf[k])]
    wrong += [k for k in optional_counts if hf.get(k) is not None and not count(hf[k])]
    wrong += [k for k in numbers if hf.get(k) is not None and not (isinstance(hf[k], (int, float))
                                                                     and not isinstance(hf[k], bool)
                                                                     and math.isfinite(hf[k]) and
                                                                   hf[k] > 0)]
    wrong += [k for k in flags if hf.get(k) is not None and not isinstance(hf[k], bool)]
    if wrong:
        shown = ", ".join(f"{k}={hf[k]!r}" for k in wrong)
        raise ConvertError(f"{where}: {shown}: of the wrong type or range (counts are positive "
                           "integers, flags true/false); the file is damaged or hand-edited")


def refuse(unsupported: dict, where: str, family: str) -> None:
    if unsupported:
        raise ConvertError(f"{where}: {unsupported} is not supported by megapretrain's {family} "
                           "family; the weights would not compute the same function")
