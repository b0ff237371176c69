"""Convert between megapretrain checkpoints and Hugging Face Llama directories.

    python tools/convert_checkpoint.py to-hf --checkpoint runs/tiny --output hf/tiny [--dtype bf16]
    python tools/convert_checkpoint.py from-hf --hf hf/tiny --output ckpt/tiny
    python -m megapretrain.train --config configs/tiny.yaml --checkpoint.load ckpt/tiny ...

``to-hf`` reads a checkpoint saved under any layout (``--checkpoint`` is an ``iter_*`` directory,
or a run directory for its latest), puts every weight together from the tensor- and
pipeline-parallel shards and ZeRO ranges, drops the vocabulary padding and writes what
``transformers.AutoModelForCausalLM.from_pretrained`` loads: ``config.json`` (LlamaForCausalLM)
and safetensors files (split at ``--max-shard-gb``, with an index), plus the tokenizer files of a
HuggingFaceTokenizer run. The architecture comes from the run's ``config.yaml`` (or ``--config``).
The layers already follow Hugging Face's names and rotary convention, so no weight is permuted.

``from-hf`` writes a one-rank checkpoint (fp32 weights, no optimizer state, iteration 0) that
training loads with ``--checkpoint.load`` under any layout; it prints the ``model.*`` settings
that match the weights. Both refuse to write into a directory that exists and is not empty, and
write through a temporary directory renamed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megapretrain.checkpoint.format import (
    metadata,
    rank_file,
    rank_state,
    read_metadata,
    write_metadata,
    write_rank_state,
)
from megapretrain.checkpoint.manager import new_directory, resolve_checkpoint
from megapretrain.checkpoint.reshard import SavedShards, saved_config_path, saved_padded_vocab, tp_slice
from megapretrain.config import load_config, validate
from megapretrain.errors import UserError, read_json_file
from megapretrain.model.build import DTYPES, model_args, rank_param_specs

HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class ConvertError(UserError):
    """Bad input to the converter; the message names the file or flag and what to do."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    to = sub.add_parser("to-hf", help="megapretrain checkpoint -> Hugging Face directory")
    to.add_argument("--checkpoint", required=True, help="iter_* directory, or a run directory (its latest)")
    to.add_argument("--output", required=True, help="new Hugging Face model directory")
    to.add_argument("--config", help="the run's config (default: config.yaml of the run that saved it)")
    to.add_argument("--dtype", choices=sorted(DTYPES), help="weights' dtype (default: the run's train.precision)")
    to.add_argument("--max-shard-gb", type=float, default=5.0, help="split safetensors files at this size")
    frm = sub.add_parser("from-hf", help="Hugging Face Llama directory -> megapretrain checkpoint")
    frm.add_argument("--hf", required=True, help="directory with config.json and *.safetensors")
    frm.add_argument("--output", required=True, help="new checkpoint directory (for --checkpoint.load)")
    return ap.parse_args(argv)


# -- to Hugging Face --------------------------------------------------------------------------------


def run_config(checkpoint: str, explicit: str | None):
    """The config of the run that saved ``checkpoint``, with the layout reset to one process."""
    cfg = load_config(saved_config_path(checkpoint, explicit), [])
    p = cfg.parallel
    p.tp, p.pp, p.vpp, p.pipeline_layers, p.sequence_parallel, p.zero = 1, 1, 1, None, False, 0
    return cfg


def to_hf(args: argparse.Namespace) -> str:
    from safetensors.torch import save_file

    path = resolve_checkpoint(args.checkpoint)
    meta = read_metadata(path)
    cfg = run_config(path, args.config)
    m = cfg.model
    if m.vocab_size is None:
        m.vocab_size = meta.get("vocab_size")
        if m.vocab_size is None:
            raise ConvertError(f"model.vocab_size is null in the config and {path}/metadata.json has none: "
                               "pass --config with model.vocab_size set")
    validate(cfg, 1)
    margs = model_args(cfg)
    dtype = DTYPES[args.dtype or cfg.train.precision]
    saved = SavedShards(path, meta)
    padded = saved_padded_vocab(meta, m.vocab_size, m.make_vocab_size_divisible_by)

    with new_directory(args.output) as tmp:
        limit, files, shard, shard_bytes, total = args.max_shard_gb * 2**30, [], {}, 0, 0

        def flush():
            nonlocal shard, shard_bytes
            if shard:
                name = f"part-{len(files):05d}.safetensors"
                save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
                files.append((name, list(shard)))
            shard, shard_bytes = {}, 0

        for name, spec in rank_param_specs(cfg, 0, 0).items():
            weight = tp_slice(saved, spec, "master", 0, 1, padded)
            if spec.vocab:
                weight = weight[:spec.shape[0]]  # without the padding rows
            weight = weight.to(dtype).contiguous()
            nbytes = weight.numel() * weight.element_size()
            if shard and shard_bytes + nbytes > limit:
                flush()
            shard[name if name.startswith("lm_head.") else f"model.{name}"] = weight
            shard_bytes += nbytes
            total += nbytes
        flush()
        if len(files) == 1:
            os.rename(os.path.join(tmp, files[0][0]), os.path.join(tmp, "model.safetensors"))
        else:
            weight_map = {}
            for i, (name, keys) in enumerate(files):
                final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                os.rename(os.path.join(tmp, name), os.path.join(tmp, final))
                weight_map.update(dict.fromkeys(keys, final))
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
        hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
              "hidden_size": m.hidden_size, "intermediate_size": margs.ffn_hidden_size,
              "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
              "num_key_value_heads": margs.num_kv_heads, "head_dim": m.hidden_size // m.num_heads,
              "hidden_act": "silu", "max_position_embeddings": cfg.train.seq_length,
              "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_scaling": None,
              "tie_word_embeddings": bool(m.tie_embeddings), "attention_bias": False, "mlp_bias": False,
              "initializer_range": m.init_std, "torch_dtype": HF_DTYPE_NAMES[dtype]}
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(hf, fh, indent=2)
        copied = _copy_tokenizer(cfg, tmp)
    note = f"; tokenizer: {', '.join(copied)}" if copied else \
        f"; no tokenizer files (data.tokenizer.type={cfg.data.tokenizer.type} is not a HuggingFaceTokenizer)"
    return (f"wrote {args.output}: iteration {meta['iteration']} of {path}, {total / 2**20:,.1f} MiB of "
            f"{HF_DTYPE_NAMES[dtype]} weights in {max(len(files), 1)} file(s){note}")


