"""Mixed-precision AdamW: fp32 main grads, fp32 master weights, global-norm clipping, loss scaling.

The model's parameters may be bf16 or fp16; their gradients are accumulated over micro-batches in
one contiguous fp32 buffer (``param.main_grad`` views into it), and the optimizer steps fp32 master
copies, then writes the result back into the model's parameters. With fp32 parameters the master
is the parameter itself. Weight decay skips 1-D parameters (norm weights, biases).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..parallel.state import ParallelState


class GradBuffer:
    """One fp32 buffer holding every parameter's ``main_grad``; autograd's ``.grad`` is folded in
    (and freed) as soon as it is accumulated, so micro-batches sum in fp32."""

    def __init__(self, params: list[nn.Parameter], device):
        total = sum(p.numel() for p in params)
        self.data = torch.zeros(total, dtype=torch.float32, device=device)
        offset = 0
        for p in params:
            p.main_grad = self.data[offset: offset + p.numel()].view(p.shape)
            offset += p.numel()
            p.register_post_accumulate_grad_hook(self._fold)

    @staticmethod
    def _fold(p: torch.Tensor) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None

    def zero(self) -> None:
        self.data.zero_()


class LossScaler:
    """Dynamic loss scaling for fp16: halve on overflow (and skip the step), double after
    ``window`` clean steps. A scale of 1 with ``dynamic=False`` is the bf16/fp32 no-op."""

    def __init__(self, initial: float = 1.0, window: int = 1000, min_scale: float = 1.0,
                 dynamic: bool = False):
        self.scale, self.window, self.min_scale, self.dynamic = float(initial), window, min_scale, dynamic
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.window:
                self.scale *= 2.0
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


def counts_in_norm(p: nn.Parameter, ps: ParallelState) -> bool:
    """Whether this rank's copy of ``p`` adds to the global grad norm: tp-split parameters always;
    replicated ones on tp rank 0 only; a tied embedding's copy on the last stage never."""
    if getattr(p, "pipeline_duplicate", False):
        return False
    return getattr(p, "tp_shard_dim", None) is not None or ps.tp_rank == 0


class MixedPrecisionAdamW:
    """AdamW over fp32 master weights of ``named_params``; see the module docstring."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], optim_cfg, precision: str,
                 ps: ParallelState):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.ps = ps
        self.clip_grad = optim_cfg.clip_grad
        device = self.params[0].device
        self.grad_buffer = GradBuffer(self.params, device)
        self.master = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        decay = [m for m in self.master if m.ndim >= 2]
        no_decay = [m for m in self.master if m.ndim < 2]
        groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.adam = torch.optim.AdamW([g for g in groups if g["params"]], lr=optim_cfg.lr,
                                      betas=tuple(optim_cfg.betas), eps=optim_cfg.eps, foreach=True)
        self.scaler = LossScaler(optim_cfg.initial_loss_scale, optim_cfg.loss_scale_window,
                                 optim_cfg.min_loss_scale, dynamic=precision == "fp16")
        if precision != "fp16":
            self.scaler.scale = 1.0
        self._norm_mask = [counts_in_norm(p, ps) for p in self.params]

    def zero_grad(self) -> None:
        self.grad_buffer.zero()

    def reduce_grads(self) -> None:
        """Sum grads over the ranks that hold copies: sequence-parallel norm weights over tp
        (each rank saw a slice of the sequence) and everything over dp."""
        for p in self.params:
            if getattr(p, "sequence_parallel", False):
                self.ps.tp.all_reduce(p.main_grad)
        if self.ps.dp.size > 1:
            self.ps.dp.all_reduce(self.grad_buffer.data)

    def grad_norm(self) -> float:
        """Global L2 norm of the (unscaled) grads over tp, pp and dp, each element counted once."""
        grads = [p.main_grad for p, keep in zip(self.params, self._norm_mask) if keep]
        sq = torch.zeros((), dtype=torch.float32, device=self.grad_buffer.data.device)
        if grads:
            sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
        self.ps.mp.all_reduce(sq)
        return math.sqrt(sq.item()) if torch.isfinite(sq) else float("inf")

    @torch.no_grad()
    def step(self, lr: float) -> tuple[float, bool]:
        """Unscale, clip and apply one AdamW step; returns (grad norm, whether the step was skipped).

        A non-finite grad norm skips the step (and lowers the fp16 loss scale)."""
        for m, p in zip(self.master, self.params):
            m.grad = p.main_grad  # autograd resets .grad of fp32 params (which are their own master)
        if self.scaler.scale != 1.0:
            self.grad_buffer.data.mul_(1.0 / self.scaler.scale)
        norm = self.grad_norm()
        found_inf = not math.isfinite(norm)
        self.scaler.update(found_inf)
        if found_inf:
            return norm, True
        if self.clip_grad > 0 and norm > self.clip_grad:
            self.grad_buffer.data.mul_(self.clip_grad / (norm + 1e-6))
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        for m, p in zip(self.master, self.params):
            if m is not p:
                p.copy_(m)
        return norm, False

    # -- checkpointing: keyed by parameter name, so it survives a change of layout later ---------

    def master_state_dict(self) -> dict:
        """The model's weights at full precision (the fp32 masters), by parameter name."""
        return {name: m.detach() for name, m in zip(self.names, self.master)}

    def state_dict(self) -> dict:
        """Adam moments and step per parameter name, and the loss scaler."""
        return {"params": {name: dict(self.adam.state.get(m, {})) for name, m in zip(self.names, self.master)},
                "scaler": self.scaler.state_dict()}

    @torch.no_grad()
    def load_master_state_dict(self, weights: dict) -> None:
        """Set the masters (and the model's parameters) from ``weights``, checking names and shapes."""
        for name, m, p in zip(self.names, self.master, self.params):
            if name not in weights:
                raise ValueError(f"checkpoint has no weight '{name}'")
            if tuple(weights[name].shape) != tuple(m.shape):
                raise ValueError(f"checkpoint weight '{name}' has shape {tuple(weights[name].shape)}, "
                                 f"the model expects {tuple(m.shape)}")
            m.copy_(weights[name])
            if m is not p:
                p.copy_(m)

    def load_state_dict(self, state: dict) -> None:
        for name, m in zip(self.names, self.master):
            entry = state["params"].get(name)
            if entry is None:
                raise ValueError(f"checkpoint has no optimizer state for '{name}'")
            if entry:
                self.adam.state[m] = {k: v.clone().to(m.device) if torch.is_tensor(v) and v.ndim else v
                                      for k, v in entry.items()}
        self.scaler.load_state_dict(state["scaler"])
