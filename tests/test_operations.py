"""What the operations guide promises, each for real: a save every checkpoint.interval_minutes, a
collective that never completes failing after watchdog.collective_timeout_s, the warning for half
precision on a CPU without it, the recipe's batch warning above 1B parameters, the takeover of a lock
whose other host stopped beating for 30 minutes (and not before), and the real wandb package offline."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch

from megapretrain.train import main

from helpers import wandb_history

TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--model.ffn_hidden_size", "128", "--train.seq_length", "32", "--train.micro_batch_size", "2",
        "--train.global_batch_size", "4", "--logging.tensorboard", "false", "--optim.lr", "3e-3",
        "--train.eval_interval", "0"]


def _events(run_dir, name) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if r.get("event") == name]


def test_checkpoint_interval_minutes_saves_when_that_much_time_passed(tmp_path, corpus):
    """No iteration interval; a save once 0.3 s passed since the last: steps 2 and 3 wait 0.5 s for
    their data (an injected delay), so a save follows each of them; and the last step's."""
    run = tmp_path / "run"
    assert main(["--run.dir", str(run), "--data.paths", f"[{corpus}]", *TINY, "--train.iters", "5",
                 "--checkpoint.interval", "0", "--checkpoint.interval_minutes", "0.005", "--faults.slow_data_at", "2",
                 "--faults.slow_data_s", "0.5", "--faults.slow_data_steps", "2", "--checkpoint.keep_last", "0"]) == 0
    saved = [r["iter"] for r in _events(run, "checkpoint_saved")]
    assert {2, 3, 5} <= set(saved) and saved == sorted(set(saved))
    assert all((run / "checkpoints" / f"iter_{i:07d}" / "metadata.json").exists() for i in saved)


def _collective(rank: int, port: int, timeout_s: float, results) -> None:
    import torch
    import torch.distributed as dist

    from megapretrain.parallel.state import init_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed("gloo", "cpu", timeout_s=timeout_s)
    if rank == 1:
        time.sleep(600)  # never joins the collective (terminated by the test)
        return
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        results.put(("completed", 0.0))
    except Exception as exc:
        results.put((str(exc), time.monotonic() - start))


def test_a_collective_that_never_completes_fails_after_collective_timeout_s():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_collective, args=(r, port, 3.0, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        message, waited = results.get(timeout=300)  # spawn + import can be slow on a loaded machine
    finally:
        for p in procs:
            p.terminate()
    assert message != "completed" and ("timed out" in message.lower() or "timeout" in message.lower()), message
    assert waited < 50  # failed instead of hanging: the other rank never joins


def test_half_precision_on_a_cpu_without_it_is_warned(tmp_path, corpus, capsys, monkeypatch):
    from megapretrain.monitor import flops

    speeds = {"torch.bfloat16": 1.5, "torch.float16": 1.5, "torch.float32": 30.0}
    monkeypatch.setattr(flops, "cpu_matmul_gflops", lambda dtype, **_: speeds[str(dtype)])
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_f": True}, raising=False)  # no bf16
    assert main(["--run.dir", str(tmp_path / "run"), "--data.paths", f"[{corpus}]", *TINY, "--train.iters", "1",
                 "--train.precision", "bf16", "--train.device", "cpu"]) == 0
    warning, = [line for line in capsys.readouterr().err.splitlines() if "train.precision=bf16" in line]
    assert warning.startswith("warning: ") and "1.5 GFLOP/s against 30.0 in fp32 (20x slower" in warning
    assert "use --train.precision fp32" in warning
    speeds["torch.bfloat16"] = 25.0  # bf16 emulated fast enough: no warning
    assert flops.slow_half_precision_warning("bf16") is None
    # a CPU with bf16 instructions gets none whatever a timing under load says
    speeds["torch.bfloat16"] = 1.5
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_f": True, "avx512_bf16": True},
                        raising=False)
    assert flops.slow_half_precision_warning("bf16") is None
    assert flops.slow_half_precision_warning("fp16") is not None  # AVX-512 BF16 is not FP16


def test_the_recipes_batch_size_above_1b_parameters_is_warned():
    from megapretrain.trainer import recipe_warnings

    warning, = recipe_warnings(7_000_000_000, 1_048_576)
    assert "a global batch of 1,048,576 tokens for a model of 7.0B parameters" in warning and "2-4M" in warning
    assert recipe_warnings(7_000_000_000, 4_194_304) == []  # 4M tokens: the recipe
    assert recipe_warnings(350_000_000, 65_536) == []  # below 1B: any batch


def test_a_lock_from_another_host_is_taken_over_after_30_minutes_without_a_heartbeat(tmp_path, capsys):
    from megapretrain.errors import ConfigError
    from megapretrain.run_lock import STALE_S, RunLock

    lock_path = tmp_path / ".lock"
    lock_path.write_text(json.dumps({"pid": 4242, "host": "node-17", "started": time.time() - 7200}))
    beat = time.time() - (STALE_S - 60)  # 29 minutes ago: that training may still be running
    os.utime(lock_path, (beat, beat))
    with pytest.raises(ConfigError, match=r"in use by a training \(PID 4242 on node-17, last active 17\d\d s ago\)"):
        RunLock(str(tmp_path)).acquire()
    beat = time.time() - (STALE_S + 60)  # 31 minutes: stale
    os.utime(lock_path, (beat, beat))
    lock = RunLock(str(tmp_path))
    lock.acquire()
    err = capsys.readouterr().err
    assert "taking over the stale lock" in err and "PID 4242 on node-17" in err
    owner = json.loads(lock_path.read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    lock.release()
    assert not lock_path.exists()


def test_training_logs_to_the_real_wandb_offline(tmp_path, corpus, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: the run is written under RUN_DIR/wandb
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    for iters in ("2", "3"):  # a resume continues the same wandb run
        assert main(["--run.dir", str(run), "--data.paths", f"[{corpus}]", *TINY, "--train.iters", iters,
                     "--logging.wandb", "true"]) == 0
    run_id = (run / "wandb_id").read_text().strip()
    offline = [d for d in os.listdir(run / "wandb") if d.startswith("offline-run-")]
    assert offline and all(f"-{run_id}" in d for d in offline)  # a resume in the same second gets a -1 suffix
    assert all(any(f.endswith(".wandb") for f in os.listdir(run / "wandb" / d)) for d in offline)
    logged = {row["_step"]: row for row in wandb_history(str(run)) if "loss" in row}
    jsonl = [json.loads(line) for line in open(run / "metrics.jsonl") if '"loss"' in line]
    assert sorted(logged) == [1, 2, 3] == [r["iter"] for r in jsonl]  # both starts logged each step
    assert all(logged[r["iter"]]["loss"] == pytest.approx(r["loss"]) for r in jsonl)
