"""One rank of a run, simulated: the trainer's own program on fake tensors and a fake process group.

:func:`simulate_rank` resolves the config on the world size as ``train.py`` does, then inside

- torch.distributed's ``fake`` backend as rank R of N (every collective and point-to-point op is
  accepted and returns at once; groups of a 16,384-rank world are made in a fraction of a second);
- ``FakeTensorMode``: every tensor has its shape, dtype and storage size but no data, so no byte
  of the model is allocated and no FLOP is computed;
- for a GPU run, :func:`megapretrain.kernels.dispatch.simulated_device`: the program chooses its
  kernels, loss path and chunk sizes as on CUDA, and causal attention calls the flash op a GPU's
  dispatch calls (``model/attention.py``: ``causal_attention``) — the fake tensors themselves
  stay CPU tensors: torch builds without CUDA cannot differentiate fake CUDA ones,

it builds the real :class:`~megapretrain.trainer.Trainer` — model chunks (initialized on fake
tensors: nothing is drawn), process groups, the optimizer's buffers, the pipeline schedule — with
samples of the right shape in place of the data (:class:`ShapedSamples`), runs ``train_step``
``steps`` times under :class:`~.measure.Measurement`, and sizes the rank's checkpoint file from
the state its save would write. The trainer's start-up output is kept, not printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from ..checkpoint.format import rank_state_size
from ..config import Config
from ..data.checks import vocab_without_data
from ..errors import ConfigError
from ..kernels._triton import use_triton
from ..kernels.dispatch import simulated_device
from ..model.attention import dense_document_mask
from ..model.decoder import flops_per_token
from ..parallel.state import ParallelState
from ..planner.memory import stage_memory
from ..planner.model import layer_params
from ..planner.optimizer import OptimizerSpec
from ..planner.traffic import stage_traffic
from ..resolve import Resolved, resolve
from ..trainer import Trainer
from .measure import Measurement, ProgramTrace, breakdown, comm_by_group, largest

DEVICES = ("cuda", "cpu")  # what a simulated rank runs on (its choices of kernels and loss path)


class ShapedSamples:
    """``num_samples`` samples of ``seq_length + 1`` token ids, every one ``token``: what the
    trainer's loader reads in a simulation, where only the batches' shapes matter."""

    def __init__(self, num_samples: int, seq_length: int, token: int = 0):
        self.num_samples = num_samples
        self._sample = np.full(seq_length + 1, token, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        return self._sample

    def describe(self) -> list[dict]:
        return [{"split": "train", "prefix": "(simulated samples)", "documents": 0, "tokens": 0,
                 "weight": 1.0, "samples": self.num_samples, "epochs": 0.0}]


@dataclass
class RankResult:
    """What one simulated rank holds, moves and computes (bytes, FLOPs) and where its peak was."""
    rank: int
    coords: dict
    peak_bytes: int
    breakdown: dict
    peak_at: dict
    comm_bytes: dict
    comm_calls: dict
    flops: int
    model_flops: float
    checkpoint_bytes: int
    host_reads: list
    steps: int
    seconds: float
    # the largest alive at the peak
    peak_allocations: list = dataclasses.field(default_factory=list)
    # optim.offload: the optimizer state, in host memory (not in peak_bytes)
    host_optimizer_bytes: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def planned(cfg: Config, run: Resolved, pp_rank: int, device: str = "cuda",
            shard_rank: int = 0) -> dict:
    """The planner's figures for a rank of stage ``pp_rank`` in the simulation's terms: its memory
    (``planner/memory.py``) and traffic (``planner/traffic.py``) — {"planned_peak_bytes",
    "planned_breakdown", "planned_comm_bytes", "planned_comm_calls",
    "planned_host_optimizer_bytes"} (the last: ``optim.offload``'s state, off the device)."""
    triton = use_triton(device)  # what model.kernels / optim.impl auto choose on the device
    kernels = cfg.model.kernels if cfg.model.kernels != "auto" \
        else ("triton" if triton else "torch")
    p, t = cfg.parallel, cfg.train
    fused_adamw = cfg.optim.impl == "triton" or (cfg.optim.impl == "auto" and device == "cuda" and
                                                 triton
                                                 and not cfg.optim.offload)
    # as planner/model.py: estimate_run
    attention = "unfused" if dense_document_mask(cfg) else "flash"
    est = stage_memory(run.model, t.seq_length, run.layout, pp_rank, run.sizes.grad_accum,
                       layer=layer_params(run.model), precision=t.precision, schedule=p.pp_schedule,
                       kernels=kernels, bucket_mb=p.bucket_size_mb, attention=attention,
                       fused_adamw=fused_adamw, optimizer=OptimizerSpec.of(cfg.optim))
    host = est.pop("host_optimizer", 0.0)  # optim.offload: the optimizer state in host memory
    traffic = stage_traffic(run.model, t.seq_length, run.layout, pp_rank, run.sizes.grad_accum,
                            precision=t.precision, schedule=p.pp_schedule, device=device,
                            bucket_mb=p.bucket_size_mb, keep_gathered=p.zero3_keep_gathered,
                            optimizer=cfg.optim.optimizer, shard_rank=shard_rank,
                            ns_precision=cfg.optim.muon_ns_precision)
    nbytes, calls = traffic.as_dicts()
    return {"planned_peak_bytes": int(est.pop("total")),
            "planned_breakdown": {k: int(v) for k, v in est.items()}, "planned_comm_bytes": nbytes,
            "planned_comm_calls": calls, "planned_host_optimizer_bytes": int(host)}


def simulation_config(cfg: Config, run_dir: str) -> Config:
    """``cfg`` as a simulated rank runs it: on CPU tensors, at the full global batch (past any
    ramp-up), writing only into ``run_dir`` (no TensorBoard, no W&B, no background checkpoint
    thread)."""
    return dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, dir=run_dir),
        train=dataclasses.replace(cfg.train, device="cpu", compile=False, rampup_batch_size=None),
        logging=dataclasses.replace(cfg.logging, tensorboard=False, wandb=False),
        checkpoint=dataclasses.replace(cfg.checkpoint, async_save=False, load=None),
        watchdog=dataclasses.replace(cfg.watchdog, timeout_s=0.0))


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """torch.distributed as rank ``rank`` of ``world_size`` on the fake backend."""
    if dist.is_initialized():
        raise RuntimeError("a simulation needs a process without torch.distributed initialized")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def resolve_for_simulation(cfg: Config, world_size: int) -> Resolved:
    """``cfg`` resolved on ``world_size`` ranks as the simulation runs it: at the full global batch
    (the steps of a batch-size ramp-up are not simulated; :func:`rampup_refusal` checks them), with
    the one field a run reads from its data set."""
    vocab_without_data(cfg, "simulation")
    return resolve(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                      rampup_batch_size=None)),
                   world_size)


