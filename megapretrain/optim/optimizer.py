"""Mixed-precision AdamW with an optional distributed (ZeRO) optimizer state.

Gradients live in the fp32 bucketed buffers of :mod:`megapretrain.parallel.data` and are reduced
over dp there. Each rank then steps fp32 master weights and Adam moments for its shard of every
bucket — the whole bucket with ``zero=0``, its 1/dp slice with ``zero`` 1 or 2 — and writes the
result back into the model's (bf16/fp16/fp32) parameters, which ``zero ≥ 1`` then all-gathers.

Per parameter and rank (bf16 model, N parameters, plus alignment padding)::

    zero   params  grads    master   moments
    0      2       4        4        8
    1      2       4        4/dp     8/dp
    2      2       4/dp     4/dp     8/dp
    3      2/dp    4/dp     4/dp     8/dp     + the layers gathered at the moment
                                              (parallel/zero3.py)

fp32 parameters are their own master (no extra copy) unless ``optim.offload`` keeps the masters
and moments (and Muon's momentum) in host memory, where they are stepped. A shard covers pieces
(*fragments*) of parameters; weight decay follows each fragment's parameter spec
(``parallel/specs.py``: none for norm weights) and checkpoints key state by parameter name and
fragment range. The global grad norm sums squares over the owned fragments of the parameters whose
spec counts them on this rank (replicated ones only on tp rank 0, a tied embedding's second copy
never), over dp (when sharded) and the model-parallel group; a non-finite norm skips the step and,
with fp16, halves the loss scale.

With ``optim.optimizer`` muon the decoder layers' matrices are stepped by Muon instead
(``optim/muon.py``: one momentum per element in place of Adam's two moments), after the same
unscaling, norm and clipping; ``optim.moments_dtype`` bf16 stores Adam's moments in bf16 (on
whichever AdamW ``optim.impl`` resolves to, as fp32 ones).
"""

from __future__ import annotations

import importlib.util
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import ConfigError
from ..kernels._triton import use_triton
from ..kernels.adamw import decay_mask, fused_adamw_, grad_sq_sum
from ..kernels.dispatch import device_type
from ..parallel.data import Bucket, DataParallelBuffers
from ..parallel.specs import ParamSpec
from ..parallel.state import ParallelState

if TYPE_CHECKING:
    from ..config import OptimConfig
from ..parallel.zero3 import LAYER_UNITS_ALIVE, ShardedUnits
from .muon import MuonSettings, MuonStep, is_muon_matrix


def check_optim(o: OptimConfig) -> None:
    """The optimizer's own rules: AdamW's betas, the fp16 loss-scale bounds, and an implementation
    that is installed and can step where the masters live."""
    if not (len(o.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas)):
        raise ConfigError(f"optim.betas={o.betas} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    if o.initial_loss_scale < o.min_loss_scale:
        raise ConfigError(f"optim.initial_loss_scale={o.initial_loss_scale} must be ≥ "
                          f"optim.min_loss_scale={o.min_loss_scale} > 0")
    if o.moments_dtype == "bf16" and o.impl == "apex":
        raise ConfigError("optim.moments_dtype=bf16 runs on the Triton or torch AdamW, not "
                          "optim.impl=apex: set optim.impl=auto, triton or torch (or "
                          "optim.moments_dtype=fp32)")
    if o.impl == "apex" and importlib.util.find_spec("apex") is None:
        raise ConfigError("optim.impl=apex: apex is not importable (install NVIDIA apex with its "
                          "CUDA extensions, or optim.impl=auto)")
    if o.optimizer == "muon" and o.impl not in ("auto", "torch"):
        raise ConfigError(f"optim.optimizer=muon steps its AdamW part with torch's fused AdamW, "
                          f"not optim.impl={o.impl}: set optim.impl=auto or torch")
    if o.impl not in ("auto", "torch") and o.offload:
        raise ConfigError(f"optim.impl={o.impl} steps on the GPU, optim.offload on the host: set "
                          "optim.impl=auto or torch")


class LossScaler:
    """Dynamic loss scaling for fp16: halve on overflow (and skip the step), double after
    ``window`` clean steps. A scale of 1 with ``dynamic=False`` is the bf16/fp32 no-op."""

    def __init__(self, initial: float = 1.0, window: int = 1000, min_scale: float = 1.0,
                 dynamic: bool = False):
        self.scale, self.window, self.min_scale, self.dynamic = float(
            initial), window, min_scale, dynamic
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


@dataclass
class Fragment:
    """Elements ``[start, end)`` of the flattened parameter ``name``, at ``offset`` in a shard."""
    name: str
    param: nn.Parameter
    spec: ParamSpec
    start: int
    end: int
    offset: int

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset:self.offset + self.end - self.start]


