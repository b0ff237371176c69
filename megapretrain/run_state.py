"""What a run saves and restores: its resolved config, its checkpoints (whatever layout saved
them), the learning rate it trains at, and the rollback to a checkpoint when the run goes bad.
:class:`RunState` is the trainer's collaborator for all of it and owns its state: the checkpoint
manager, the learning-rate schedule and the factor rollbacks put on it, the rollbacks so far, the
checkpoints this launch saved. Where the run is (:class:`Position`) is shared with the trainer,
whose steps move it and whose resumes and rollbacks set it."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import yaml

from .checkpoint.directories import iter_dir_name
from .checkpoint.format import check_shapes, rank_state, read_metadata
from .checkpoint.manager import (
    CheckpointManager,
    milestone_iterations,
    optimizer_views,
    restore_optimizer,
)
from .checkpoint.merge import MergeInput, average_dir_name, normalised_weights, write_average
from .checkpoint.reshard import SavedShards, global_shapes, resharded_state, saved_padded_vocab
from .config import Config, save_config, to_dict
from .errors import ConfigError, UserError
from .optim.lr_schedule import LRSchedule, resumed_schedule
from .recovery import RecoveryError

# what the saved data position depends on: changing one on resume deserves a warning
RESUME_SENSITIVE = ("train.seq_length", "train.global_batch_size", "data.split", "data.paths",
                    "train.seed")


@dataclass
class Position:
    """Where a run is: optimizer steps completed, and samples of the train split consumed."""

    iteration: int = 0
    consumed_samples: int = 0


class RunState:
    """A run's saving, resuming and rolling back. ``position``: the trainer's; ``optimizer``,
    ``model_chunks`` and ``specs``: what a checkpoint holds the state of; ``log``: the trainer's
    console line (rank 0's)."""

    def __init__(self, cfg: Config, sizes, ps, position: Position, optimizer, model_chunks: list,
                 specs: dict, log: Callable[[str], None]):
        self.cfg, self.sizes, self.ps, self.device = cfg, sizes, ps, ps.device
        self.position, self.optimizer, self.model_chunks, self.specs = \
            position, optimizer, model_chunks, specs
        self.log, self.is_logger = log, ps.rank == 0
        self.args = model_chunks[0].args
        self.model_shapes = global_shapes(cfg)  # every parameter's global shape: checked on load
        c = cfg.checkpoint
        layout = ps.layout.meta(v_shape=sizes.schedule.v_shape)  # its chunks placed by the schedule
        self.checkpoints = CheckpointManager(cfg.run.dir, rank=ps.rank, world_size=ps.world_size,
                                             layout=layout, vocab_size=self.args.vocab_size,
                                             padded_vocab=sizes.padded_vocab, keep_last=c.keep_last,
                                             keep_every=c.keep_every,
                                             milestones=milestone_iterations(c.milestone_fraction,
                                                                             sizes.iters),
                                             async_save=c.async_save, tensors=self.model_shapes,
                                             device=self.device,
                                             prune_rolled_back=cfg.recovery.prune_rolled_back,
                                             sharding=self._sharding(),
                                             group=ps.checkpoint)
        self.lr_schedule = LRSchedule.from_config(cfg, sizes.decay_iters)
        self.lr_scale = 1.0  # recovery.lr_factor per rollback, compounding; saved in checkpoints
        self.rollbacks = 0
        self.resharded_from: dict | None = None  # the saved layout, when it differs from this one
        self.saved: list[int] = []  # the iterations this launch saved checkpoints at
        # seconds saves blocked training since the trainer last took them (take_stall)
        self.stall_s = 0.0

    def lr(self, iteration: int) -> float:
        """The learning rate of step ``iteration``: the schedule's, times the rollbacks' factor."""
        return self.lr_schedule(iteration) * self.lr_scale

    def take_stall(self) -> float:
        """The seconds saves (and waits for an async save's copy) blocked training since the last
        call."""
        stall, self.stall_s = self.stall_s, 0.0
        return stall

    def write_config(self) -> None:
        """Write the resolved config; a different earlier one is kept under a new name, and a
        resumed run that changed what the data order and the sample count depend on says so."""
        path = os.path.join(self.cfg.run.dir, "config.yaml")
        if os.path.exists(path):
            new = path + ".new"
            save_config(self.cfg, new)
            with open(path) as a, open(new) as b:
                same = a.read() == b.read()
            if not same:
                kept = os.path.join(self.cfg.run.dir,
                                    f"config.before-iter{self.position.iteration}.yaml")
                os.replace(path, kept)
                self._warn_changed(kept)
            os.replace(new, path)
        else:
            save_config(self.cfg, path)


    def _warn_changed(self, old_path: str) -> None:
        """On resume: warn, loudly, about changed fields that the saved data position depends on."""
        at = self.position
        if not at.iteration:
            return
        with open(old_path) as fh:
            old = yaml.safe_load(fh) or {}
        new = to_dict(self.cfg)
        for dotted in RESUME_SENSITIVE:
            section, key = dotted.split(".")
            before, now = (old.get(section) or {}).get(key), new[section][key]
            if before != now:
                print(f"warning: resuming at iteration {at.iteration} with {dotted} changed from "
                      f"{before} to {now}: the saved data position ({at.consumed_samples:,} "
                      "samples) was counted in the old one, so the data order no longer continues "
                      f"the run's; the old config is {old_path}", file=sys.stderr, flush=True)

    # -- checkpoints ------------------------------------------------------------------------------

    def checkpoint_state(self) -> dict:
        """This rank's state as its checkpoint file holds it; the weights and moments are views of
        the live optimizer state (no copies: the manager makes at most one)."""
        weights, moments = optimizer_views(self.optimizer)
        rng = {"cpu": torch.get_rng_state(), "tracker": self.model_chunks[0].rng.get_states(),
               "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda"
               else None}
        return rank_state(iteration=self.position.iteration,
                          consumed_samples=self.position.consumed_samples, model=weights,
                          optimizer_step=self.optimizer.step_count, moments=moments,
                          scaler=self.optimizer.scaler.state_dict(), rng=rng,
                          lr_scale=self.lr_scale, schedule=self.lr_schedule.to_dict())

    def save(self, metrics) -> None:
        """Save a checkpoint (async: in the background) and log to ``metrics`` how long training
        was blocked."""
        start, it = time.perf_counter(), self.position.iteration
        self.checkpoints.save(it, self.checkpoint_state())
        self.saved.append(it)
        metrics.event("checkpoint_saved", it, path=os.path.join("checkpoints", f"iter_{it:07d}"),
                      checkpoint_stall_s=time.perf_counter() - start,
                      async_save=self.checkpoints.async_save)
        self.stall_s += time.perf_counter() - start  # shown on the next logged step

    def wait_snapshot(self) -> None:
        """Before the optimizer changes the weights: wait for an async save still copying them."""
        self.stall_s += self.checkpoints.wait_snapshot()

    def resume(self) -> str | None:
        """Resume from this run's newest usable checkpoint (passing over damaged ones with a
        warning), else start from ``checkpoint.load``: all of it, or — ``checkpoint.finetune`` —
        its weights only, with a fresh optimizer, schedule and data position."""
        c = self.cfg.checkpoint
        path, warnings = self.checkpoints.choose(c.load)
        for warning in warnings:
            if self.is_logger:
                print(f"warning: checkpoint: {warning}", file=sys.stderr, flush=True)
        if path is None:
            return None
        own = os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.checkpoints.root)
        fresh = c.finetune and not own  # once the new run saved, it resumes from its own as usual
        state = self._read(path, moments=c.load_optimizer and not fresh)
        self._apply(state, optimizer=c.load_optimizer and not fresh, rng=c.load_rng and not fresh,
                    position=not fresh)
        # the learning-rate factor of earlier rollbacks goes on (a rollback keeps its own)
        if not fresh:
            self.lr_scale = float(state.get("lr_scale", 1.0))
            self._check_work_left(path)
            self._resume_schedule(state.get("schedule"))
        return path

    def _check_work_left(self, path: str) -> None:
        """A resumed run with no step left to train is refused: it would exit having done
        nothing."""
        iters, at = self.sizes.iters, self.position.iteration
        if at < iters:
            return
        length = "train.iters" if self.cfg.train.train_tokens is None \
            else "the steps of train.train_tokens"
        where = f"the run in {self.cfg.run.dir} ({path})"
        state = f"{where} has finished its {length}={iters}" if at == iters else \
            f"{length}={iters} is below iteration {at}, which {where} has reached"
        raise ConfigError(f"nothing to do: {state}; raise --train.iters above {at} to train "
                          "further, or choose another --run.dir to start afresh")

    def _resume_schedule(self, saved: dict | None) -> None:
        """Keep the learning-rate schedule the checkpoint was trained with (``resumed_schedule``),
        saying what it does when the run is extended, and warning in one line when the rate of
        the next step is not the one that schedule gives."""
        kept = LRSchedule.from_dict(saved) if isinstance(saved, dict) else None
        self.lr_schedule, note = resumed_schedule(self.cfg, kept, self.position.iteration,
                                                  self.sizes.iters)
        if note:
            self.log(note)
        it = self.position.iteration + 1
        if kept is None or math.isclose(kept(it), self.lr_schedule(it), rel_tol=1e-9,
                                        abs_tol=1e-15):
            return
        if self.is_logger:
            print(f"warning: the learning rate changes at the resume: iteration {it} trains at "
                  f"{self.lr_schedule(it) * self.lr_scale:.4g} instead of "
                  f"{kept(it) * self.lr_scale:.4g}, the rate of the schedule the checkpoint was "
                  f"trained with ({kept.describe()}; now {self.lr_schedule.describe()})",
                  file=sys.stderr, flush=True)

    def _sharding(self) -> dict:
        """What this rank's ZeRO ranges depend on beyond the layout (recorded in checkpoints)."""
        p = self.cfg.parallel
        return {"zero": p.zero, "zero_shard_size": self.ps.dp_shard.size,
                "bucket_size_mb": p.bucket_size_mb}

    def _read(self, path: str, moments: bool = True) -> dict:
        """This rank's state from checkpoint ``path``, whatever layout saved it, after checking its
        tensors' shapes against the model (``moments=False``: they may be left out)."""
        meta = read_metadata(path)
        check_shapes(path, meta, self.model_shapes)
        saved_padded = saved_padded_vocab(meta, self.args.vocab_size, self.args.vocab_divisible_by)
        # (checkpoints from before the sharding was recorded were cut as this run cuts them)
        same_cut = meta.get("sharding", self._sharding()) == self._sharding()
        if (meta["layout"] == self.checkpoints.layout and meta["world_size"] == self.ps.world_size
                and saved_padded == self.sizes.padded_vocab and same_cut):
            return self.checkpoints.load(path)
        # another layout (or vocabulary padding): rebuild this rank's shards from the saved ones
        self.resharded_from = {**meta["layout"], "padded_vocab": meta.get("padded_vocab")}
        # under ZeRO: a share of them
        owned = {name: self.specs[name] for name in self.optimizer.fragments}
        saved = SavedShards(path, meta)
        try:
            return resharded_state(saved, owned, self.ps.tp_rank, self.ps.tp.size, saved_padded,
                                   moments=moments)
        finally:
            saved.close()

    def _apply(self, state: dict, *, optimizer: bool = True, rng: bool = True,
               position: bool = True) -> None:
        """Take weights, and unless told not to the optimizer, the position (iteration, data) and
        (same layout only) the random streams from a checkpoint."""
        restore_optimizer(self.optimizer, state, moments=optimizer)
        if position:
            self.position.iteration, self.position.consumed_samples = state["iteration"], state[
                "consumed_samples"]
        if not rng or "rng" not in state:
            return  # random streams are per rank: after a reshard they restart from the seed
        torch.set_rng_state(state["rng"]["cpu"])
        if "tracker" in state["rng"]:
            self.model_chunks[0].rng.set_states(state["rng"]["tracker"])
        if self.device.type == "cuda" and state["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    # -- the average of the last checkpoints ------------------------------------------------------

    def write_average(self, metrics) -> str | None:
        """``checkpoint.average_last`` K: once training has ended and its last checkpoint is
        published, write the uniform average of the run's newest K complete checkpoints (fewer
        when fewer were kept, none below two) beside them as ``average_last_K_iter_N`` in this
        run's layout (a fine-tune start: weights only). The first rank writes it while the others
        wait (collective). A failure to write it is a warning: the training itself is done."""
        k = self.cfg.checkpoint.average_last
        root = self.checkpoints.root
        done = self.checkpoints.complete()[-k:]
        path = os.path.join(root, average_dir_name(k, done[-1])) if done else None
        written = None
        try:
            if not self.is_logger:
                return None
            if len(done) < 2 or os.path.exists(path):
                why = (f"{path} exists" if done and os.path.exists(path) else
                       f"the run has {len(done)} checkpoint(s), an average needs two or more")
                self.log(f"checkpoint.average_last={k}: no average written ({why})")
                return None
            inputs = [MergeInput.open(os.path.join(root, iter_dir_name(i))) for i in done]
            try:
                write_average(inputs, normalised_weights(None, len(inputs)), self.cfg,
                              self.sizes, self.ps.world_size, path)
            finally:
                for one in inputs:
                    one.close()
            written = path
            self.log(f"checkpoint.average_last={k}: wrote {path}, the average of iterations "
                     f"{', '.join(map(str, done))} (weights only: start from it with "
                     "--checkpoint.load and --checkpoint.finetune true)")
            metrics.event("average_saved", done[-1], path=os.path.relpath(path, self.cfg.run.dir),
                          iterations=done)
        except (UserError, OSError) as exc:
            print(f"warning: checkpoint.average_last={k}: no average written: {exc}",
                  file=sys.stderr, flush=True)
        finally:
            self.checkpoints.group.barrier()
        return written

    # -- recovery ---------------------------------------------------------------------------------

    def rollback(self, since: int, bad_iteration: int, consumed_samples: int, train_samples: int,
                 metrics) -> bool:
        """Reload the newest checkpoint from before iteration ``since``, set aside those saved
        since, and skip the global batches trained up to ``bad_iteration`` — the step whose outcome
        made the verdict, after which ``consumed_samples`` samples were consumed (steps trained
        after it before it was read are dropped too) — plus ``recovery.skip_batches``, as far as the
        ``train_samples`` indexed for the run allow. Returns whether it rolled back."""
        r, t, at = self.cfg.recovery, self.cfg.train, self.position
        if self.rollbacks >= r.max_rollbacks:
            raise RecoveryError(f"recovery: {self.rollbacks} rollbacks already "
                                "(recovery.max_rollbacks) and the run is still unhealthy at "
                                f"iteration {bad_iteration}; inspect metrics.jsonl, then lower "
                                "optim.lr or raise recovery.skip_batches and relaunch")
        self.checkpoints.finalize()
        path = self.checkpoints.newest_before(since)
        skip_to = consumed_samples + r.skip_batches * t.global_batch_size
        if path is None:
            self.log(f"recovery: no checkpoint from before iteration {since} to roll back to; "
                     "going on")
            return False
        state = self._read(path)
        needed = skip_to + (self.sizes.iters - state["iteration"]) * t.global_batch_size
        if needed > train_samples:
            self.log(f"recovery: skipping to sample {skip_to:,} would run past the "
                     f"{train_samples:,} samples indexed for this run; going on without a rollback")
            return False
        self._apply(state)
        moved = self.checkpoints.set_aside_from(since, keep=path)
        skipped = skip_to - at.consumed_samples
        at.consumed_samples = skip_to
        self.rollbacks += 1
        self.lr_scale *= r.lr_factor  # compounds over rollbacks, whatever the checkpoint held
        self.log(f"recovery: rolled back from iteration {bad_iteration} to {at.iteration} "
                 f"({path}), skipping {skipped:,} samples, learning rate × {self.lr_scale:g} from "
                 f"here; set aside {', '.join(moved) or 'no later checkpoints'}")
        metrics.event("rollback", at.iteration, from_iter=bad_iteration, checkpoint=path,
                      skipped_samples=skipped, consumed_samples=at.consumed_samples,
                      set_aside=moved, lr_scale=self.lr_scale)
        return True