def _copy_tokenizer(cfg, out: str) -> list[str]:
    tok = cfg.data.tokenizer
    if tok.type != "HuggingFaceTokenizer" or not tok.model or not os.path.exists(tok.model):
        return []
    folder = tok.model if os.path.isdir(tok.model) else os.path.dirname(tok.model)
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(folder, name) if os.path.isdir(tok.model) or name != "tokenizer.json" else tok.model
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out, name))
            copied.append(name)
    return copied


# -- from Hugging Face ------------------------------------------------------------------------------


def _hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    hf = read_json_file(path, ConvertError, "--hf must be a Hugging Face model directory")
    if not isinstance(hf, dict):
        raise ConvertError(f"{path} holds {type(hf).__name__}, not a JSON object; --hf must be a Hugging Face "
                           "model directory")
    if hf.get("model_type") != "llama":
        raise ConvertError(f"{path}: model_type={hf.get('model_type')!r}; only Llama models convert")
    unsupported = {k: hf[k] for k in ("rope_scaling", "attention_bias", "mlp_bias") if hf.get(k)}
    if hf.get("hidden_act", "silu") != "silu":
        unsupported["hidden_act"] = hf["hidden_act"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    if head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        unsupported["head_dim"] = head_dim
    if unsupported:
        raise ConvertError(f"{path}: {unsupported} is not supported by megapretrain's Llama; the weights "
                           "would not compute the same function")
    return hf


def _hf_tensors(hf_dir: str):
    """(name, tensor) of every weight, read lazily from the safetensors files."""
    from safetensors import safe_open

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    elif os.path.exists(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConvertError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json "
                           "(PyTorch .bin weights: load and re-save them with save_pretrained)")
    for file in files:
        with safe_open(os.path.join(hf_dir, file), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def from_hf(args: argparse.Namespace) -> str:
    hf = _hf_config(args.hf)
    tied = bool(hf.get("tie_word_embeddings", False))
    weights = {}
    for name, tensor in _hf_tensors(args.hf):
        if name.startswith("model."):
            name = name[len("model."):]
        elif name != "lm_head.weight":
            continue  # e.g. rotary inv_freq buffers of old exports
        if tied and name == "lm_head.weight":
            continue
        weights[name] = tensor.float().contiguous()
    layers = hf["num_hidden_layers"]
    expected = ["embed_tokens.weight", "norm.weight"] + ([] if tied else ["lm_head.weight"]) + [
        f"layers.{i}.{w}.weight" for i in range(layers) for w in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ConvertError(f"{args.hf}: the weights lack {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    vocab = hf["vocab_size"]
    if weights["embed_tokens.weight"].shape[0] != vocab:
        raise ConvertError(f"{args.hf}: embed_tokens has {weights['embed_tokens.weight'].shape[0]} rows but "
                           f"config.json says vocab_size={vocab}")
    state = rank_state(iteration=0, consumed_samples=0, model={n: weights[n] for n in expected},
                       optimizer_step=0, moments={n: {} for n in expected}, scaler=None)
    with new_directory(args.output) as tmp:
        write_rank_state(rank_file(tmp, 0), state)
        write_metadata(tmp, metadata(iteration=0, world_size=1, layout={"tp": 1, "pp": 1, "dp": 1},
                                     vocab_size=vocab, padded_vocab=vocab, converted_from=os.path.abspath(args.hf)))
    flags = (f"--model.num_layers {layers} --model.hidden_size {hf['hidden_size']} "
             f"--model.num_heads {hf['num_attention_heads']} --model.num_kv_heads "
             f"{hf.get('num_key_value_heads') or hf['num_attention_heads']} --model.ffn_hidden_size "
             f"{hf['intermediate_size']} --model.vocab_size {vocab} --model.rope_theta {hf.get('rope_theta', 10000.0)} "
             f"--model.norm_eps {hf.get('rms_norm_eps', 1e-6)} --model.tie_embeddings {str(tied).lower()}")
    return f"wrote {args.output}; train from it with --checkpoint.load {args.output} and\n  {flags}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        print(to_hf(args) if args.command == "to-hf" else from_hf(args))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