def rampup_refusal(cfg: Config, world_size: int) -> str | None:
    """Why ``train.py`` would refuse ``cfg`` on ``world_size`` ranks when its full batch resolves
    (:func:`resolve_for_simulation`) but a batch of its ramp-up does not — one under a sample a
    data-parallel rank, say."""
    if not cfg.train.rampup_batch_size:
        return None
    try:
        resolve(cfg, world_size)
    except ConfigError as exc:
        return str(exc)
    return None


def simulate_rank(cfg: Config, world_size: int, rank: int, steps: int = 2,
                  device: str = "cuda") -> RankResult:
    """Rank ``rank`` of ``cfg`` on ``world_size`` ranks for ``steps`` training steps (see the
    module docstring); ``device``: "cuda" (a GPU run's program) or "cpu"."""
    run = resolve_for_simulation(cfg, world_size)
    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank {rank} is not a rank of a world of {world_size}")
    if device not in DEVICES:
        raise ConfigError(f"--device {device} is not one of: {', '.join(DEVICES)}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="megapretrain-simulate-") as run_dir:
        sim_cfg = simulation_config(cfg, run_dir)
        with contextlib.ExitStack() as stack:
            stack.enter_context(fake_world(world_size, rank))
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            if device != "cpu":
                stack.enter_context(simulated_device(device))
            stack.enter_context(warnings.catch_warnings())
            # fake tensors' data pointers, deprecations of the fake backend
            warnings.simplefilter("ignore")
            log = stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            stack.enter_context(contextlib.redirect_stderr(log))
            ps = ParallelState.of(run.layout, device="cpu", comm_stats=True)
            result = measure_rank(sim_cfg, run, ps, steps)
    result.seconds = time.perf_counter() - started
    return result


def measure_rank(cfg: Config, run: Resolved, ps: ParallelState, steps: int) -> RankResult:
    """Build this rank's trainer for ``cfg`` (as :func:`simulation_config` left it) on the groups
    ``ps`` and measure ``steps`` training steps: on fake tensors inside :func:`simulate_rank`, or
    on real ones in a real process group (what the simulation is checked against)."""
    samples = ShapedSamples(run.sizes.train_samples + steps * cfg.train.global_batch_size,
                            cfg.train.seq_length)
    trace = ProgramTrace(ps.device)
    with trace:
        trainer = Trainer(cfg, run.sizes, ps, datasets={"train": samples},
                          eod=run.model.vocab_size - 1)
        measurement = Measurement(trainer, trace)
        records = measurement.run(steps)
        checkpoint_bytes = rank_state_size(trainer.run.checkpoint_state())
        parts = breakdown(trace, trace.peak_clock, trace.peak_phase, records)
        top = largest(trace, trace.peak_clock, trace.peak_phase, records)
        peak_at = trace.peak_phase.where() if trace.peak_phase is not None else {}
        for loader in trainer.loaders.values():
            loader.close()
    last = records[-1]
    comm_bytes, comm_calls = comm_by_group(last.comm)
    tokens = trainer._batch_size(trainer.consumed_samples) * cfg.train.seq_length
    coords = {"tp": ps.tp_rank, "cp": ps.cp_rank, "dp": ps.dp_rank, "pp": ps.pp_rank}
    return RankResult(rank=ps.rank, coords=coords, peak_bytes=trace.peak, breakdown=parts,
                      peak_at=peak_at, comm_bytes=comm_bytes, comm_calls=comm_calls,
                      flops=last.flops,
                      model_flops=flops_per_token(run.model,
                                                  cfg.train.seq_length) * tokens / ps.world_size,
                      checkpoint_bytes=checkpoint_bytes, host_reads=sorted(set(last.host_reads)),
                      steps=steps, seconds=0.0, peak_allocations=top,
                      host_optimizer_bytes=measurement.host_optimizer)


def check_layout(cfg: Config, world_size: int, steps: int = 1, device: str = "cuda") -> dict:
    """The planner's busiest pipeline stage of ``cfg`` on ``world_size`` ranks, simulated: its
    first rank's peak and traffic beside the planner's (what ``tools/plan.py --simulate`` and
    ``tools/preflight.py --world-size`` report)."""
    run = resolve_for_simulation(cfg, world_size)
    plans = [planned(cfg, run, stage, device) for stage in range(run.layout.pp)]
    stage = max(range(run.layout.pp), key=lambda s: plans[s]["planned_peak_bytes"])
    rank = int(run.layout.grid()[stage, 0, 0, 0])
    result = simulate_rank(cfg, world_size, rank, steps=steps, device=device)
    plan = plans[stage]
    return {"rank": rank, "pp_rank": stage, "peak_bytes": result.peak_bytes,
            "planned_peak_bytes": plan["planned_peak_bytes"],
            "memory_error": (plan["planned_peak_bytes"] - result.peak_bytes) / result.peak_bytes,
            "traffic_equal": (result.comm_bytes, result.comm_calls) == (plan["planned_comm_bytes"],
                                                                        plan["planned_comm_calls"]),
            "breakdown": result.breakdown, "peak_at": result.peak_at, "seconds": result.seconds}
