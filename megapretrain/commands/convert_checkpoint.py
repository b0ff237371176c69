"""Convert between megapretrain checkpoints and Hugging Face directories, Megatron-LM ``torch_dist``
checkpoints and torchtitan (DCP) checkpoints, streaming. Hugging Face: Llama, Qwen2, Qwen3 (the
llama family with ``model.qkv_bias`` / ``model.qk_norm``) and GPT-NeoX (``model.family
gpt_neox``).

    python tools/convert_checkpoint.py to-hf --checkpoint runs/tiny --output hf/tiny \\
        [--dtype bf16] [--verify]
    python tools/convert_checkpoint.py from-hf --hf hf/llama --output ckpt/llama \\
        [--parallel.tp 8 --parallel.pp 4 --parallel.vpp 2 --world-size 64] \\
        [--config CONFIG] [--verify]
    torchrun ... -m megapretrain.train --config ... --checkpoint.load ckpt/llama \\
        --checkpoint.finetune true ...

``to-hf`` reads a checkpoint saved under any layout (``--checkpoint`` is an ``iter_*`` directory,
or a run directory for its newest usable one), puts every weight together from the tensor- and
pipeline-parallel shards and ZeRO ranges, drops the vocabulary padding and writes what
``transformers.AutoModelForCausalLM.from_pretrained`` loads: ``config.json`` (LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM or GPTNeoXForCausalLM, as the family and its options say; with
Llama 3.1 rotary scaling when the run has it), ``generation_config.json``, safetensors files
(split at ``--max-shard-gb``, with an index) and the tokenizer files of a HuggingFace or
SentencePiece run. The architecture comes from the ``config.yaml`` beside the checkpoint (every
tool writes one), or from the run's when it is one of a run's ``checkpoints/`` (or ``--config``).

``from-hf`` writes a checkpoint (fp32 weights, no optimizer state, iteration 0) for the target
layout given by ``--config`` plus ``--section.key VALUE`` overrides at ``--world-size`` (default:
tp × cp × pp, one data-parallel replica; replicas are hard links): training under that layout loads
it as its own, with no resharding at start-up; under any other layout it reshards as usual. The
family comes from ``config.json`` (``model_type``, else ``architectures``); it prints the
``model.*`` settings that match the weights, ``--model.family`` first.

Both stream: one tensor at a time is read (by byte range: a tp rank's rows only) and written, so
host memory stays at about one input tensor plus its slices whatever the model's size. ``--verify``
runs both models (ours and transformers') in fp32 on a few random sequences and fails when their
largest logit difference exceeds ``--tolerance`` (default 1e-4); each model is run one part at a
time (the embedding, a decoder layer, the final norm and head: ``checkpoint/hf.py``), so it holds
one part in fp32, never a model, and a host that cannot hold even that is refused before anything
is written.
Both refuse to write into a directory that exists and is not empty, and write through a temporary
directory renamed at the end.

``from-megatron`` / ``to-megatron`` convert Megatron-LM ``torch_dist`` checkpoints
(``megapretrain.commands.convert_megatron``), ``from-torchtitan`` / ``to-torchtitan`` (also
``from-dcp`` / ``to-dcp``) torchtitan's (``megapretrain.commands.convert_torchtitan``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

from megapretrain.checkpoint import tensorfile
from megapretrain.checkpoint.directories import new_directory, owner, resolve_checkpoint
from megapretrain.checkpoint.format import (
    LazyTensor,
    check_shapes,
    read_metadata,
)
from megapretrain.checkpoint.hf import (
    HF_DTYPE_NAMES,
    ConvertError,
    HFWeights,
    check_verify_fits,
    generation_config,
    hf_config,
    hf_logits_by_layer,
    hf_name,
    model_overrides,
    our_logits_by_layer,
    read_hf_config,
    verify_tokens,
)
from megapretrain.checkpoint.reshard import (
    GlobalWeights,
    global_shapes,
    saved_config_path,
    write_weights_checkpoint,
)
from megapretrain.cli import (
    ToolParser,
    non_negative_float,
    positive_float,
    positive_int,
    progress_bar,
    user_errors,
)
from megapretrain.commands import convert_megatron, convert_torchtitan
from megapretrain.config import load_config
from megapretrain.errors import UserError
from megapretrain.model.build import DTYPES
from megapretrain.resolve import resolve

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

__all__ = ["ConvertError", "main"]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    to = sub.add_parser("to-hf", help="megapretrain checkpoint -> Hugging Face directory")
    to.add_argument("--checkpoint", required=True,
                    help="iter_* directory, or a run directory (its latest)")
    to.add_argument("--output", required=True, help="new Hugging Face model directory")
    to.add_argument("--config",
                    help="the run's config (default: config.yaml of the run that saved it)")
    to.add_argument("--dtype", choices=sorted(DTYPES), help="weights' dtype (default: the run's "
                                                            "train.precision)")
    to.add_argument("--max-shard-gb", type=positive_float, default=5.0,
                    help="split safetensors files at this size")
    frm = sub.add_parser("from-hf", help="Hugging Face directory (Llama, Qwen2/3, GPT-NeoX) -> "
                                         "megapretrain checkpoint",
                         epilog="Other --section.key VALUE arguments set the target layout "
                                "(--parallel.tp ...).")
    frm.add_argument("--hf", required=True, help="directory with config.json and *.safetensors")
    frm.add_argument("--output", required=True, help="new checkpoint directory (for "
                                                     "--checkpoint.load)")
    frm.add_argument("--config", help="YAML config of the run that will train from it (its layout)")
    frm.add_argument("--world-size", type=positive_int,
                     help="ranks of the target run (default: tp × cp × pp)")
    convert_torchtitan.add_parsers(sub)
    for p in (to, frm):
        p.add_argument("--verify", action="store_true", help="compare our logits with "
                                                             "transformers' (fp32)")
        p.add_argument("--tolerance", type=non_negative_float, default=1e-4,
                       help="largest logit difference --verify accepts")
    convert_megatron.add_parsers(sub)
    args, rest = ap.parse_known_args(argv)
    if rest and args.command in ("to-hf", "to-megatron"):
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    return args, rest


# -- to Hugging Face -------------------------------------------------------------------------------


def _tokenizer_ids(cfg) -> tuple[int | None, int | None]:
    """(bos, eos) token ids of the run's tokenizer; eos is the end-of-document id it trained
    with."""
    try:
        from megapretrain.data.tokenizers import build_tokenizer
        tok = build_tokenizer(cfg.data.tokenizer.type, cfg.data.tokenizer.model)
    except (UserError, OSError, ImportError):
        return None, None
    return getattr(tok, "bos", None), tok.eod


def _plan_shards(specs: dict, dtype: torch.dtype, limit: float) -> list[list[str]]:
    """Parameter names per output file, in order, each file at most ``limit`` bytes (or one
    tensor)."""
    files, current, size = [], [], 0
    for name, spec in specs.items():
        nbytes = spec.numel * dtype.itemsize
        if current and size + nbytes > limit:
            files.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return files + ([current] if current else [])


def to_hf(args: argparse.Namespace) -> str:
    path = resolve_checkpoint(args.checkpoint)
    meta = read_metadata(path)
    cfg = load_config(saved_config_path(path, args.config), [])
    m = cfg.model
    if m.vocab_size is None:
        m.vocab_size = meta.get("vocab_size")
        if m.vocab_size is None:
            raise ConvertError(f"model.vocab_size is null in the config and {path}/metadata.json "
                               "has none: pass --config with model.vocab_size set")
    check_shapes(path, meta, global_shapes(cfg))  # every saved tensor goes somewhere, in its shape
    weights = GlobalWeights(path, cfg)  # resets cfg's layout to one process
    resolve(cfg, 1)
    dtype = DTYPES[args.dtype or cfg.train.precision]
    specs = weights.specs
    bos, eos = _tokenizer_ids(cfg)
    if args.verify:
        check_verify_fits(cfg)  # before anything is written
    plan = _plan_shards(specs, dtype, args.max_shard_gb * 2**30)
    size = sum(specs[n].numel for n in specs) * dtype.itemsize
    with new_directory(args.output, needed=size) as tmp, progress_bar(size, "to-hf") as bar:
        names = ["model.safetensors"] if len(plan) == 1 else [
            f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
        total = 0
        for file, members in zip(names, plan):
            entries = [(hf_name(n, m.family), dtype, specs[n].shape,
                        lambda n=n: _counted(_exported(n, weights.get(n), dtype), bar))
                       for n in members]
            total += tensorfile.write(os.path.join(tmp, file), entries, {"format": "pt"})[0]
        if len(plan) > 1:
            weight_map = {hf_name(n, m.family): file for file, members in zip(names, plan)
                          for n in members}
            _write_json(os.path.join(tmp, "model.safetensors.index.json"),
                        {"metadata": {"total_size": size}, "weight_map": weight_map})
        _write_json(os.path.join(tmp, "config.json"), hf_config(cfg, dtype, bos, eos))
        _write_json(os.path.join(tmp, "generation_config.json"), generation_config(bos, eos))
        copied = _copy_tokenizer(cfg, tmp)
        report = _verify(args, cfg, weights.get, tmp, dtype) if args.verify else ""
    weights.close()
    note = f"; tokenizer: {', '.join(copied)}" if copied else \
        f"; no tokenizer files (data.tokenizer.type={cfg.data.tokenizer.type} has none to copy)"
    return (f"wrote {args.output}: iteration {meta['iteration']} of {path}, {owner(path)}, "
            f"{total / 2**20:,.1f} "
            f"MiB of {HF_DTYPE_NAMES[dtype]} weights in {len(plan)} file(s){note}{report}")


def _exported(name: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in the export's ``dtype``; NaN or infinite values, or values the dtype cannot
    hold (they would become infinite), are refused naming the tensor."""
    if not torch.isfinite(weight).all():
        raise ConvertError(f"'{name}' holds NaN or infinite values: the run diverged before this "
                           "checkpoint; convert an earlier one (nothing written)")
    out = weight.to(dtype).contiguous()
    if not torch.isfinite(out).all():
        raise ConvertError(f"'{name}' holds values up to {weight.abs().max().item():.3g}, more "
                           f"than {HF_DTYPE_NAMES[dtype]} can hold (they would become infinite): "
                           "export with --dtype bf16 or fp32 (nothing written)")
    return out