@dataclass(frozen=True)
class FragmentState:
    """What a rank's optimizer holds of one parameter, as plain data: elements ``[start, end)`` of
    the flattened tp shard (of ``shape``) of parameter ``name``, as flat tensors by key ("master",
    "exp_avg", "exp_avg_sq"). ``whole``: this rank steps the whole shard (zero 0). The optimizer
    yields these for a save and takes them back on a load; how they are stored is
    ``checkpoint/format.py``'s (its ``Entry``)."""
    name: str
    shape: tuple[int, ...]
    start: int
    end: int
    tensors: dict[str, torch.Tensor]
    whole: bool = False


def resolve_impl(choice: str, device: torch.device, offload: bool) -> str:
    """``optim.impl`` on ``device``: "triton" (kernels/adamw.py), "torch" or "apex". auto: triton on
    CUDA (unless offloaded: the host steps), torch elsewhere — with fp32 or bf16 moments alike."""
    kind = device_type(device)
    runs = use_triton(kind) and not offload
    if choice == "triton" and not runs:
        raise ConfigError(f"optim.impl=triton cannot run on {kind}: it needs triton and CUDA, or "
                          "TRITON_INTERPRET=1 on CPU (or set optim.impl=auto)")
    if choice == "apex" and kind != "cuda":
        raise ConfigError(f"optim.impl=apex runs on CUDA only, not {kind} (set optim.impl=auto)")
    if choice == "auto":
        return "triton" if runs and kind == "cuda" else "torch"
    return choice


class ShardState:
    """fp32 master weights, Adam moments and the grads of this rank's shard of one bucket."""

    def __init__(self, bucket: Bucket, buffers: DataParallelBuffers, ps: ParallelState,
                 offload: bool, impl: str = "torch", muon: bool = False,
                 moments_dtype: torch.dtype = torch.float32):
        self.bucket = bucket
        self.fragments = [Fragment(buffers.names[id(p)], p, buffers.spec_of[id(p)], start, end, off)
                          for p, start, end, off in bucket.fragments()]
        self.param_shard = bucket.param_shard  # (shard,) model dtype
        on_gpu = self.param_shard.device.type != "cpu"
        if self.param_shard.dtype == torch.float32 and not offload:
            self.master = self.param_shard  # fp32 parameters are their own master
        else:
            device = "cpu" if offload else self.param_shard.device
            self.master = torch.empty(bucket.shard_size, dtype=torch.float32, device=device,
                                      pin_memory=offload and on_gpu)
            self.master.copy_(self.param_shard)
        # optim.optimizer muon: its matrices' fragments keep one momentum each, and Adam's moments
        # are packed over the other fragments (moment_at: where each starts)
        self.momentum = {f.name: torch.zeros(f.end - f.start, dtype=torch.float32,
                                             device=self.master.device)
                         for f in self.fragments if muon and is_muon_matrix(f.spec)}
        adam = [f for f in self.fragments if f.name not in self.momentum]
        self.moment_at = None
        if self.momentum:
            starts = [0]
            for f in adam:
                starts.append(starts[-1] + f.end - f.start)
            self.moment_at = {f.name: at for f, at in zip(adam, starts)}
            self.exp_avg = torch.zeros(starts[-1], dtype=moments_dtype, device=self.master.device)
        else:
            self.exp_avg = torch.zeros_like(self.master, dtype=moments_dtype)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        # the grads Adam reads: the reduced shard itself, or a pinned host copy when offloaded from
        # a GPU
        self.grad_staging = torch.empty_like(self.master) if offload and on_gpu else None
        # AdamW's operands as per-fragment views, by whether the parameter decays
        self.adam = {decay: [[f.of(self.master) for f in adam if f.spec.weight_decay == decay],
                             [f.of(self.grad) for f in adam if f.spec.weight_decay == decay],
                             *[[self._moment(f, t) for f in adam if f.spec.weight_decay == decay]
                               for t in (self.exp_avg, self.exp_avg_sq)]]
                     for decay in (True, False)}
        # impl=triton: one kernel pass per shard, decaying by a bit mask, writing the model's copy
        # too
        self.decay_mask = self.param_out = None
        if impl == "triton":
            ranges = [(f.offset, f.offset + f.end - f.start, f.spec.weight_decay)
                      for f in self.fragments]
            # (shard/32,) int32
            self.decay_mask = decay_mask(bucket.shard_size, ranges, self.master.device)
            self.param_out = None if self.master is self.param_shard else self.param_shard
        self.params_current = False  # the fused step already wrote the model's parameters
        counted = [f for f in self.fragments if f.spec.counts_in_grad_norm(ps.tp_rank)]
        self.norm_views = ([bucket.grad_shard] if len(counted) == len(self.fragments)
                           else [f.of(bucket.grad_shard) for f in counted])

    @property
    def grad(self) -> torch.Tensor:
        return self.bucket.grad_shard if self.grad_staging is None else self.grad_staging

    def _moment(self, f: Fragment, moment: torch.Tensor) -> torch.Tensor:
        """Fragment ``f``'s part of one of Adam's moments."""
        if self.moment_at is None:
            return f.of(moment)
        at = self.moment_at[f.name]
        return moment[at:at + f.end - f.start]

    def state_of(self, f: Fragment) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of fragment ``f``, by key, as views: its fp32 master and Adam's
        moments, or Muon's momentum."""
        if f.name in self.momentum:
            return {"master": f.of(self.master), "momentum": self.momentum[f.name]}
        return {"master": f.of(self.master), "exp_avg": self._moment(f, self.exp_avg),
                "exp_avg_sq": self._moment(f, self.exp_avg_sq)}

    def write_back(self) -> None:
        """Copy the stepped masters into the model's parameters (cast to their dtype)."""
        if self.params_current:  # written by the fused AdamW in its own pass
            self.params_current = False
        elif self.master is not self.param_shard:
            self.param_shard.copy_(self.master, non_blocking=True)


