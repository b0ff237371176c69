"""tools/bench_fusions.py at tiny shapes: every fusion in both precisions gets a row whose candidate
matches the model's form (values and gradients), and a candidate that computes something else is
reported as differing and not timed. Timings are printed, never asserted."""

from __future__ import annotations

import re

import torch

from helpers import load_tool

bench_fusions = load_tool("bench_fusions")
TINY = ["--shapes", "tiny", "--repeats", "1", "--threads", "1"]
ROW = re.compile(r"^(\w+) +b2 s16 h32 n4 k2 f64 +(fp32|bf16) +(\S+) +(.*)$", re.M)


def test_every_fusion_matches_the_model_and_is_timed(capsys):
    threads = torch.get_num_threads()
    assert bench_fusions.main([*TINY, "--dtype", "fp32", "bf16"]) == 0
    assert torch.get_num_threads() == threads  # --threads 1 for the run only
    text = capsys.readouterr().out
    rows = {(m[1], m[2]): (m[3], m[4]) for m in ROW.finditer(text)}
    assert set(rows) == {(f, d) for f in bench_fusions.FUSIONS for d in ("fp32", "bf16")}, text
    for (fusion, dtype), (check, rest) in rows.items():
        assert check == "bitwise" or float(check) <= bench_fusions.TOLERANCE[bench_fusions.DTYPES[dtype]], text
        # cpu current, candidate, speed, the pairs' quartiles, wall current, candidate, speed
        assert len(re.findall(r"\d+\.\d+", rest)) == 8 and "not timed" not in rest, (fusion, dtype, rest)
    assert re.search(r"load average at start [\d.]+ [\d.]+ [\d.]+", text)
    assert re.search(r"load average at end [\d.]+ [\d.]+ [\d.]+", text)


def test_a_candidate_that_differs_is_reported_and_not_timed(capsys, monkeypatch):
    original = bench_fusions.joint_rope  # rotated the wrong way: sin' = (sin₁, -sin₂)
    monkeypatch.setattr(bench_fusions, "joint_rope", lambda q, k, cos, sin_signed: original(q, k, cos, -sin_signed))
    assert bench_fusions.main([*TINY, "--dtype", "fp32", "--only", "rope", "rmsnorm"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^rope .* fp32 +\S+ +differs from the current form \(tolerance 1e-05\): not timed$", text, re.M)
    assert re.search(r"^rmsnorm .* fp32 +bitwise +\d", text, re.M)