def _counted(tensor: torch.Tensor, bar) -> torch.Tensor:
    """``tensor``, its bytes added to the progress bar (it is written next)."""
    bar.update(tensor.numel() * tensor.element_size())
    return tensor


def _write_json(path: str, obj) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2)


def _copy_tokenizer(cfg, out: str) -> list[str]:
    tok = cfg.data.tokenizer
    if not tok.model or not os.path.exists(tok.model):
        return []
    if tok.type == "SentencePieceTokenizer":
        src = tok.model if os.path.isfile(tok.model) else os.path.join(tok.model, "tokenizer.model")
        if not os.path.isfile(src):
            return []
        shutil.copyfile(src, os.path.join(out, "tokenizer.model"))
        _write_json(os.path.join(out, "tokenizer_config.json"),
                    {"tokenizer_class": "LlamaTokenizer"})
        return ["tokenizer.model", "tokenizer_config.json"]
    if tok.type != "HuggingFaceTokenizer":
        return []
    folder = tok.model if os.path.isdir(tok.model) else os.path.dirname(tok.model)
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(folder, name) if os.path.isdir(tok.model) or name != "tokenizer.json" \
            else tok.model
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out, name))
            copied.append(name)
    return copied


def _verify(args, cfg, weight, hf_dir: str, dtype: torch.dtype) -> str:
    """Our model (weights from ``weight(name)``, rounded through ``dtype`` as exported) and
    transformers' from ``hf_dir``, in fp32 on a few random sequences, each run one part (the
    embedding, a decoder layer, the final norm and head) at a time: the largest logit
    difference."""
    tokens = verify_tokens(cfg)
    ours = our_logits_by_layer(cfg, lambda n: weight(n).to(dtype).float(), tokens)
    diff = (ours - hf_logits_by_layer(hf_dir, tokens)).abs().max().item()
    if not diff <= args.tolerance:  # NaN logits fail too
        raise ConvertError("--verify: the largest logit difference between megapretrain's model "
                           f"and transformers' is {diff:.3e} > --tolerance {args.tolerance:g}; the "
                           "conversion is wrong (nothing written)")
    return f"; --verify: max logit difference {diff:.2e} (≤ {args.tolerance:g})"