def _sum_of_squares(flat: torch.Tensor, row: int = 1 << 14) -> torch.Tensor:
    """Σx² of a 1-D fp32 tensor in float64, at fp32 speed: CPU norm kernels accumulate in fp32
    along the tensor (1e-3 relative error at 2e7 elements), so take the norms of short rows and
    add their squares in float64 (about 1e-7 relative)."""
    body = flat.numel() // row * row
    total = torch.linalg.vector_norm(flat[:body].view(-1, row), dim=1).double().square().sum()
    if body < flat.numel():
        total = total + torch.linalg.vector_norm(flat[body:]).double().square()
    return total


def _apex_adamw(params, grads, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step, weight_decay,
                skip) -> None:
    """apex's multi-tensor AdamW, its capturable kernel
    (``apex.optimizers.FusedAdam(capturable=True)``'s: adam_w_mode, bias correction) whose step
    count, learning rate and skip flag are device tensors: a step skipped for a non-finite grad norm
    is skipped by the kernel, with nothing read on the host. ``step``: the 0-d step count as the
    torch path counts it, ``skip``: the 0-d skip flag."""
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    device = params[0].device
    # the kernel returns at once where it is 1
    noop = skip.to(device=device, dtype=torch.int32).reshape(1)
    lr_t = torch.full((1,), lr, dtype=torch.float32, device=device)
    # the grads' inverse scale: unscaled already
    one = torch.ones((1,), dtype=torch.float32, device=device)
    multi_tensor_applier(amp_C.multi_tensor_adam_capturable, noop,
                         [grads, params, exp_avg, exp_avg_sq], lr_t, beta1, beta2, eps,
                         step.to(device=device, dtype=torch.int32).reshape(1), 1, 1, weight_decay,
                         one)


