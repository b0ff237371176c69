"""tools/bench_train.py at a tiny size: the step's anatomy (ops per layer, no host sync, allocations,
Python time), the interleaved throughput table against the matmul ceiling, a nanoGPT directory
that holds no checkout skipped in one line, and the start-up to the first step of a real training
run. Timings are printed, never asserted."""

from __future__ import annotations

import re
import subprocess
import sys

TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4",
        "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--train.seq_length", "32",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "4"]


def test_bench_train_prints_the_anatomy_of_a_tiny_step(tmp_path):
    out = subprocess.run([sys.executable, "tools/bench_train.py", "--config", "configs/tiny.yaml", "--steps", "1",
                          "--warmup", "0", "--rounds", "2", "--threads", "1", "--compare-nanogpt", str(tmp_path),
                          *TINY], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert re.search(r"matmul ceiling: [\d,.]+ GFLOP/s \(fp32", text)
    assert re.search(r"^megapretrain +[\d.]+ +\([\d.]+-[\d.]+\) +[\d,]+ +[\d.]+ +\d+%$", text, re.M)
    assert f"nanogpt: skipped: {tmp_path} holds no nanoGPT model.py" in text
    per_layer = int(re.search(r"ops dispatched per layer .*: ([\d,]+)", text).group(1).replace(",", ""))
    per_step = int(re.search(r"ops dispatched per step: ([\d,]+)", text).group(1).replace(",", ""))
    assert 0 < 2 * per_layer < per_step / 2  # two layers of two micro-batches, plus the embedding, head, optimizer
    assert "host syncs per step: 0 (0 scalar reads, 0 device-to-host copies)" in text
    assert re.search(r"tensors allocated per step: [1-9]", text)
    assert re.search(r"Python and framework: [\d,.]+ ms", text)
    assert re.search(r"start-up to the first step .*: cold [\d.]+ s \([\d.]+ s CPU; data indices built\), "
                     r"warm [\d.]+ s \([\d.]+ s CPU; cached\)", text)
