"""run_scripts/gpu_check.sh on CPU: the plan walks every phase's setup; results stream a line at a
time; PASS/FAIL and the exit status follow the phases; bench_kernels streams its cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
gpu_check = load_tool("gpu_check")


def test_the_dry_run_walks_every_phase_and_resolves_the_training_configs(tmp_path):
    done = subprocess.run(["bash", os.path.join(ROOT, "run_scripts", "gpu_check.sh"), "--dry-run", "--output",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for phase in gpu_check.phases(str(tmp_path), sys.executable):
        assert f"\n{phase.name} " in "\n" + done.stdout
    # the resume run, the 8B-shaped run and the FP8 phase's 8B-shaped run (its linears FP8) resolve
    assert done.stdout.count("config: world=1") == 3
    assert "fp8=tensorwise: 14/14 linears" in done.stdout
    assert sum(p.limit_s for p in gpu_check.phases(str(tmp_path), sys.executable)) <= 480
    assert not os.path.exists(tmp_path / "gpu_check.jsonl")  # a dry run writes nothing


def test_results_stream_and_the_status_counts_every_failure(tmp_path, monkeypatch, capsys):
    py = sys.executable
    fake = [gpu_check.Phase("good", 30, "passes", [py, "-c", "print('FIGURES {\"x\": 1}')"], gpu_check._probe_figures),
            gpu_check.Phase("bad", 30, "fails", [py, "-c", "import sys; print('boom'); sys.exit(3)"]),
            gpu_check.Phase("slow", 2, "runs out of time", [py, "-c", "import time; time.sleep(30)"]),
            gpu_check.Phase("absent", 30, "a tool this checkout lacks", [py, os.path.join(ROOT, "tools", "nope.py")])]
    monkeypatch.setattr(gpu_check, "phases", lambda out_dir, python: fake)
    assert gpu_check.main(["--output", str(tmp_path)]) == 1
    lines = [json.loads(line) for line in open(tmp_path / "gpu_check.jsonl")]
    by_phase = {r["phase"]: r for r in lines}
    assert [r["phase"] for r in lines] == ["start", "good", "bad", "slow", "absent", "end"]
    assert by_phase["good"]["status"] == "pass" and by_phase["good"]["figures"] == {"x": 1}
    assert by_phase["bad"]["status"] == "fail" and by_phase["bad"]["exit"] == 3 and "boom" in by_phase["bad"]["tail"]
    assert by_phase["slow"]["status"] == "timeout"
    assert by_phase["absent"]["status"] == "skip"
    assert (by_phase["end"]["passed"], by_phase["end"]["failed"]) == (1, 2)
    assert "PASS 1 / FAIL 2" in capsys.readouterr().out
    monkeypatch.setattr(gpu_check, "phases", lambda out_dir, python: fake[:1])
    assert gpu_check.main(["--output", str(tmp_path / "again")]) == 0


def test_an_unknown_phase_is_one_line(capsys):
    assert gpu_check.main(["--only", "nope", "--dry-run"]) == 2
    assert "--only nope: not a phase" in capsys.readouterr().err


def test_mfu_is_derived_against_the_datasheet_and_the_measured_gemm():
    figures = {"env": {"device": "NVIDIA H200"}, "gemm": {"tflops": 700.0}, "throughput": {"tflops": 350.0}}
    out = gpu_check.derived(figures)
    assert abs(out["mfu_datasheet"] - 350 / 989) < 1e-9 and abs(out["of_measured_gemm"] - 0.5) < 1e-9
    assert gpu_check.derived({"throughput": {}}) == {}


def test_bench_kernels_streams_each_case_as_it_is_timed(tmp_path):
    path = tmp_path / "cases.jsonl"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_kernels.py"), "--tokens", "64",
                           "--hidden", "64", "--cross-entropy-vocab", "512", "--iters", "1", "--no-compile",
                           "--no-memory", "--jsonl", str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = [json.loads(line) for line in open(path)]
    kernels = {c["kernel"].split(" (")[0] for c in cases}
    assert {"cross entropy", "AdamW"} <= {k.split(",")[0] for k in kernels} or len(kernels) >= 5, kernels
    assert all(c["case"] == "kernel" and c["ms"] > 0 for c in cases)
