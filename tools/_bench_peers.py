"""The peers ``tools/bench_train.py`` times against megapretrain, each at the config's shapes and
trained the way its own users train it on this device: Hugging Face transformers' Llama and a
nanoGPT checkout's GPT. Each builder returns ``step()``, one optimizer step over the global batch
that returns the summed loss as a device tensor (read after timing, as megapretrain's is)."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.nn.functional as F

from megapretrain.model.build import DTYPES


def hf_step(cfg, plan, batches, device):
    """One step of transformers' Llama: fp32 weights, autocast for bf16/fp16, torch AdamW."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m, o = cfg.model, cfg.optim
    hf_cfg = LlamaConfig(hidden_size=m.hidden_size, intermediate_size=plan.ffn_hidden_size,
                         num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                         num_key_value_heads=plan.num_kv_heads, vocab_size=plan.padded_vocab,
                         max_position_embeddings=cfg.train.seq_length, rope_theta=m.rope_theta,
                         rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
                         initializer_range=m.init_std, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(cfg.train.seed)
    model = LlamaForCausalLM(hf_cfg).to(device=device, dtype=torch.float32).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    amp = cfg.train.precision != "fp32"

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for tokens, targets in batches:
            with torch.autocast(device.type, dtype=DTYPES[cfg.train.precision], enabled=amp):
                logits = model(input_ids=tokens).logits  # (b, s, v)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
            (loss / plan.tokens_per_batch).backward()
            total += loss.detach()
        if o.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, o.clip_grad)
        opt.step()
        return total

    return step


def load_nanogpt(checkout: str):
    """nanoGPT's ``model`` module (``GPT``, ``GPTConfig``) from a checkout, or None when the
    directory holds no nanoGPT ``model.py``."""
    path = os.path.join(checkout, "model.py")
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("nanogpt_model", module)
    spec.loader.exec_module(module)
    return module if hasattr(module, "GPT") and hasattr(module, "GPTConfig") else None


def nanogpt_step(module, cfg, plan, batches, device):
    """One step of nanoGPT's GPT at the config's layers, heads, width, context and vocabulary, as
    its train.py runs it: ``configure_optimizers`` (AdamW, decay on matrices), autocast in the
    run's precision (nanoGPT's ``dtype``), the loss averaged per micro-batch and divided by the
    accumulation steps, gradient clipping. (A GPT-2 block: LayerNorm, GELU MLP of 4× the width,
    learned positions; the FLOPs per token differ from the Llama's, the tokens/s are compared.)"""
    m, o, t = cfg.model, cfg.optim, cfg.train
    gpt_cfg = module.GPTConfig(block_size=t.seq_length, vocab_size=plan.padded_vocab, n_layer=m.num_layers,
                               n_head=m.num_heads, n_embd=m.hidden_size, dropout=0.0, bias=False)
    torch.manual_seed(t.seed)
    model = module.GPT(gpt_cfg).to(device).train()
    opt = model.configure_optimizers(o.weight_decay, o.lr, tuple(o.betas), device.type)
    amp = t.precision != "fp32"
    batches = [(x.contiguous(), y.contiguous()) for x, y in batches]  # as its get_batch makes them (it .view()s)

    def step() -> torch.Tensor:
        total = torch.zeros((), device=device)
        for tokens, targets in batches:
            with torch.autocast(device.type, dtype=DTYPES[t.precision], enabled=amp):
                _, loss = model(tokens, targets)
            (loss / len(batches)).backward()
            total += loss.detach() * tokens.numel()
        if o.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step
