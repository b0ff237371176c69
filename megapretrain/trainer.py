"""The training loop: build everything from the config, then step, log, evaluate and checkpoint.

Read top to bottom: ``Trainer.__init__`` builds this rank's model chunks, the optimizer, data and
writers and resumes from the latest checkpoint; ``fit`` is the loop; ``train_step`` is one
optimizer step over the global batch — its micro-batches run through the pipeline schedule (with
pp=1 simply one after the other), gradients accumulate in fp32; ``evaluate`` runs the valid split.

The logged ``loss`` is the mean over every token of the step's global batch: each rank sums its
per-token losses and divides by the global token count, and the sums are added over dp — so it is
the same number on every rank and under every layout.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from .checkpoint.format import rank_state, read_metadata
from .checkpoint.manager import CheckpointManager, resolve_checkpoint
from .checkpoint.reshard import SavedShards, resharded_state, saved_padded_vocab
from .config import Config, RunSizes, resolve_schedule, save_config, to_dict
from .data import build_gpt_datasets, describe_datasets, format_description
from .data.sampler import BatchLoader
from .model.build import DTYPES, build_model_chunks
from .model.llama import flops_per_token, num_parameters
from .monitor.flops import device_peak_tflops
from .monitor.metrics import MetricsLogger
from .optim.lr_schedule import LRSchedule
from .optim.optimizer import MixedPrecisionAdamW
from .parallel.pipeline import P2P, PipelineExecutor, forward_only_order, peak_in_flight, schedule_order
from .parallel.state import ParallelState
from .recovery import Detector, RecoveryError, describe, run_alert_command


def memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or the process's resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Trainer:
    def __init__(self, cfg: Config, sizes: RunSizes, ps: ParallelState):
        self.cfg, self.sizes, self.ps, self.device = cfg, sizes, ps, ps.device
        t = cfg.train
        self.is_logger = ps.rank == 0
        self.tokens_per_batch = t.global_batch_size * t.seq_length
        self.iteration, self.consumed_samples = 0, 0
        self.last_loss: float | None = None
        os.makedirs(cfg.run.dir, exist_ok=True)

        torch.manual_seed(t.seed + 100 * ps.pp_rank)  # dropout outside tp regions; weights are seeded by name
        self.model_chunks, self.specs = build_model_chunks(cfg, ps)  # specs: the parameter-spec table
        self.args = self.model_chunks[0].args
        named_params = [np for chunk in self.model_chunks for np in chunk.named_parameters()]
        self.optimizer = MixedPrecisionAdamW(named_params, self.specs, cfg.optim, t.precision, ps,
                                             zero=cfg.parallel.zero, bucket_size_mb=cfg.parallel.bucket_size_mb)
        self.optimizer.overlap_param_gather(self.model_chunks)  # zero ≥ 1: all-gather under the next forward
        self.num_micro = sizes.grad_accum
        self.pipeline_schedule = resolve_schedule(cfg.parallel.pp_schedule, ps.pp.size, cfg.parallel.vpp,
                                                  self.num_micro)
        pp, vpp = ps.pp.size, cfg.parallel.vpp  # every stage's order: the executor plans the transfers from all
        self.train_orders = [schedule_order(self.pipeline_schedule, r, pp, vpp, self.num_micro) for r in range(pp)]
        self.eval_orders = [forward_only_order(pp, vpp, self.num_micro)] * pp
        act_seq = t.seq_length // ps.tp.size if cfg.parallel.sequence_parallel and ps.tp.size > 1 else t.seq_length
        p2p = P2P(ps.pp, (t.micro_batch_size, act_seq, self.args.hidden_size), DTYPES[t.precision],
                  self.device) if ps.pp.size > 1 else None
        self.pipeline = PipelineExecutor(ps.pp_rank, ps.pp.size, cfg.parallel.vpp, p2p,
                                         self.optimizer.grad_sync, record=cfg.parallel.pp_trace)
        self.lr_schedule = LRSchedule.from_config(cfg, sizes.decay_iters)
        self.flops_per_token = flops_per_token(self.args, t.seq_length)
        self.peak_tflops = cfg.logging.peak_tflops or device_peak_tflops(self.device, t.precision)

        self.datasets = self._build_datasets()
        needs_data = any(c.pre_process or c.post_process for c in self.model_chunks)  # first/last stage
        self.loaders = {split: BatchLoader(ds, ps.dp_rank, ps.dp.size, t.micro_batch_size, self.device)
                        for split, ds in self.datasets.items() if ds is not None and needs_data}

        layout = {"tp": ps.tp.size, "pp": ps.pp.size, "dp": ps.dp.size}
        self.checkpoints = CheckpointManager(cfg.run.dir, rank=ps.rank, world_size=ps.world_size,
                                             layout=layout, vocab_size=self.args.vocab_size,
                                             padded_vocab=sizes.padded_vocab, keep_last=cfg.checkpoint.keep_last,
                                             keep_every=cfg.checkpoint.keep_every,
                                             async_save=cfg.checkpoint.async_save, device=self.device)
        self.resharded_from: dict | None = None  # the saved layout, when it differs from this one
        r = cfg.recovery
        self.detector = None if r.action == "none" else Detector(
            r.spike_zscore, r.window, r.min_std_fraction, r.max_bad_steps, fp16=t.precision == "fp16")
        self.rollbacks = 0
        resumed_from = self._maybe_resume()
        if self.is_logger:
            self._write_config()
        self.metrics = MetricsLogger(cfg.run.dir, enabled=self.is_logger, tensorboard=cfg.logging.tensorboard,
                                     wandb=cfg.logging.wandb, config=to_dict(cfg),
                                     run_name=cfg.run.name or os.path.basename(os.path.abspath(cfg.run.dir)))
        self._stop_requested = False
        self.log(sizes.describe(num_parameters(self.args), self.flops_per_token))
        self.log(format_description(describe_datasets(self.datasets)))
        self._log_memory()
        if resumed_from:
            if self.resharded_from is None:
                self.log(f"resumed from {resumed_from} at iteration {self.iteration}")
                self.metrics.event("resumed", self.iteration, checkpoint=resumed_from)
            else:
                now = {**layout, "padded_vocab": sizes.padded_vocab}
                self.log(f"resumed from {resumed_from} at iteration {self.iteration}, resharded from "
                         f"{self.resharded_from} to {now} (dropout's random streams restart from the seed)")
                self.metrics.event("resumed", self.iteration, checkpoint=resumed_from,
                                   resharded_from=self.resharded_from, layout=now)

    # -- the loop ---------------------------------------------------------------------------------

    def fit(self) -> None:
        """Train to ``train.iters``; SIGTERM (handled only while this runs) saves at the next step
        boundary and returns."""
        on_main_thread = threading.current_thread() is threading.main_thread()  # where signals can be caught
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if on_main_thread else None
        try:
            self._fit()
        finally:
            if on_main_thread:
                signal.signal(signal.SIGTERM, previous)

    def _fit(self) -> None:
        t, c = self.cfg.train, self.cfg.checkpoint
        last_save = time.monotonic()
        while self.iteration < t.iters:
            stats = self.train_step()
            self.iteration += 1
            if self.pipeline.record:
                self._write_trace()
            self.consumed_samples += t.global_batch_size
            if self.iteration % self.cfg.logging.interval == 0 or self.iteration == t.iters:
                self._log_step(stats)
            alert = self.detector and self.detector.observe(self.iteration, stats["loss"], stats["skipped"])
            if alert and self._on_alert(alert):
                continue  # rolled back: this iteration is trained again from the checkpoint
            if t.eval_interval and self.iteration % t.eval_interval == 0:
                self._log_eval(self.evaluate())
            timed = c.interval_minutes > 0 and self._agree(time.monotonic() - last_save > 60 * c.interval_minutes)
            stop = self._agree(self._stop_requested)
            if (c.interval and self.iteration % c.interval == 0) or timed or stop:
                self.save()
                last_save = time.monotonic()
            if stop:
                self.log(f"SIGTERM: saved at iteration {self.iteration}, exiting")
                break
        else:
            if t.eval_interval and self.iteration % t.eval_interval:
                self._log_eval(self.evaluate())
            if not (c.interval and self.iteration % c.interval == 0):
                self.save()
        self.checkpoints.finalize()
        self.metrics.close()
        for loader in self.loaders.values():
            loader.close()
        ckpt = os.path.join(self.cfg.run.dir, "checkpoints")
        self.log(f"done: metrics {os.path.join(self.cfg.run.dir, 'metrics.jsonl')}  "
                 f"tensorboard {os.path.join(self.cfg.run.dir, 'tensorboard')}  checkpoints {ckpt}")

    def train_step(self) -> dict:
        """One optimizer step over the global batch; returns the step's metrics."""
        ps = self.ps
        start = time.perf_counter()
        if ps.stats is not None:
            ps.stats.reset()
        for chunk in self.model_chunks:
            chunk.train()
        self.optimizer.zero_grad()
        batches, data_time = self._load("train", self.consumed_samples)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        forward = self._forward_fn(batches, loss_sum, self.optimizer.scaler.scale / self.tokens_per_batch)
        self.pipeline.run(self.train_orders, self.num_micro, forward)  # dp reduction overlaps the last backwards
        self.optimizer.reduce_grads()  # waits for the overlapped reductions
        ps.pp.all_reduce(loss_sum)  # the last stage holds the loss; now every rank does
        ps.dp.all_reduce(loss_sum)  # before step: not queued behind its async param all-gathers
        lr = self.lr_schedule(self.iteration + 1)
        grad_norm, skipped = self.optimizer.step(lr)
        elapsed = time.perf_counter() - start
        self.last_loss = loss_sum.item() / self.tokens_per_batch
        return {"loss": self.last_loss, "grad_norm": grad_norm, "lr": lr,
                "skipped": skipped, "step_time": elapsed, "data_time": data_time}

    def _forward_fn(self, batches: list, loss_sum: torch.Tensor, scale: float):
        """The pipeline's forward for one chunk and micro-batch: returns the activation for the next
        stage, or on the head's chunk adds the micro-batch's summed per-token losses to ``loss_sum``
        and returns what to backpropagate (that sum × ``scale``)."""
        def forward(chunk: int, micro: int, hidden: torch.Tensor | None) -> torch.Tensor:
            model = self.model_chunks[chunk]
            tokens, targets = batches[micro]
            out = model(tokens if model.pre_process else hidden, targets if model.post_process else None)
            if not model.post_process:
                return out  # (b, s, h) activation for the next stage
            loss_sum.add_(out.detach().sum())  # out: (b, s) fp32 per-token loss
            return out.sum() * scale
        return forward

    def _load(self, split: str, consumed_samples: int) -> tuple[list, float]:
        """This rank's (tokens, targets) micro-batches of the global batch after ``consumed_samples``,
        and the seconds the step waited for them (the loader reads one step ahead). Stages with
        neither the embedding nor the head read no data."""
        loader = self.loaders.get(split)
        if loader is None:
            return [(None, None)] * self.num_micro, 0.0
        batches = loader.get(consumed_samples, self.cfg.train.global_batch_size)
        return batches, loader.wait_s

    def _build_datasets(self) -> dict:
        """Train/valid datasets; one rank per node builds missing index caches, the others load them."""
        t, cfg = self.cfg.train, self.cfg
        valid_samples = t.eval_iters * t.global_batch_size if t.eval_interval > 0 else 0
        r, per_rollback = cfg.recovery, cfg.checkpoint.interval + cfg.recovery.skip_batches
        # room for the batches rollbacks skip: max_rollbacks of them, at most as many as the run has
        spare = min(r.max_rollbacks * per_rollback, t.iters) if r.action == "rollback" else 0
        args = (cfg.data.paths, cfg.data.split, t.seq_length, t.seed,
                {"train": (t.iters + spare) * t.global_batch_size, "valid": valid_samples, "test": 0},
                cfg.data.cache_dir or os.path.join(cfg.run.dir, "data_cache"))
        builder = int(os.environ.get("LOCAL_RANK", "0")) == 0
        datasets = build_gpt_datasets(*args, build_indices=True) if builder else None
        if dist.is_initialized():
            dist.barrier()
        return datasets if builder else build_gpt_datasets(*args, build_indices=False)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean per-token loss over the first ``eval_iters`` global batches of the valid split."""
        if self.datasets.get("valid") is None:
            return None
        t, ps = self.cfg.train, self.ps
        for chunk in self.model_chunks:
            chunk.eval()
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for step in range(t.eval_iters):
            batches, _ = self._load("valid", step * t.global_batch_size)
            self.pipeline.run(self.eval_orders, self.num_micro, self._forward_fn(batches, loss_sum, 1.0),
                              backward=False)
        ps.pp.all_reduce(loss_sum)
        ps.dp.all_reduce(loss_sum)
        return loss_sum.item() / (t.eval_iters * self.tokens_per_batch)

    # -- logging ----------------------------------------------------------------------------------

    def log(self, message: str) -> None:
        if self.is_logger:
            print(message, flush=True)

    def _log_step(self, s: dict) -> None:
        tokens_per_sec = self.tokens_per_batch / s["step_time"]
        tflops = self.flops_per_token * tokens_per_sec / self.ps.world_size / 1e12
        record = {"iter": self.iteration, "loss": s["loss"], "grad_norm": s["grad_norm"], "lr": s["lr"],
                  "tokens_per_sec": tokens_per_sec,
                  "consumed_tokens": self.consumed_samples * self.cfg.train.seq_length,
                  "step_time": s["step_time"], "data_time": s["data_time"], "tflops": tflops,
                  "memory_mb": memory_mb(self.device)}
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        if self.ps.stats is not None:
            record["comm"] = self.ps.stats.summary()  # per collective: calls and bytes this step
        if self.cfg.train.precision == "fp16":
            record["loss_scale"] = self.optimizer.scaler.scale
        self.metrics.log(record)
        if s["skipped"]:
            self.metrics.event("skipped_step", self.iteration, reason="non-finite gradient norm",
                               grad_norm=s["grad_norm"])
        self.log(f"iter {self.iteration:>6}/{self.cfg.train.iters} | loss {s['loss']:.4f} | "
                 f"grad_norm {s['grad_norm']:.3f} | lr {s['lr']:.3e} | {tokens_per_sec:,.0f} tok/s | "
                 f"{tflops:.3f} TFLOP/s | data {1e3 * s['data_time']:.0f} ms | mem {record['memory_mb']:,.0f} MB"
                 + (" | skipped" if s["skipped"] else ""))

    def _log_memory(self) -> None:
        """Bytes per rank (this rank's) for parameters, grads and optimizer state, from the tensors."""
        mem = self.optimizer.memory_report()
        per_param = mem["total"] / max(1, mem["padded_numel"])
        self.log("memory/rank: " + "  ".join(f"{k} {mem[k] / 2**20:,.2f} MiB"
                                             for k in ("params", "grads", "master", "moments", "total"))
                 + f"  ({per_param:.2f} bytes/param, zero={mem['zero']} dp={mem['dp']}"
                 + (", offloaded" if mem["offload"] else "") + ")")
        self.metrics.event("memory", self.iteration, **mem)

    def _write_trace(self) -> None:
        """Append this rank's schedule of the step just run to RUN_DIR/pipeline_trace_rankN.jsonl."""
        ops = [f"{op.kind}{op.micro}.{op.chunk}" for op in self.pipeline.trace]
        record = {"iter": self.iteration, "rank": self.ps.rank, "pp_rank": self.ps.pp_rank,
                  "schedule": self.pipeline_schedule, "ops": ops, "peak_in_flight": peak_in_flight(self.pipeline.trace)}
        path = os.path.join(self.cfg.run.dir, f"pipeline_trace_rank{self.ps.rank}.jsonl")
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def _log_eval(self, valid_loss: float | None) -> None:
        if valid_loss is None:
            return
        self.metrics.log({"iter": self.iteration, "valid_loss": valid_loss})
        self.log(f"iter {self.iteration:>6} | valid_loss {valid_loss:.4f}")

    def _write_config(self) -> None:
        """Write the resolved config; a different earlier one is kept under a new name."""
        path = os.path.join(self.cfg.run.dir, "config.yaml")
        if os.path.exists(path):
            new = path + ".new"
            save_config(self.cfg, new)
            with open(path) as a, open(new) as b:
                same = a.read() == b.read()
            if not same:
                os.replace(path, os.path.join(self.cfg.run.dir, f"config.before-iter{self.iteration}.yaml"))
            os.replace(new, path)
        else:
            save_config(self.cfg, path)

    # -- checkpoints ------------------------------------------------------------------------------

    def save(self) -> None:
        optim = self.optimizer.state_dict()
        rng = {"cpu": torch.get_rng_state(), "tracker": self.model_chunks[0].rng.get_states(),
               "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}
        state = rank_state(iteration=self.iteration, consumed_samples=self.consumed_samples,
                           model=self.optimizer.master_state_dict(), optimizer_step=optim["step"],
                           moments=optim["params"], scaler=optim["scaler"], rng=rng)
        self.checkpoints.save(self.iteration, state)
        self.metrics.event("checkpoint_saved", self.iteration,
                           path=os.path.join("checkpoints", f"iter_{self.iteration:07d}"))

    def _maybe_resume(self) -> str | None:
        path = self.checkpoints.latest() or self.cfg.checkpoint.load
        if not path:
            return None
        path = resolve_checkpoint(path)
        self._apply(self._read(path))
        return path

    def _read(self, path: str) -> dict:
        """This rank's state from checkpoint ``path``, whatever layout saved it."""
        meta = read_metadata(path)
        saved_padded = saved_padded_vocab(meta, self.args.vocab_size, self.args.vocab_divisible_by)
        if (meta["layout"] == self.checkpoints.layout and meta["world_size"] == self.ps.world_size
                and saved_padded == self.sizes.padded_vocab):
            return self.checkpoints.load(path)
        # another layout (or vocabulary padding): rebuild this rank's shards from the saved ones
        self.resharded_from = {**meta["layout"], "padded_vocab": meta.get("padded_vocab")}
        owned = {name: self.specs[name] for name in self.optimizer.fragments}  # under ZeRO: a share of them
        return resharded_state(SavedShards(path, meta), owned, self.ps.tp_rank, self.ps.tp.size, saved_padded)

    def _apply(self, state: dict) -> None:
        """Take weights, optimizer, position and (same layout only) random streams from a checkpoint."""
        self.optimizer.load_master_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.iteration, self.consumed_samples = state["iteration"], state["consumed_samples"]
        if "rng" not in state:
            return  # random streams are per rank: after a reshard they restart from the seed
        torch.set_rng_state(state["rng"]["cpu"])
        if "tracker" in state["rng"]:
            self.model_chunks[0].rng.set_states(state["rng"]["tracker"])
        if self.device.type == "cuda" and state["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    # -- recovery ---------------------------------------------------------------------------------

    def _on_alert(self, alert: dict) -> bool:
        """Report an alert and act on it; returns True when training was rolled back."""
        self.log(f"alert: {describe(alert)}")
        self.metrics.event("alert", self.iteration, **{k: v for k, v in alert.items() if k != "iter"})
        if self.is_logger:
            run_alert_command(self.cfg.recovery.alert_command, alert)
        return self.cfg.recovery.action == "rollback" and self._rollback(alert["since"])

    def _rollback(self, since: int) -> bool:
        """Reload the newest checkpoint from before iteration ``since``, set aside those saved since,
        and skip the global batches trained since then (plus ``recovery.skip_batches``)."""
        r, t = self.cfg.recovery, self.cfg.train
        if self.rollbacks >= r.max_rollbacks:
            raise RecoveryError(f"recovery: {self.rollbacks} rollbacks already (recovery.max_rollbacks) and the "
                                f"run is still unhealthy at iteration {self.iteration}; inspect metrics.jsonl, "
                                "then lower optim.lr or raise recovery.skip_batches and relaunch")
        self.checkpoints.finalize()
        path = self.checkpoints.newest_before(since)
        skip_to = self.consumed_samples + r.skip_batches * t.global_batch_size
        if path is None:
            self.log(f"recovery: no checkpoint from before iteration {since} to roll back to; going on")
            return False
        state = self._read(path)
        needed = skip_to + (t.iters - state["iteration"]) * t.global_batch_size
        if needed > len(self.datasets["train"]):
            self.log(f"recovery: skipping to sample {skip_to:,} would run past the {len(self.datasets['train']):,} "
                     "samples indexed for this run; going on without a rollback")
            return False
        bad_iteration = self.iteration
        self._apply(state)
        moved = self.checkpoints.set_aside_from(since, keep=path)
        skipped = skip_to - self.consumed_samples
        self.consumed_samples = skip_to
        self.detector.rewind(self.iteration)
        self.rollbacks += 1
        self.log(f"recovery: rolled back from iteration {bad_iteration} to {self.iteration} ({path}), skipping "
                 f"{skipped:,} samples; set aside {', '.join(moved) or 'no later checkpoints'}")
        self.metrics.event("rollback", self.iteration, from_iter=bad_iteration, checkpoint=path,
                           skipped_samples=skipped, consumed_samples=self.consumed_samples, set_aside=moved)
        return True

    def _on_sigterm(self, signum, frame) -> None:
        self._stop_requested = True

    def _agree(self, flag: bool) -> bool:
        """True on every rank when it is true on any (so all ranks save at the same step)."""
        if self.ps.world_size == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())
