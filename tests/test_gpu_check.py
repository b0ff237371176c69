"""run_scripts/gpu_check.sh on CPU: the plan walks every phase's setup; results stream a line at a
time; PASS/FAIL and the exit status follow the phases (a skipped phase fails, unless left out with
--only); a phase cut off keeps what it printed; the throughput phase's flags and figures are
bench_train's; its peak memory is held to the planner's; the NCCL phase's collectives and batched
send/recv run on gloo; bench_kernels streams its cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megapretrain.parallel.state import Group

from distributed import run_distributed
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
    assert "memory: planned peak " in done.stdout and "0.5-1.15 × it" in done.stdout
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
    assert by_phase["absent"]["status"] == "skip"  # a phase that did not run has not passed
    end = by_phase["end"]
    assert (end["passed"], end["failed"], end["skipped"]) == (1, 3, 1)
    assert "PASS 1 / FAIL 3 (1 of them skipped)" in capsys.readouterr().out
    monkeypatch.setattr(gpu_check, "phases", lambda out_dir, python: fake[:1])
    assert gpu_check.main(["--output", str(tmp_path / "again")]) == 0
    # phases left out with --only are not run, and not failures
    monkeypatch.setattr(gpu_check, "phases", lambda out_dir, python: fake)
    assert gpu_check.main(["--output", str(tmp_path / "only"), "--only", "good"]) == 0
    lines = [json.loads(line) for line in open(tmp_path / "only" / "gpu_check.jsonl")]
    assert [r["phase"] for r in lines] == ["start", "good", "end"]


def test_a_phase_the_time_budget_left_out_fails(tmp_path):
    results = gpu_check.Results(str(tmp_path / "r.jsonl"))
    late = gpu_check.Phase("late", 30, "", [sys.executable, "-c", "pass"])
    assert gpu_check.run_phase(late, results, 2) == {}
    results.close()
    (record,) = [json.loads(line) for line in open(tmp_path / "r.jsonl")]
    assert record["status"] == "skip" and "budget" in record["why"]
    assert (results.passed, results.failed, results.skipped) == (0, 1, 1)


THROUGHPUT_ROW = "megapretrain     812.5   (801.0-830.2)     10,082    350000.0        35%"


def test_a_throughput_phase_cut_off_keeps_its_figures_and_the_mfu(tmp_path, monkeypatch):
    """The figures printed before the limit (unbuffered, though the phase does not flush) are
    recorded, and the MFU is derived from them; the peak-memory check reads the same output."""
    check = gpu_check.PeakMemoryCheck(gpu_check.THROUGHPUT)
    planned = check.planned_bytes()
    peak = int(planned * 1.05)
    printed = f"print({THROUGHPUT_ROW!r}); print('peak memory: x GiB ({peak:,} bytes, y)')"
    env = "print('FIGURES {\"device\": \"NVIDIA H100\"}')"
    fake = [gpu_check.Phase("env", 30, "", [sys.executable, "-c", env], gpu_check._probe_figures),
            gpu_check.Phase("throughput", 8, "", [sys.executable, "-c", printed + "; import time; "
                                                  "time.sleep(60)"],
                            gpu_check._bench_train_figures, check=check)]
    monkeypatch.setattr(gpu_check, "phases", lambda out_dir, python: fake)
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # the phase's own environment sets it
    assert gpu_check.main(["--output", str(tmp_path)]) == 1  # the timeout fails the phase
    by_phase = {r["phase"]: r for r in map(json.loads, open(tmp_path / "gpu_check.jsonl"))}
    throughput = by_phase["throughput"]
    assert throughput["status"] == "timeout"
    assert throughput["figures"] == {"step_ms": 812.5, "tokens_per_s": 10082.0, "tflops": 350.0,
                                     "peak_bytes": peak}
    assert by_phase["mfu"]["mfu_datasheet"] == pytest.approx(350 / 989)
    memory = by_phase["memory"]
    assert memory["status"] == "pass" and memory["planned_bytes"] == planned
    assert memory["ratio"] == pytest.approx(1.05, abs=1e-3) and memory["band"] == [0.5, 1.15]
    assert (by_phase["end"]["passed"], by_phase["end"]["failed"]) == (2, 1)


def test_peak_memory_is_held_to_the_planner_s_within_its_band():
    check = gpu_check.PeakMemoryCheck(gpu_check.THROUGHPUT)
    check.planned_bytes = lambda: 1000
    assert check({"peak_bytes": 1100})["status"] == "pass"
    assert check({"peak_bytes": 500})["status"] == "pass"
    over = check({"peak_bytes": 1200})
    assert over["status"] == "fail" and over["ratio"] == 1.2 and "outside 0.5-1.15" in over["why"]
    assert check({"peak_bytes": 400})["status"] == "fail"
    # no peak printed: not checked, so failed
    assert check({"tokens_per_s": 1.0})["status"] == "skip"


def test_the_planned_peak_is_the_simulated_program_s():
    """The figure the throughput phase is held to: the planner's peak for its layout, within 5% of
    the trainer's own program simulated on CUDA's path (tools/simulate.py, fake tensors)."""
    from megapretrain.simulate.run import simulate_rank

    planned = gpu_check.PeakMemoryCheck(gpu_check.THROUGHPUT).planned_bytes()
    cfg = gpu_check._load(gpu_check.THROUGHPUT)
    simulated = simulate_rank(cfg, 1, 0, steps=2, device="cuda").peak_bytes
    assert abs(planned - simulated) <= 0.05 * simulated, (planned, simulated)


def test_the_throughput_phase_runs_bench_train_s_flags_and_reads_its_figures(tmp_path):
    """One round, no start-up runs, unbuffered; the same flags on configs/tiny.yaml on this CPU
    give the figures the phase records."""
    phase = {p.name: p for p in gpu_check.phases(str(tmp_path), sys.executable)}["throughput"]
    command = phase.command
    assert command[1] == "-u" and command[2].endswith("bench_train.py")
    flags = command[3:command.index("--config")]
    assert "--no-startup" in flags and flags[flags.index("--rounds") + 1] == "1"
    tiny = ["--steps", "1", "--warmup", "0", "--threads", "1",
            "--config", os.path.join(ROOT, "configs", "tiny.yaml")]
    # the phase's own flags but those the tiny run sets (a tool refuses a flag given twice)
    kept = [f for i, f in enumerate(flags)
            if not (f in tiny[::2] or (i and flags[i - 1] in tiny[::2]))]
    done = subprocess.run([sys.executable, command[2], *kept, *tiny],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "start-up" not in done.stdout
    figures = phase.parse(done.stdout)
    assert figures["step_ms"] > 0 and figures["tokens_per_s"] > 0, done.stdout
    assert figures["tflops"] > 0 and "peak_bytes" not in figures  # the peak: on CUDA only


def _ring_on_gloo(rank: int, world: int) -> dict:
    import torch.distributed as dist

    pg = dist.new_group(list(range(world)))
    return gpu_check.ring_step(Group("ring", list(range(world)), pg, rank), torch.device("cpu"))


def _one_rank_collectives(rank: int, world: int) -> dict:
    import torch.distributed as dist

    return gpu_check.one_rank_collectives(dist.new_group([0]), torch.device("cpu"))


def test_the_nccl_phase_s_code_runs_on_gloo():
    """The NCCL phase's collectives on one gloo rank, and its batched send/recv (Group.shift_async)
    on a ring of two: gloo cannot send to itself, so the ring of one is the GPU's to run."""
    ok = {"float32": "ok", "bfloat16": "ok", "float16": "ok"}
    assert run_distributed(_one_rank_collectives, 1) == [ok]
    assert run_distributed(_ring_on_gloo, 2) == [{"batched_send_recv": "ok (ring of 2)"}] * 2


def test_a_batched_send_recv_that_delivers_other_values_fails():
    class Lost:
        rank, size = 0, 1

        def shift_async(self, sends):
            done = type("Done", (), {"wait": lambda self: None})()
            return [torch.zeros_like(t) for t in sends], done

    with pytest.raises(SystemExit, match="batched send/recv of torch.float32 on a ring of 1"):
        gpu_check.ring_step(Lost(), torch.device("cpu"))


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