# -- from Hugging Face -----------------------------------------------------------------------------


def _target_config(args, overrides: list[str], hf: dict):
    """The target run's config: ``--config``, the architecture of ``hf``, then the overrides."""
    cfg = load_config(args.config, model_overrides(hf, os.path.join(args.hf, "config.json"))
                      + overrides)
    p = cfg.parallel
    world = args.world_size or p.tp * p.cp * p.pp
    if world < 1:
        raise ConvertError(f"--world-size {world} must be at least 1")
    sizes = resolve(cfg, world).sizes
    return cfg, sizes, world


def _check_hf_tensors(hf_dir: str, weights: HFWeights, shapes: dict, tied: bool,
                      family: str) -> None:
    """Every HF tensor is one of the model's, of its global shape, and none is missing."""
    ours = {hf_name(n, family): s for n, s in shapes.items()}
    for name in weights.names():
        if name == hf_name("lm_head.weight", family) and tied:
            _check_tied_head(hf_dir, weights, family)  # some exports write the embedding again
            continue
        if name not in ours:
            raise ConvertError(f"{hf_dir}: tensor '{name}' {weights.shape(name)} has no place in "
                               "the model (config.json and the weights disagree)")
        if weights.shape(name) != tuple(ours[name]):
            raise ConvertError(f"{hf_dir}: tensor '{name}' has shape {weights.shape(name)}, "
                               f"config.json implies {tuple(ours[name])}")
    missing = [n for n in ours if n not in weights.file_of]
    if missing:
        raise ConvertError(f"{hf_dir}: the weights lack "
                           f"{missing[:3]}{' ...' if len(missing) > 3 else ''}")


