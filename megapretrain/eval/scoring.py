"""Score multiple-choice tasks: each choice's summed log-probability, then ``acc``, ``acc_norm``.

Each (item, choice) is one sample of ``train.seq_length`` tokens: what the model reads
(``context + continuation`` minus its last token) followed by padding, with targets kept only at the
continuation's positions (the others are the loss's ignore index, loss 0). The model's per-token
loss is then minus the continuation tokens' log-probabilities — the vocab-parallel cross entropy
computes it on every layout without gathering the logits — and a sample's sum is minus its
log-likelihood. Padding sits after the continuation, so causal attention keeps it out.

:class:`PipelineScorer` runs the samples through a rank's model chunks under any layout (tp/sp,
cp, pp with its forward-only schedule, dp with the samples split over its ranks, ZeRO 3 gathering
each layer around its use as in training): the training loop's evaluation and ``tools/evaluate.py``
alike.
"""

from __future__ import annotations

import contextlib

import torch

from ..parallel.context import split_to_cp
from .tasks import Task

IGNORE = -100  # the cross entropy's ignore index


def pack(tasks: list[Task], seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets (n, seq_length) of every task's requests, item by item, choice by
    choice: row i reads ``seq[:-1]`` and is scored on its last ``n`` targets."""
    requests = [r for task in tasks for item in task.items for r in item.requests]
    tokens = torch.zeros(len(requests), seq_length, dtype=torch.long)
    targets = torch.full((len(requests), seq_length), IGNORE, dtype=torch.long)
    for row, (seq, n) in enumerate(requests):
        length = len(seq) - 1  # (load_task checked that it fits)
        tokens[row, :length] = torch.tensor(seq[:-1])
        targets[row, length - n:length] = torch.tensor(seq[length - n + 1:])
    return tokens, targets


def task_metrics(tasks: list[Task], logliks: list[float]) -> tuple[dict, list[dict]]:
    """Per task ``<task>/acc`` (the right choice has the highest log-likelihood),
    ``<task>/acc_norm`` (the highest per byte of the choice) and ``<task>/n`` (items), and one
    record per item (its choices' log-likelihoods and the two predictions). A tie goes to the
    first choice."""
    metrics, records, at = {}, [], 0
    for task in tasks:
        right = right_norm = 0
        for index, item in enumerate(task.items):
            lls = logliks[at:at + len(item.requests)]
            at += len(item.requests)
            pred = max(range(len(lls)), key=lambda c: (lls[c], -c))
            pred_norm = max(range(len(lls)), key=lambda c: (lls[c] / item.choice_bytes[c], -c))
            right += pred == item.label
            right_norm += pred_norm == item.label
            records.append({"task": task.name, "item": index, "label": item.label,
                            "logliks": lls, "pred": pred, "pred_norm": pred_norm})
        n = len(task.items)
        metrics.update({f"{task.name}/acc": right / n, f"{task.name}/acc_norm": right_norm / n,
                        f"{task.name}/n": n})
    return metrics, records


@contextlib.contextmanager
def log_prob_loss(models):
    """The models' per-token loss as minus the log-probability: no z-loss term while inside."""
    saved = [m.z_loss for m in models]
    try:
        for m in models:
            m.z_loss = 0.0
        yield
    finally:
        for m, z in zip(models, saved):
            m.z_loss = z


class PipelineScorer:
    """The trainer's forward without backward over the packed samples, on every layout: each dp
    rank runs its share of every round of ``dp × micro_batch_size × num_micro`` samples (the last
    round padded with empty rows, so every rank runs the same forwards: ZeRO 3 gathers are
    collectives over dp), and the per-sample sums are added over pp (the head's stage has them),
    cp (each rank has its share of the tokens) and dp (each rank its samples)."""

    def __init__(self, model_chunks, ps, pipeline, orders, num_micro: int, micro_batch_size: int):
        self.chunks, self.ps, self.pipeline = model_chunks, ps, pipeline
        self.orders, self.num_micro, self.micro = orders, num_micro, micro_batch_size

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor) -> list[float]:
        ps, n = self.ps, len(tokens)
        per_rank = self.micro * self.num_micro
        per_round = per_rank * ps.dp.size
        rounds = -(-n // per_round)
        device = ps.device
        sums = torch.zeros(rounds * per_round, dtype=torch.float64, device=device)
        for chunk in self.chunks:
            chunk.eval()
        with log_prob_loss(self.chunks):
            for r in range(rounds):
                first = r * per_round + ps.dp_rank * per_rank  # this rank's first row
                self.pipeline.run(self.orders, self.num_micro,
                                  self._forward_fn(tokens, targets, first, sums), backward=False)
        ps.pp.all_reduce(sums)
        ps.dp_cp.all_reduce(sums)
        return (-sums[:n]).cpu().tolist()

    def _forward_fn(self, tokens, targets, first: int, sums: torch.Tensor):
        cp, device = self.ps.cp, self.ps.device

        def forward(chunk: int, micro: int, hidden: torch.Tensor | None) -> torch.Tensor:
            model = self.chunks[chunk]
            start = first + micro * self.micro
            rows = slice(start, start + self.micro)
            tok = _padded(tokens[rows], self.micro, 0).to(device)  # (b, s)
            tgt = _padded(targets[rows], self.micro, IGNORE).to(device)
            # (b, s/cp): this rank's
            tok, tgt = split_to_cp(tok, cp), split_to_cp(tgt, cp)
            out = model(tok if model.pre_process else hidden, tgt if model.post_process else None)
            if not model.post_process:
                return out  # (b, s, h) activation for the next stage
            sums[start:start + self.micro] += out.double().sum(-1)  # out: (b, s/cp) per token
            return out.sum()
        return forward


def _padded(rows: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    """``rows`` (k, s), k <= size, with ``size - k`` rows of ``fill`` after them."""
    if len(rows) == size:
        return rows
    pad = torch.full((size - len(rows), rows.shape[1]), fill, dtype=rows.dtype)
    return torch.cat([rows, pad])