class MixedPrecisionAdamW:
    """AdamW over fp32 master weights of ``named_params``, sharded over dp by ``zero``; ``specs``
    is their parameter-spec table (``model/build.py``). ``initialize(param, out)`` writes the
    initial value of a parameter built without storage (zero=3: ``deferred_initializer``). See the
    module docstring."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], specs: dict[str, ParamSpec],
                 optim_cfg, precision: str, ps: ParallelState, *, zero: int = 0,
                 bucket_size_mb: float = 32.0, overlap_grad_reduce: bool = True, initialize=None):
        named_params = [(n, p) for n, p in named_params if p.requires_grad]  # frozen ones: not ours
        names = [n for n, _ in named_params]
        if len(set(names)) != len(names):
            raise ValueError("parameter names must be unique (checkpoints are keyed by them): "
                             f"{names}")
        for n, p in named_params:
            if n not in specs or specs[n].local_shape != tuple(p.shape):
                raise ValueError(f"parameter '{n}' of shape {tuple(p.shape)} has no matching spec "
                                 f"({specs.get(n)}): build the specs with the model "
                                 "(model/build.py)")
        self.ps, self.zero, self.cfg = ps, zero, optim_cfg
        self.offload = optim_cfg.offload
        self.buffers = DataParallelBuffers(named_params, specs, ps.dp_cp, ps.tp, ps.embedding,
                                           zero=zero, bucket_size_mb=bucket_size_mb,
                                           overlap=overlap_grad_reduce, shard=ps.dp_shard,
                                           replicas=ps.dp_replicas, initialize=initialize)
        muon = optim_cfg.optimizer == "muon"
        # Muon's AdamW part: torch's fused AdamW (check_optim refuses the others); bf16 moments
        # (optim.moments_dtype) run on whichever AdamW fp32 ones would (apex is refused)
        self.bf16_moments = optim_cfg.moments_dtype == "bf16"
        self.impl = resolve_impl("torch" if muon else optim_cfg.impl, ps.device, self.offload)
        moments = torch.bfloat16 if self.bf16_moments else torch.float32
        self.shards = [ShardState(b, self.buffers, ps, self.offload, self.impl, muon, moments)
                       for b in self.buffers.buckets]
        self.muon = MuonStep(self.shards, self.buffers.spec_of, MuonSettings.of(optim_cfg), ps,
                             zero, self.offload) if muon else None
        self.fragments = {f.name: (s, f) for s in self.shards for f in s.fragments}
        self.step_count = 0  # steps taken, less the skipped ones settled (read on the host)
        # steps skipped and not yet settled (a device count: the torch AdamW's step is exact
        # meanwhile)
        self._unsettled_skips = torch.zeros((), dtype=torch.int64, device=ps.device)
        self.scaler = LossScaler(optim_cfg.initial_loss_scale, optim_cfg.loss_scale_window,
                                 optim_cfg.min_loss_scale, dynamic=precision == "fp16")
        if precision != "fp16":
            self.scaler.scale = 1.0
        self._async_param_gather = False
        self.units: ShardedUnits | None = None  # zero=3, once hook_models() has seen the model

    # -- gradients --------------------------------------------------------------------------------

    def zero_grad(self) -> None:
        self.buffers.zero_grad()

    def grad_sync(self, last: bool, split: tuple | None = None):
        """Context for one micro-batch's backward, or one part of a split backward (a zero-bubble
        schedule's B or W, ``split=(part, key)``); inside ``last=True`` each bucket's dp reduction
        starts as soon as its grads are complete (see :mod:`megapretrain.parallel.data`)."""
        return self.buffers.grad_sync(last, split)

    def reduce_grads(self) -> None:
        """Wait for (and launch any remaining) dp reductions; sequence-parallel norm weights are
        also summed over tp."""
        self.buffers.reduce_grads()

    def hook_models(self, chunks: list[nn.Module], *, keep_gathered: bool = False,
                    prefetch: bool = True, trace: bool = False) -> None:
        """Attach the parameter gathers to the model ``chunks``: under zero=3 each unit's gather
        and release around its use (parallel/zero3.py); under zero 1/2 the post-step all-gather
        running under the next forward (``overlap_param_gather``). Each chunk is also told the
        buffers holding its fp32 main grads (a weak reference: ``grad_sink``), into which its
        output layer's loss adds the weight's gradient itself (``model/fused_loss.py``)."""
        for chunk in chunks:
            chunk.grad_sink = weakref.ref(self.buffers)
        casts = {id(c.fp8_weights): c.fp8_weights for c in chunks if c.fp8_weights is not None}
        if len(casts) > 1:
            raise ValueError("the model chunks of a rank must share one fp8_weights "
                             "(model/build.py makes one)")
        # zero=3: FP8-gathered weights go there
        self.buffers.fp8_weights = next(iter(casts.values()), None)
        # one chunk and no pipeline: its backward follows its forward (keep the last layer)
        if self.zero == 3:
            self.units = ShardedUnits(self.buffers, chunks, keep_gathered=keep_gathered,
                                      prefetch=prefetch, keep_last=len(chunks) == 1 and
                                      self.ps.pp.size == 1, trace=trace)
        else:
            self.overlap_param_gather(chunks)

    def _refresh_params(self, async_op: bool = False) -> None:
        """After the shards changed: the model's parameters must show them (``async_op``: the
        all-gathers of zero 1/2 may run under the next forward)."""
        if self.units is not None:
            self.units.free_all()  # the next use gathers the new values
        else:
            self.buffers.gather_params(async_op=async_op)

    def overlap_param_gather(self, models: nn.Module | list[nn.Module]) -> None:
        """From now on the post-step all-gather (zero ≥ 1) runs while the next forward of
        ``models`` (a model or its chunks) does, each module waiting only for its own parameters."""
        for model in [models] if isinstance(models, nn.Module) else models:
            self.buffers.overlap_param_gather(model)
        self._async_param_gather = True

    def grad_norm(self, scale: float = 1.0) -> float:
        """Global L2 norm of the reduced grads over tp, pp and dp, each element counted once,
        divided by ``scale`` (grads still multiplied by the fp16 loss scale); inf when not
        finite."""
        return float(self._norm(scale))

    def _norm(self, scale: float = 1.0) -> torch.Tensor:
        """:meth:`grad_norm` as a 0-d float64 device tensor (no host sync)."""
        views = [v for s in self.shards for v in s.norm_views]
        device = self.shards[0].bucket.grad_shard.device if self.shards else self.ps.device
        sq = torch.zeros((), dtype=torch.float32, device=device)
        if views and self.impl == "triton":  # kernels/adamw.py: one read of each grad
            sq = sum(grad_sq_sum(v) for v in views).float()
        elif views and device.type == "cpu":
            sq = sum(_sum_of_squares(v) for v in views).float()
        elif views:
            sq = torch.stack(torch._foreach_norm(views)).pow(2).sum()
        if self.zero >= 1:
            # shards are disjoint: their squares add up (replicas hold copies)
            self.ps.dp_shard.all_reduce(sq)
        self.ps.mp.all_reduce(sq)
        sq = sq.double()
        return torch.where(torch.isfinite(sq), sq.sqrt() / scale, math.inf)

    # -- the step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, lr: float) -> tuple[float, bool]:
        """Unscale, clip and apply one AdamW step; returns (grad norm, whether the step was
        skipped), read on the host (this waits for the device): :meth:`step_on_device` and
        :meth:`settle`."""
        norm, found_inf = self.step_on_device(lr)
        skipped = bool(found_inf)
        self.settle(skipped)
        return float(norm), skipped

    @torch.no_grad()
    def step_on_device(self, lr: float,
                       grad_factor: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
        """Unscale, clip and apply one AdamW step without waiting for the device: returns the grad
        norm (0-d float64, inf when not finite) and whether the step is skipped (0-d bool), both
        device tensors. A non-finite grad norm (NaN/Inf in the reduced grads) skips the update on
        the device, leaving masters, moments and parameters unchanged. The caller reads the flags
        later (several steps' at once) and calls :meth:`settle` with each, in order, before
        saving; until then the steps skipped are counted on the device, so Adam's step count (its
        bias correction) is exact meanwhile. The fp16 loss scale needs each step's flag before
        the next step's backward: with fp16, read and settle every step.

        ``grad_factor``: a 0-d device tensor every reduced grad is multiplied by before the norm and
        the clipping (the trainer's under ``data.eod_mask_loss``: its backward ran with the scale of
        every token, and the count of the tokens kept is known on the device only)."""
        self.buffers.wait_params()
        grads = [s.bucket.grad_shard for s in self.shards]
        fused = self.impl == "triton"  # unscaling and clipping happen inside the AdamW pass
        scale = self.scaler.scale
        if fused and grad_factor is not None:
            # (,) on the device: the kernel multiplies by its inverse
            scale = scale / grad_factor.float()
        elif grad_factor is not None and grads:
            torch._foreach_mul_(grads, grad_factor.float() / scale)
        elif scale != 1.0 and not fused:
            torch._foreach_mul_(grads, 1.0 / scale)
        norm = self._norm(scale if fused else 1.0)
        found_inf = ~torch.isfinite(norm)
        clip_grad = self.cfg.clip_grad
        # clip_grad / (norm + 1e-6) where the norm exceeds clip_grad, else 1 (a multiply by 1 is
        # exact)
        clip = torch.where(norm > clip_grad, clip_grad / (norm + 1e-6), 1.0) if clip_grad > 0 \
            else None
        if clip is not None and not fused:
            torch._foreach_mul_(grads, clip.float())
        staged = [s for s in self.shards if s.grad_staging is not None]
        for s in staged:
            s.grad_staging.copy_(s.bucket.grad_shard, non_blocking=True)
        if staged:
            torch.cuda.current_stream(staged[0].bucket.grad_shard.device).synchronize()
        grad_scale = (clip if clip is not None else 1.0) / scale if fused else 1.0
        self._adamw(lr, found_inf, grad_scale=grad_scale)
        if self.muon is not None:
            self.muon.step(lr, found_inf)
        for s in self.shards:
            s.write_back()
        # zero 3: a unit still gathered would go stale
        self._refresh_params(async_op=self._async_param_gather)
        return norm, found_inf

    def settle(self, skipped: bool) -> None:
        """What a step's outcome changes on the host, once read (steps in order): a skipped step
        is not counted (Adam's bias correction) and, with fp16, lowers the loss scale (a clean one
        counts)."""
        self.scaler.update(skipped)
        if skipped:
            self.step_count -= 1
            self._unsettled_skips -= 1

    def _adamw(self, lr: float, found_inf: torch.Tensor,
               grad_scale: float | torch.Tensor = 1.0) -> None:
        """One decoupled-weight-decay Adam step over every shard, skipped where ``found_inf`` is
        set (on the device). ``optim.impl`` torch: torch's fused
        AdamW kernel (one pass over masters, grads and moments), so a single process matches
        ``torch.optim.AdamW(fused=True)`` bit for bit (``optim.moments_dtype`` bf16: moments
        stored in bf16, stepped in fp32 one shard at a time); triton: kernels/adamw.py, one pass
        per shard (bf16 moments widened as read, rounded as written) that also writes the bf16/fp16
        parameters and multiplies each grad as it reads it by ``grad_scale`` (the clip coefficient
        over the fp16 loss scale); apex: apex's capturable multi-tensor Adam (the skip flag and
        step count read on the device too)."""
        self.step_count += 1
        (beta1, beta2), eps = self.cfg.betas, self.cfg.eps
        if self.impl == "triton":
            for s in self.shards:
                fused_adamw_(s.grad, s.master, s.exp_avg, s.exp_avg_sq, lr=lr, beta1=beta1,
                             beta2=beta2, eps=eps, weight_decay=self.cfg.weight_decay,
                             step=self.step_count, param_out=s.param_out, decay=s.decay_mask,
                             grad_scale=grad_scale, found_inf=found_inf)
                s.params_current = s.param_out is not None
            return
        # the step as counted once every skipped one is settled: skips not read yet counted here
        self._unsettled_skips += found_inf
        step = float(self.step_count) - self._unsettled_skips.float()  # (,) fp32 on the device
        # bf16 moments: one shard at a time, its moments in fp32 for the step (a shard's worth of
        # fp32 at once), rounded back after
        groups = [(decay, [s]) for s in self.shards for decay in (True, False)] \
            if self.bf16_moments else [(decay, self.shards) for decay in (True, False)]
        for decay, shards in groups:
            params, grads, exp_avg, exp_avg_sq = ([v for s in shards for v in s.adam[decay][i]]
                                                  for i in range(4))
            if not params:
                continue
            stored = None
            if self.bf16_moments:
                stored = exp_avg + exp_avg_sq
                exp_avg, exp_avg_sq = [t.float() for t in exp_avg], [t.float() for t in exp_avg_sq]
            if self.impl == "apex":
                _apex_adamw(params, grads, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step,
                            self.cfg.weight_decay if decay else 0.0, found_inf)
                continue
            # the host, with optim.offload: the flags follow (a copy that waits)
            where = params[0].device
            torch._fused_adamw_(params, grads, exp_avg, exp_avg_sq, [],
                                [step.to(where)] * len(params), lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=self.cfg.weight_decay if decay else 0.0, eps=eps,
                                amsgrad=False, maximize=False,
                                found_inf=found_inf.float().to(where))
            if stored is not None:
                torch._foreach_copy_(stored, exp_avg + exp_avg_sq)

    # -- accounting -------------------------------------------------------------------------------

    def memory_report(self) -> dict:
        """Bytes this rank holds for parameters, gradients, fp32 masters and Adam moments, measured
        from the tensors' storages (a master that is the parameter itself costs nothing)."""
        self.buffers.wait_params()

        def storage_bytes(tensors, exclude=frozenset()) -> dict:
            # by storage (its address: tensors without data, fake ones, all have data pointer 0)
            out = {}
            for t in tensors:
                st = t.untyped_storage()
                if st._cdata not in exclude:
                    out[st._cdata] = st.nbytes()
            return out

        params = storage_bytes(self.buffers.param_buffers)
        report = {
            "params": sum(params.values()),
            "grads": sum(storage_bytes(self.buffers.grad_buffers).values()),
            "master": sum(storage_bytes([s.master for s in self.shards],
                                        exclude=params.keys()).values()),
            "moments": sum(storage_bytes([t for s in self.shards
                                          for t in (s.exp_avg, s.exp_avg_sq,
                                                    *s.momentum.values())]).values()), }
        staging = [s.grad_staging for s in self.shards if s.grad_staging is not None]
        if staging:
            report["grad_staging"] = sum(storage_bytes(staging).values())
        report["total"] = sum(report.values())
        if self.units is not None:  # not part of the total: transient, bounded by the design
            report["gathered_peak"] = self.gathered_peak_bytes()
        numel = sum(p.numel() for b in self.buffers.buckets for p in b.params)
        report.update(numel=numel, padded_numel=self.buffers.padded_numel(), zero=self.zero,
                      dp=self.ps.dp.size, shard=self.ps.dp_shard.size, offload=self.offload)
        return report

    def gathered_peak_bytes(self) -> int:
        """zero=3: the most bytes of full parameters gathered at once, by design: every chunk's
        root plus ``LAYER_UNITS_ALIVE`` of the largest decoder layers (parallel/zero3.py)."""
        def full(unit):
            return sum(b.numel * self.buffers.gathered_element_size(b) for b in unit.buckets)
        roots = sum(full(u) for u in self.units.units if u.root)
        layers = sorted((full(u) for u in self.units.units if not u.root), reverse=True)
        return roots + sum(layers[:LAYER_UNITS_ALIVE])

    # -- checkpointing: by parameter name and fragment range --------------------------------------

    def fragment_states(self) -> list[FragmentState]:
        """This rank's fragments with its fp32 masters and Adam moments, as views of the live state
        (no copies: whoever saves them copies them at most once)."""
        self.buffers.wait_params()
        return [FragmentState(f.name, tuple(f.param.shape), f.start, f.end, s.state_of(f),
                              whole=self.zero == 0)
                for s in self.shards for f in s.fragments]

    @torch.no_grad()
    def load_fragments(self, fragments: list[FragmentState]) -> None:
        """Take the values of ``fragments``, each one of this rank's (its name and range, as
        :meth:`fragment_states` gives them), by key; the model's parameters follow the masters."""
        masters = False
        for piece in fragments:
            s, f = self.fragments[piece.name]
            if (piece.start, piece.end) != (f.start, f.end):
                raise ValueError(f"fragment [{piece.start}, {piece.end}) of '{piece.name}' is not "
                                 f"this rank's [{f.start}, {f.end})")
            saved = s.state_of(f)
            for key, values in piece.tensors.items():
                saved[key].copy_(values.reshape(-1))
            masters = masters or "master" in piece.tensors
        if masters:
            for s in self.shards:
                s.write_back()
            self._refresh_params()

    def load_counters(self, step: int, scaler: dict | None) -> None:
        """Take Adam's step count and (unless None: a fresh one) the loss scaler's state."""
        self.step_count = int(step)
        self._unsettled_skips.zero_()  # the loaded count is settled
        if scaler is not None:
            self.scaler.load_state_dict(scaler)