def _check_tied_head(hf_dir: str, weights: HFWeights, family: str, rows: int = 4096) -> None:
    """A tied model's stored output layer must be its embedding: a distinct one would be dropped,
    and the converted model would compute another function. Compared ``rows`` rows at a time."""
    head, embed = hf_name("lm_head.weight", family), hf_name("embed_tokens.weight", family)
    fix = ("convert with --model.tie_embeddings false to keep both (and set tie_word_embeddings: "
           "false in its config.json, so that transformers keeps both too)")
    if embed not in weights.file_of or weights.shape(head) != weights.shape(embed):
        raise ConvertError(f"{hf_dir}: config.json says tie_word_embeddings: true, but '{head}' "
                           f"{weights.shape(head)} is not the embedding's shape; {fix}")
    for start in range(0, weights.shape(head)[0], rows):
        length = min(rows, weights.shape(head)[0] - start)
        a, b = weights.narrow(head, 0, start, length), weights.narrow(embed, 0, start, length)
        if not torch.equal(a, b):  # NaN differs too
            worst = (a.float() - b.float()).abs().max().item()
            raise ConvertError(f"{hf_dir}: config.json says tie_word_embeddings: true, but "
                               f"'{head}' differs from '{embed}' (max |diff| {worst:.3g} in rows "
                               f"{start}-{start + length - 1}): one of them would be dropped; "
                               f"{fix}")


def _slice(weights: HFWeights, spec, tp_rank: int, family: str) -> LazyTensor:
    """Rank ``tp_rank``'s fp32 slice of ``spec``'s HF tensor (of ``spec.local_shape``), padded."""
    name, dim, local = hf_name(spec.name, family), spec.tp_dim, spec.local_shape

    def read() -> torch.Tensor:
        if dim is None:
            part = weights.narrow(name, None, 0, 0).float()
        else:
            lo = tp_rank * local[dim]
            hi = min(lo + local[dim], spec.shape[dim])  # rows past the vocabulary: zero padding
            part = weights.narrow(name, dim, lo, max(0, hi - lo)).float()
        if not torch.isfinite(part).all():
            raise ConvertError(f"{weights.dir}: '{name}' holds NaN or infinite values; these "
                               "weights cannot be trained from (nothing written)")
        if dim is None or part.shape[dim] == local[dim]:
            return part.contiguous()
        pad = list(local)
        pad[dim] -= part.shape[dim]
        return torch.cat([part, torch.zeros(pad)], dim)
    return LazyTensor(torch.float32, tuple(local), read)


def from_hf(args: argparse.Namespace, overrides: list[str]) -> str:
    hf = read_hf_config(args.hf)
    cfg, sizes, world = _target_config(args, overrides, hf)
    shapes = global_shapes(cfg)
    weights = HFWeights(args.hf)
    _check_hf_tensors(args.hf, weights, shapes, cfg.model.tie_embeddings, cfg.model.family)
    if shapes["embed_tokens.weight"][0] != hf["vocab_size"]:
        raise ConvertError(f"{args.hf}: embed_tokens has {shapes['embed_tokens.weight'][0]} rows "
                           f"but config.json says vocab_size={hf['vocab_size']}")
    if args.verify:
        check_verify_fits(cfg)  # before anything is written

    def verify(tmp: str) -> str:
        check = GlobalWeights(tmp, cfg)  # reads back what was written, from its shards
        try:
            return _verify(args, cfg, check.get, args.hf, torch.float32)
        finally:
            check.close()

    meta, report = write_weights_checkpoint(
        args.output, cfg, sizes, world, lambda spec, tp_rank: _slice(
            weights, spec, tp_rank, cfg.model.family).read(), label="from-hf",
        record={"converted_from": os.path.abspath(args.hf)},
        before_publish=verify if args.verify else None)
    layout = meta["layout"]
    weights.close()
    flags = " ".join(f"'{x}'" if x.startswith("{") else x for x in model_overrides(hf, args.hf))
    return (f"wrote {args.output} for {world} ranks (layout {layout}){report or ''}; train from it "
            f"with --checkpoint.load {args.output} and\n  {flags}")


@user_errors
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    for stack in (convert_megatron, convert_torchtitan):
        if args.command in stack.COMMANDS:
            print(stack.run(args, overrides))
            return 0
    print(to_hf(args) if args.command == "to-hf" else from_hf(args, overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
