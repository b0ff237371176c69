"""Downstream evaluation: multiple-choice task files scored like lm-evaluation-harness, in the
training loop on any layout (:class:`DownstreamEval`) and offline (``tools/evaluate.py``)."""

from __future__ import annotations

import time

from ..errors import ConfigError
from .scoring import PipelineScorer, pack, task_metrics
from .tasks import Task, encode_pair, load_tasks, tasks_from_corpus

__all__ = ["DownstreamEval", "PipelineScorer", "Task", "check_eval_config", "encode_pair",
           "load_tasks", "pack", "task_metrics", "tasks_from_corpus"]


class DownstreamEval:
    """``eval.tasks`` (and their few-shot files) read, checked and tokenized once at start-up,
    before the model is built — a bad file stops the run before that work — then scored by
    ``scorer`` (a :class:`PipelineScorer` of the trainer's model chunks, set once they exist) at
    each evaluation."""

    def __init__(self, cfg, tokenizer):
        e, t = cfg.eval, cfg.train
        self.tasks = load_tasks(e.tasks, tokenizer, t.seq_length, e.fewshot, e.num_fewshot,
                                e.fewshot_seed, e.fewshot_sampler)
        self.tokens, self.targets = pack(self.tasks, t.seq_length)
        self.scorer: PipelineScorer | None = None

    def evaluate(self) -> dict:
        """Every task's ``<task>/acc``, ``<task>/acc_norm`` and ``<task>/n`` (the same on every
        rank), and the seconds it took (``downstream_time_s``)."""
        start = time.perf_counter()
        metrics, _ = task_metrics(self.tasks, self.scorer(self.tokens, self.targets))
        return {**metrics, "downstream_time_s": round(time.perf_counter() - start, 3)}


def check_eval_config(cfg) -> None:
    """The eval.* fields' rules that need no file: an evaluation interval to run the tasks at,
    few-shot files one per task, and examples to draw from when ``num_fewshot`` > 0."""
    e = cfg.eval
    if e.tasks and not cfg.train.eval_interval:
        raise ConfigError("eval.tasks is set but train.eval_interval=0 never evaluates: set "
                          "train.eval_interval > 0 (the tasks run then and at the end)")
    if e.fewshot and len(e.fewshot) != len(e.tasks):
        raise ConfigError(f"eval.fewshot has {len(e.fewshot)} files for {len(e.tasks)} eval.tasks: "
                          "give one per task, in the same order")
    if e.num_fewshot and not e.fewshot:
        raise ConfigError(f"eval.num_fewshot={e.num_fewshot} needs eval.fewshot: one file of "
                          "example items per task")
