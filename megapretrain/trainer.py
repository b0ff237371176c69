"""The training loop: build everything from the config, then step, log, evaluate and checkpoint.

Read top to bottom: ``Trainer.__init__`` builds this rank's model chunks, the optimizer, data and
writers and resumes from the latest checkpoint; ``fit`` is the loop; ``train_step`` is one
optimizer step over the global batch — its micro-batches run through the pipeline schedule (with
pp=1 simply one after the other), gradients accumulate in fp32; ``evaluate`` runs the valid split.
Saving, resuming and rolling back are :class:`megapretrain.run_state.RunState`'s (``self.run``),
which owns the checkpoints and the learning rate; the alerts, the spike detector and the closing
summary :class:`megapretrain.run_watch.RunWatch`'s (``self.watch``). Where the run is
(``self.position``: iteration, samples consumed) the trainer shares with ``self.run``.

The logged ``loss`` is the mean over every token of the step's global batch: each rank sums its
per-token losses and divides by the global token count, and the sums are added over dp and cp
(a cp rank's losses are those of its share of each sequence) — so it is the same number on every
rank and under every layout.

**Read points.** A training step reads nothing back from the device (on a GPU each read waits for
every kernel queued before it, and the host stops running ahead). Its loss, grad norm and skip
flag stay device tensors until a read point — a logging step (``logging.interval``), an
evaluation, a checkpoint save, the last step; with fp16 every step, whose loss scale the next
step needs — where every unread step's values come back in one copy. Then each step, in order,
settles the optimizer (a skipped step is not counted) and goes through the alerts and the spike
detector as it would have at once. What waits for the read point, and why that keeps behaviour:

- a non-finite step is skipped on the device when it happens
  (``MixedPrecisionAdamW.step_on_device``);
- a verdict of the detector rolls back to the checkpoint from before the trouble began, skipping
  the batches up to the step that completed the verdict (as at once): the steps trained since then
  are dropped with the rollback, and no checkpoint is saved in between (a save is a read point);
- a stop signal (SIGTERM, SIGUSR1, Ctrl-C) and ``checkpoint.interval_minutes``: one process acts
  on them at the next step boundary as before; several processes must agree on them (a
  collective and a read), which they do at the read points only, so the save comes up to
  ``logging.interval - 1`` steps later.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from .attempts import AttemptLog
from .config import Config, to_dict
from .data import build_gpt_datasets, describe_datasets, format_description
from .data.checks import DataFileWatch
from .data.gpt_dataset import parse_data_paths
from .data.sampler import BatchLoader, batch_size_at
from .data.tokenizers import build_tokenizer
from .errors import DataError, UserError
from .eval import DownstreamEval, PipelineScorer
from .faults import Faults, check_resumed_faults
from .model.build import DTYPES, build_model_chunks, deferred_initializer
from .model.decoder import documents, flops_per_token, num_parameters
from .monitor.anatomy import process_age_s
from .monitor.flops import device_peak_tflops
from .monitor.metrics import MetricsLogger
from .monitor.progress import Progress, describe_summary
from .monitor.watchdog import Watchdog
from .oom import OOM_EXIT, report_oom
from .optim.optimizer import MixedPrecisionAdamW
from .parallel.context import split_to_cp
from .parallel.pipeline import P2P, PipelineExecutor, peak_in_flight
from .parallel.random import CP_SEED_STRIDE
from .parallel.state import ParallelState
from .parallel.tensor import DeferredGrads, defer_weight_grads
from .recovery import check_spike_drill
from .resolve import RunSizes
from .run_lock import RunLock
from .run_state import Position, RunState
from .run_watch import RunWatch

IGNORE = -100  # the cross entropy's ignore index: a target left out of the loss


def recipe_warnings(num_params: int, tokens_per_batch: int) -> list[str]:
    """Where the run leaves the recipe: models above 1B train on batches of 2-4M tokens."""
    if num_params > 1e9 and not 2e6 <= tokens_per_batch <= 4.2e6:
        return [f"a global batch of {tokens_per_batch:,} tokens for a model of "
                f"{num_params / 1e9:.1f}B parameters: the recipe uses 2-4M tokens per step above "
                "1B (train.global_batch_size × train.seq_length)"]
    return []


def memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or the process's resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Trainer:
    def __init__(self, cfg: Config, sizes: RunSizes, ps: ParallelState, lock: RunLock | None = None,
                 *, datasets: dict | None = None, eod: int | None = None):
        """``lock``: rank 0's hold on the run directory, touched every step and released by fit().
        ``datasets``: the train (and valid) datasets to read batches from, in place of those of
        ``data.paths`` (a simulation's samples of the right shape), with ``eod`` their
        end-of-document id (else the tokenizer's)."""
        self.cfg, self.sizes, self.ps, self.device = cfg, sizes, ps, ps.device
        self.lock = lock
        t = cfg.train
        self.is_logger = ps.rank == 0
        self.position = Position()  # shared with self.run, whose resumes and rollbacks set it
        self.last_loss: float | None = None
        # the steps since the last read point, their values still on the device
        self._unread: list[dict] = []
        self._started = False  # whether fit() ran (the start-up to the first step is logged once)
        os.makedirs(cfg.run.dir, exist_ok=True)
        # this start's record (attempts.jsonl); a crash loop stops here
        self.attempt = AttemptLog(cfg.run.dir, ps)

        # dropout outside tp regions (cp ranks hold other tokens: other masks); weights are seeded
        # by name
        torch.manual_seed(t.seed + 100 * ps.pp_rank + CP_SEED_STRIDE * ps.cp_rank)
        d = cfg.data
        # eval.tasks, read, checked and tokenized once, before anything is built
        self.downstream = DownstreamEval(cfg, build_tokenizer(d.tokenizer.type,
                                                              d.tokenizer.model)) \
            if cfg.eval.tasks else None
        # specs: the parameter-spec table
        self.model_chunks, self.specs = build_model_chunks(cfg, ps)
        self.args = self.model_chunks[0].args
        named_params = [np for chunk in self.model_chunks for np in chunk.named_parameters()]
        self.optimizer = MixedPrecisionAdamW(named_params, self.specs, cfg.optim, t.precision, ps,
                                             zero=cfg.parallel.zero,
                                             bucket_size_mb=cfg.parallel.bucket_size_mb,
                                             initialize=deferred_initializer(self.model_chunks,
                                                                             self.specs, t.seed))
        # zero 1/2: the post-step all-gather runs under the next forward; zero 3: each layer
        # gathered around its use
        self.optimizer.hook_models(self.model_chunks,
                                   keep_gathered=cfg.parallel.zero3_keep_gathered,
                                   prefetch=cfg.parallel.zero3_prefetch)
        # the loss's backward always brings the gradient the forward was told (_forward_fn): the
        # fused output layer's check that it did is read at the next read point, not waited for per
        # micro-batch
        self.optimizer.buffers.grad_scale_checks = []
        # at the full global batch (evaluation; training after a ramp-up)
        self.num_micro = sizes.grad_accum
        self.pipeline_schedule = schedule = sizes.schedule  # parallel/pipeline.py's Schedule
        self._train_orders: dict[int, list] = {}  # micro-batches per step -> every stage's order
        self.eval_orders = [schedule.forward_order(ps.pp.size, cfg.parallel.vpp, self.num_micro)] \
            * ps.pp.size
        act_seq = t.seq_length // ps.cp.size  # a stage hands on its cp share of each sample
        act_seq //= ps.tp.size if cfg.parallel.sequence_parallel and ps.tp.size > 1 else 1
        p2p = P2P(ps.pp, (t.micro_batch_size, act_seq, self.args.hidden_size), DTYPES[t.precision],
                  self.device) if ps.pp.size > 1 else None
        # zero-bubble schedules: each backward's linear weight gradients wait for the schedule's W
        # op
        deferred = DeferredGrads(weakref.ref(self.optimizer.buffers)) if schedule.split_backward \
            else None
        defer_weight_grads(self.model_chunks, deferred)
        self.pipeline = PipelineExecutor(ps.pp_rank, ps.pp.size, cfg.parallel.vpp, p2p,
                                         self.optimizer.grad_sync, schedule,
                                         record=cfg.parallel.pp_trace, deferred=deferred)
        self.flops_per_token = flops_per_token(self.args, t.seq_length)
        self.peak_tflops = cfg.logging.peak_tflops or device_peak_tflops(self.device, t.precision,
                                                                         t.tf32)

        self.datasets = self._build_datasets() if datasets is None else datasets
        # the files of data.paths, checked at each logging step (a simulation's samples have none)
        self.data_watch = DataFileWatch(p for _, p in parse_data_paths(cfg.data.paths)) \
            if datasets is None else None
        # every stage needs the token ids
        self.documents = d.reset_attention_mask or d.reset_position_ids
        self.eod = None
        if self.documents or d.eod_mask_loss:
            self.eod = eod if datasets is not None \
                else build_tokenizer(d.tokenizer.type, d.tokenizer.model).eod
        needs_data = self.documents or any(c.pre_process or c.post_process
                                           for c in self.model_chunks)
        self.loaders = {split: BatchLoader(ds, ps.dp_rank, ps.dp.size, t.micro_batch_size,
                                           self.device)
                        for split, ds in self.datasets.items() if ds is not None and needs_data}
        if self.downstream is not None:  # scored by the evaluation's forward-only schedule
            self.downstream.scorer = PipelineScorer(self.model_chunks, ps, self.pipeline,
                                                    self.eval_orders, self.num_micro,
                                                    t.micro_batch_size)

        # saving, resuming, rolling back and the learning rate
        self.run = RunState(cfg, sizes, ps, self.position, self.optimizer, self.model_chunks,
                            self.specs, self.log)
        self.faults = Faults(cfg.faults, ps.rank, cfg.run.dir)
        self.watchdog = Watchdog(cfg.watchdog, cfg.run.dir, ps.rank, ps.activity)
        self.progress = Progress(sizes.iters)
        self.attempt.loading()
        try:
            resumed_from = self.run.resume()
        except UserError:
            self.attempt.withdraw()  # refused: no trace of this start in the run directory
            raise
        self.attempt.loaded(self.iteration, resumed_from)
        check_resumed_faults(cfg.faults, self.iteration, cfg.run.dir)
        drill = check_spike_drill(cfg, self.iteration) if "spike_at" not in self.faults.fired \
            else None
        if drill and self.is_logger:  # (the detector of a resumed run starts from an empty history)
            print(f"warning: {drill}", file=sys.stderr, flush=True)
        for drill in self.faults.already_fired():  # (said by the rank it was for)
            print(f"{drill} (rank {ps.rank}): fired already in this run directory (faults/): not "
                  "injected again", flush=True)
        if self.is_logger:
            self.run.write_config()
        self.metrics = MetricsLogger(cfg.run.dir, enabled=self.is_logger,
                                     tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                                     config=to_dict(cfg), run_name=cfg.run.name or
                                     os.path.basename(os.path.abspath(cfg.run.dir)))
        # alerts, the spike detector, the summary
        self.watch = RunWatch(cfg, ps, self.metrics, self.log)
        self._stop_requested: str | None = None  # the name of the signal that asked to stop
        self.log(sizes.describe(num_parameters(self.args), self.flops_per_token))
        for warning in recipe_warnings(num_parameters(self.args), sizes.tokens_per_batch):
            if self.is_logger:
                print(f"warning: {warning}", file=sys.stderr, flush=True)
        self.log(format_description(describe_datasets(self.datasets)))
        self._log_memory()
        if resumed_from:
            if self.run.resharded_from is None:
                self.log(f"resumed from {resumed_from} at iteration {self.iteration}")
                self.metrics.event("resumed", self.iteration, checkpoint=resumed_from)
            else:
                # what it saves
                now = {**self.run.checkpoints.layout, "padded_vocab": sizes.padded_vocab}
                self.log(f"resumed from {resumed_from} at iteration {self.iteration}, resharded "
                         f"from {self.run.resharded_from} to {now} (dropout's random streams "
                         "restart from the seed)")
                self.metrics.event("resumed", self.iteration, checkpoint=resumed_from,
                                   resharded_from=self.run.resharded_from, layout=now)

    @property
    def iteration(self) -> int:
        """Optimizer steps completed (``self.position``: resumes and rollbacks set it too)."""
        return self.position.iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.position.iteration = value

    @property
    def consumed_samples(self) -> int:
        """Samples of the train split consumed (``self.position``)."""
        return self.position.consumed_samples

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        self.position.consumed_samples = value

    # -- the loop ---------------------------------------------------------------------------------

    def fit(self) -> None:
        """Train to ``train.iters``. While this runs (and only then), SIGTERM and SIGUSR1 (SLURM's
        pre-emption warning) save at the next step boundary and return; so does a first Ctrl-C
        (SIGINT), a second one stops at once (KeyboardInterrupt)."""
        # where signals can be caught
        on_main_thread = threading.current_thread() is threading.main_thread()
        stops = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
        previous = {s: signal.signal(s, self._on_stop_signal) for s in stops} if on_main_thread \
            else {}
        try:
            self._fit()
        except BaseException as exc:
            self.attempt.ended(self.iteration, exc)
            raise
        else:
            self.attempt.ended(self.iteration, stop=self._stop_requested)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.lock is not None:
                self.lock.release()

    def _fit(self) -> None:
        self.watchdog.start()
        try:
            self._loop()
        finally:
            self.watchdog.stop()

    def _loop(self) -> None:
        t, c, iters = self.cfg.train, self.cfg.checkpoint, self.sizes.iters
        last_save = time.monotonic()
        first_iter, first_samples = self.iteration, self.consumed_samples
        self.progress.start(self.iteration)
        saved = False  # whether the pass that ended last saved its iteration
        changed = None  # what changed in a data file, when that stopped the run
        startup_s = None if self._started else process_age_s()  # this launch's first step
        if not self._started:  # after an earlier attempt: the restart event, its lost time
            self.attempt.training(self.iteration, self.metrics)
        self._started = True
        if startup_s is not None and self._agree(self._stop_requested is not None):
            # asked during start-up (train.py keeps it): nothing trained, nothing to save
            self.log(f"{self._stop_requested or 'a stop signal on another rank'} during start-up: "
                     f"stopping before the first step (at iteration {self.iteration})")
            self.metrics.close()
            for loader in self.loaders.values():
                loader.close()
            return
        if startup_s is not None:  # interpreter, imports, data indices, model build, resume
            # the CPU time of it: what a machine shared with others does not inflate
            cpu_s = time.process_time()
            self.log(f"start-up: {startup_s:.1f} s from process start to the first step "
                     f"({cpu_s:.1f} s of CPU)")
            self.metrics.event("first_step", self.iteration + 1, startup_s=round(startup_s, 2),
                               startup_cpu_s=round(cpu_s, 2))
        while self.iteration < iters:
            saved = False
            self.watchdog.beat("step", self.iteration + 1)
            stats = self._guarded_step()
            self.watchdog.done(stats["step_time"])
            # an async save every rank has written is published now
            self.run.checkpoints.step_boundary()
            self.iteration += 1
            self.progress.step(self.iteration)
            if self.lock is not None:
                self.lock.heartbeat()
            self.attempt.alive(self.iteration)
            if self.pipeline.record:
                self._write_trace()
            self.consumed_samples += stats["global_batch_size"]
            self._unread.append({**stats, "iter": self.iteration,
                                 "consumed_samples": self.consumed_samples})
            logged = self.iteration % self.cfg.logging.interval == 0 or self.iteration == iters
            evaluates = t.eval_interval and self.iteration % t.eval_interval == 0
            saves = c.interval and self.iteration % c.interval == 0
            if not (logged or evaluates or saves or self._read_now(last_save)):
                continue  # the step's values stay on the device: read with the next ones
            if self._read_steps(logged):
                continue  # rolled back: this iteration is trained again from the checkpoint
            if evaluates:
                self.watchdog.beat("eval", self.iteration)
                self._log_eval(self.evaluate())
                self.watch.alerts.settle()
            timed = c.interval_minutes > 0 \
                and self._agree(time.monotonic() - last_save > 60 * c.interval_minutes)
            changed = self.data_watch.changed() if logged and self.data_watch else None
            stop = self._agree(self._stop_requested or changed)
            if saves or timed or stop:
                self.watchdog.beat("save", self.iteration)
                self.run.save(self.metrics)
                self.watch.alerts.settle()
                last_save, saved = time.monotonic(), True
            if stop:
                why = changed or self._stop_requested or "a stop signal or a data change on " \
                    "another rank"
                self.log(f"{why}: saved at iteration {self.iteration}, exiting")
                break
        else:
            if t.eval_interval and self.iteration % t.eval_interval:
                self._log_eval(self.evaluate())
            if not saved:  # (by the interval, or by the clock)
                self.run.save(self.metrics)
        self.run.checkpoints.finalize()
        if c.average_last and self.iteration >= iters:  # trained to the end, not stopped
            self.run.write_average(self.metrics)
        summary = {**self.watch.summary(first_iter, first_samples, self.consumed_samples,
                                        self.progress.elapsed_s, self.run.saved),
                   **self.attempt.goodput()}  # effective training time over every attempt
        self.metrics.event("summary", self.iteration, **summary)
        self.metrics.close()
        for loader in self.loaders.values():
            loader.close()
        self.log(describe_summary({**summary, "iter": self.iteration}))
        if changed:
            raise DataError(f"{changed}: the run stopped at iteration {self.iteration} (saved); "
                            "restore the file and run the same command to resume, or resume on "
                            "the new file knowing the steps since the last logging step may have "
                            "read it")

    def _read_now(self, last_save: float) -> bool:
        """Whether the step just taken must be read although nothing scheduled asks for it: every
        step with fp16 (the next one's loss scale depends on it); with one process, a stop signal
        or a save the clock asks for (acted on at once: there is no other rank to agree with)."""
        if self.optimizer.scaler.dynamic:
            return True
        minutes = self.cfg.checkpoint.interval_minutes
        return self.ps.world_size == 1 and (self._stop_requested is not None or
                                            (minutes > 0 and
                                             time.monotonic() - last_save > 60 * minutes))

    def _read_steps(self, logged: bool) -> bool:
        """Read the unread steps' values in one copy and act on each in order: the optimizer's
        settling, the logged line (the last step, when ``logged``), the alerts and the spike
        detector. Returns True when a verdict rolled training back (the steps after it dropped)."""
        steps, self._unread = self._unread, []
        checks, self.optimizer.buffers.grad_scale_checks = \
            self.optimizer.buffers.grad_scale_checks, []
        # the mean loss divided on the device: the token count is a device value under
        # data.eod_mask_loss
        values = [v.double() for s in steps
                  for v in (s["loss_sum"].double() / s["tokens"], s["grad_norm"], s["skipped"])]
        flag = torch.stack(checks).any().double() if checks \
            else torch.zeros((), dtype=torch.float64, device=self.device)
        *read, differs = torch.stack(values + [flag.to(self.device)]).tolist()  # the one host read
        if differs:
            raise RuntimeError("a backward brought the fused loss another gradient than the one "
                               "its forward was told (loss_grad_scale): the trainer's forward and "
                               "backward disagree")
        now = time.perf_counter()
        for i, s in enumerate(steps):
            loss, norm, skipped = read[3 * i:3 * i + 3]
            self.optimizer.settle(bool(skipped))
            s.update(loss=loss, grad_norm=norm, skipped=bool(skipped))
        last = steps[-1]  # its times run to now: on a GPU the read waited for every step queued
        last.update(step_time=now - last["started"], optimizer_time=now - last["optimizer_started"])
        self.last_loss = last["loss"]
        tokens = sum(s["global_batch_size"] for s in steps) * self.cfg.train.seq_length
        for s in steps:
            if logged and s is last:
                self._log_step(s, tokens / (now - steps[0]["started"]))
            verdict = self.watch.observe(s, stragglers=logged and s is last)
            if verdict and self.run.rollback(verdict["since"], s["iter"], s["consumed_samples"],
                                             len(self.datasets["train"]), self.metrics):
                self.watch.rewound(self.iteration)
                return True
        return False

    def _guarded_step(self) -> dict:
        """``train_step``, with the injected faults of this iteration, and out-of-memory turned
        into guidance (the memory summary and the remedies with the planner's estimates)."""
        try:
            self.faults.before_step(self.iteration + 1)
            return self.train_step()
        except (torch.OutOfMemoryError, MemoryError) as exc:
            message = report_oom(exc, self.cfg, self.sizes.layout, self.ps.rank, self.iteration + 1,
                                 self.device)
            print(message, file=sys.stderr, flush=True)
            self.metrics.event("oom", self.iteration + 1, rank=self.ps.rank, error=str(exc)[:500])
            self.metrics.close()
            sys.exit(OOM_EXIT)

    def train_step(self) -> dict:
        """One optimizer step over the global batch, which reads nothing back from the device;
        returns the step's metrics as it left them — the loss sum, the grad norm and the skip flag
        still device tensors (:meth:`_read_steps` reads them) — with where its host time went
        (data wait, forward/backward, waiting for the gradient reduction, the optimizer)."""
        ps, it = self.ps, self.iteration + 1
        start = time.perf_counter()
        if ps.stats is not None:
            ps.stats.reset()
        for chunk in self.model_chunks:
            chunk.train()
        self.optimizer.zero_grad()
        batch = self._batch_size(self.consumed_samples)
        batches, data_time = self._load("train", self.consumed_samples)
        batches = self.faults.corrupt(it, self.consumed_samples, batches, self.args.vocab_size)
        # the backward runs with the scale of every token; with data.eod_mask_loss the count of the
        # tokens kept is a device value, and the optimizer multiplies the reduced grads by
        # every / kept before it clips them (reading the count here would wait for the device)
        every = batch * self.cfg.train.seq_length
        counted = self._counted_tokens(batches)
        tokens = every if counted is None else counted
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        scale = self.optimizer.scaler.scale / every * self.faults.grad_factor(it)
        computed = time.perf_counter()
        orders, num_micro = self._orders(batch)
        # dp reduction overlaps
        self.pipeline.run(orders, num_micro, self._forward_fn(batches, loss_sum, scale))
        backward_done = time.perf_counter()
        self.optimizer.reduce_grads()  # waits for the overlapped reductions
        ps.pp.all_reduce(loss_sum)  # the last stage holds the loss; now every rank does
        ps.dp_cp.all_reduce(loss_sum)  # before step: not queued behind its async param all-gathers
        reduced = time.perf_counter()
        lr = self.run.lr(it)
        self.run.wait_snapshot()  # an async save still copying what the step changes
        grad_norm, skipped = self.optimizer.step_on_device(lr, None if counted is None
                                                           else every / counted)
        now = time.perf_counter()
        return {"loss_sum": loss_sum, "tokens": tokens, "grad_norm": grad_norm, "lr": lr,
                "skipped": skipped, "global_batch_size": batch, "started": start,
                "step_time": now - start, "data_time": data_time,
                "forward_backward_time": backward_done - computed,
                "grad_sync_time": reduced - backward_done, "optimizer_started": reduced,
                "optimizer_time": now - reduced}

    def _orders(self, batch: int) -> tuple[list, int]:
        """Every stage's schedule order for a global batch of ``batch`` samples, and its
        micro-batches."""
        num_micro = batch // (self.cfg.train.micro_batch_size * self.ps.dp.size)
        if num_micro not in self._train_orders:
            # every stage's: the executor plans transfers from all
            pp, vpp = self.ps.pp.size, self.cfg.parallel.vpp
            self._train_orders[num_micro] = self.pipeline_schedule.orders(pp, vpp, num_micro)
        return self._train_orders[num_micro], num_micro

    def _forward_fn(self, batches: list, loss_sum: torch.Tensor, scale: float):
        """The pipeline's forward for one chunk and micro-batch: returns the activation for the next
        stage, or on the head's chunk adds the micro-batch's summed per-token losses to ``loss_sum``
        and returns what to backpropagate (that sum × ``scale``). Every cp rank loads the whole
        micro-batch and runs its share of each sample (``parallel/context.py``); the document
        structure is read off the whole sequence."""
        docs: dict = {}  # micro-batch -> its document structure, shared by this stage's chunks
        cp = self.ps.cp

        def forward(chunk: int, micro: int, hidden: torch.Tensor | None) -> torch.Tensor:
            model = self.model_chunks[chunk]
            tokens, targets = batches[micro]  # (b, s) each
            if self.documents and micro not in docs:
                d = self.cfg.data
                docs[micro] = documents(tokens, self.eod, d.reset_attention_mask,
                                        d.reset_position_ids, cp)
            # (b, s/cp): this rank's
            tokens, targets = split_to_cp(tokens, cp), split_to_cp(targets, cp)
            out = model(tokens if model.pre_process else hidden, targets if model.post_process
                        else None,
                        # what the backward of out.sum() * scale brings
                        docs.get(micro), loss_grad_scale=scale)
            if not model.post_process:
                return out  # (b, s, h) activation for the next stage
            loss_sum.add_(out.detach().sum())  # out: (b, s) fp32 per-token loss
            return out.sum() * scale
        return forward

    def _counted_tokens(self, batches: list) -> torch.Tensor | None:
        """The tokens the step's loss is the mean over: None for every one of the global batch, or
        with ``data.eod_mask_loss`` those whose target is not an end of document, a 0-d float64
        device tensor (at least 1), counted on the stage with the head and summed over dp and pp so
        that every rank holds it — never read here. Each cp rank holds its dp rank's whole
        micro-batches, so their count covers every cp share: not summed over cp."""
        if not self.cfg.data.eod_mask_loss:
            return None
        head = any(c.post_process for c in self.model_chunks)
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        for _, targets in batches:
            if head and targets is not None:
                count += (targets != IGNORE).sum()
        self.ps.dp.all_reduce(count)
        self.ps.pp.all_reduce(count)
        return count.clamp_(min=1)

    def _batch_size(self, consumed_samples: int) -> int:
        """The global batch of the training step after ``consumed_samples`` (batch-size ramp-up)."""
        t = self.cfg.train
        return batch_size_at(consumed_samples, t.global_batch_size, t.rampup_batch_size)

    def _load(self, split: str, consumed_samples: int) -> tuple[list, float]:
        """This rank's (tokens, targets) micro-batches of the global batch after
        ``consumed_samples`` (training: its size under the ramp-up), and the seconds the step waited
        for them (the loader reads one step ahead). Stages with neither the embedding nor the head
        read no data."""
        batch = self._batch_size(consumed_samples) if split == "train" \
            else self.cfg.train.global_batch_size
        start = time.perf_counter()
        if split == "train":
            self.faults.data_delay(self.iteration + 1)
        injected = time.perf_counter() - start
        loader = self.loaders.get(split)
        if loader is None:
            return [(None, None)] * (
                batch // (self.cfg.train.micro_batch_size * self.ps.dp.size)), injected
        batches = loader.get(consumed_samples, batch)
        if self.cfg.data.eod_mask_loss:  # end-of-document targets leave the loss
            batches = [(tokens, targets.masked_fill(targets == self.eod, IGNORE)) for tokens,
                       targets in batches]
        return batches, loader.wait_s + injected

    def _build_datasets(self) -> dict:
        """Train/valid datasets; one rank per node builds missing index caches, the others load
        them."""
        t, cfg = self.cfg.train, self.cfg
        valid_samples = t.eval_iters * t.global_batch_size if t.eval_interval > 0 else 0
        r, per_rollback = cfg.recovery, cfg.checkpoint.interval + cfg.recovery.skip_batches
        # room for the batches rollbacks skip: max_rollbacks of them, at most as many as the run has
        spare = min(r.max_rollbacks * per_rollback, self.sizes.iters) if r.action == "rollback" \
            else 0
        args = (cfg.data.paths, cfg.data.split, t.seq_length, t.seed,
                {"train": self.sizes.train_samples + spare * t.global_batch_size,
                 "valid": valid_samples, "test": 0}, cfg.data.cache_dir or
                os.path.join(cfg.run.dir, "data_cache"))
        # Local rank 0 builds what the cache lacks; the others map its files as they appear,
        # logging its progress while they wait (data/index_cache.py).
        return build_gpt_datasets(*args, build_indices=int(os.environ.get("LOCAL_RANK", "0")) == 0)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean per-token loss over the first ``eval_iters`` global batches of the valid split."""
        if self.datasets.get("valid") is None:
            return None
        t, ps = self.cfg.train, self.ps
        for chunk in self.model_chunks:
            chunk.eval()
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        counted = torch.zeros((), dtype=torch.float64, device=self.device)
        for step in range(t.eval_iters):
            batches, _ = self._load("valid", step * t.global_batch_size)
            kept = self._counted_tokens(batches)
            counted += t.global_batch_size * t.seq_length if kept is None else kept
            self.pipeline.run(self.eval_orders, self.num_micro,
                              self._forward_fn(batches, loss_sum, 1.0), backward=False)
        ps.pp.all_reduce(loss_sum)
        ps.dp_cp.all_reduce(loss_sum)
        return (loss_sum.double() / counted).item()

    # -- logging ----------------------------------------------------------------------------------

    def log(self, message: str) -> None:
        if self.is_logger:
            print(message, flush=True)

    TIME_PARTS = ("data_time", "forward_backward_time", "grad_sync_time", "optimizer_time")

    def _log_step(self, s: dict, tokens_per_sec: float) -> None:
        """The logged step's line; ``tokens_per_sec`` over the steps since the last read point."""
        tflops = self.flops_per_token * tokens_per_sec / self.ps.world_size / 1e12
        record = {"iter": s["iter"], "loss": s["loss"], "grad_norm": s["grad_norm"], "lr": s["lr"],
                  "tokens_per_sec": tokens_per_sec,
                  "consumed_tokens": self.consumed_samples * self.cfg.train.seq_length,
                  "global_batch_size": s["global_batch_size"], "step_time": s["step_time"],
                  **{k: s[k] for k in self.TIME_PARTS}, "checkpoint_stall_s": self.run.take_stall(),
                  "tflops": tflops, "memory_mb": memory_mb(self.device),
                  "elapsed_s": round(self.progress.elapsed_s, 3)}
        eta = self.progress.eta_s
        if eta is not None:
            record["eta_s"] = round(eta, 1)
        if self.run.lr_scale != 1.0:
            record["lr_scale"] = self.run.lr_scale
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
        self.log(f"iter {self.iteration:>6}/{self.sizes.iters} | loss {s['loss']:.4f} | "
                 f"grad_norm {s['grad_norm']:.3f} | lr {s['lr']:.3e} | {tokens_per_sec:,.0f} tok/s "
                 f"| {tflops:.3f} TFLOP/s | data {1e3 * s['data_time']:.0f} ms | mem "
                 f"{record['memory_mb']:,.0f} MB | {self.progress.describe()}"
                 + (" | skipped" if s["skipped"] else ""))

    def _log_memory(self) -> None:
        """Bytes per rank (this rank's) for parameters, grads and optimizer state, from the
        tensors."""
        mem = self.optimizer.memory_report()
        per_param = mem["total"] / max(1, mem["padded_numel"])
        self.log("memory/rank: " + "  ".join(f"{k} {mem[k] / 2**20:,.2f} MiB"
                                             for k in ("params", "grads", "master", "moments",
                                                       "total"))
                 + f"  ({per_param:.2f} bytes/param, zero={mem['zero']} dp={mem['dp']}"
                 + (f" sharded over {mem['shard']}" if mem["zero"] and mem["shard"] != mem["dp"]
                    else "")
                 + (", offloaded" if mem["offload"] else "") + ")"
                 + (f"; + up to {mem['gathered_peak'] / 2**20:,.2f} MiB of layers gathered at once"
                    if "gathered_peak" in mem else ""))
        self.metrics.event("memory", self.iteration, **mem)

    def _write_trace(self) -> None:
        """Append this rank's schedule of the step just run to
        RUN_DIR/pipeline_trace_rankN.jsonl."""
        ops = [f"{op.kind}{op.micro}.{op.chunk}" for op in self.pipeline.trace]
        record = {"iter": self.iteration, "rank": self.ps.rank, "pp_rank": self.ps.pp_rank,
                  "schedule": self.pipeline_schedule.name, "ops": ops,
                  "peak_in_flight": peak_in_flight(self.pipeline.trace)}
        path = os.path.join(self.cfg.run.dir, f"pipeline_trace_rank{self.ps.rank}.jsonl")
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def _log_eval(self, valid_loss: float | None) -> None:
        """The eval line: the validation loss and, with eval.tasks, the downstream tasks' scores
        and the time they took (not counted in any step's throughput: a step's time starts after
        it)."""
        record = {} if valid_loss is None else {"valid_loss": valid_loss}
        if self.downstream is not None:
            record.update(self.downstream.evaluate())
        if not record:
            return
        self.metrics.log({"iter": self.iteration, **record})
        self.log(f"iter {self.iteration:>6} | " + " | ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))

    def request_stop(self, name: str) -> None:
        """Stop as the stop signal ``name`` asks (one received before :meth:`fit`: before the
        first step)."""
        self._stop_requested = self._stop_requested or name

    def _on_stop_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self._stop_requested:
                raise KeyboardInterrupt  # the second Ctrl-C: stop now
            print("\nCtrl-C: saving at the next step boundary (press Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)
        self._stop_requested = signal.Signals(signum).name

    def _agree(self, flag: bool) -> bool:
        """True on every rank when it is true on any (so all ranks save at the same step): on the
        host, over the gloo checkpoint group (no device sync)."""
        if self.ps.world_size == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0])
        self.ps.checkpoint.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())
