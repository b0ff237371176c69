"""tools/preflight.py: passes on a tiny config, fails naming the check when it should, refuses bad input.

The end-to-end tests run the real trainer twice each (the full run and the resume) for a few
iterations of a tiny model; the check functions are also tested alone on synthetic metrics."""

from __future__ import annotations

import os
import re

import pytest

from megapretrain.commands import preflight
from megapretrain.config import Config, ConfigError, load_config
from megapretrain.optim.lr_schedule import LRSchedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4",
        "--model.num_kv_heads", "2", "--model.ffn_hidden_size", "128", "--train.seq_length", "64",
        "--train.micro_batch_size", "4", "--train.global_batch_size", "8", "--optim.lr", "3e-3",
        "--schedule.warmup_iters", "2", "--train.eval_interval", "0"]
ITERS = "16"
PNG = b"\x89PNG\r\n\x1a\n"


def preflight_main(run_dir, corpus, *extra) -> int:
    iters = [] if "--iters" in extra else ["--iters", ITERS]  # a tool flag is given once
    return preflight.main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--run.dir", str(run_dir),
                           "--data.paths", f"[{corpus}]", *TINY, *iters, *extra])


def rows(report: str) -> dict[str, str]:
    """check name -> result column of report.md's table."""
    out = {}
    for line in report.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if line.startswith("| ") and len(cells) == 5 and cells[0] not in ("check", "---"):
            out[cells[0]] = cells[1]
    return out


def test_passes_on_a_tiny_config(tmp_path, corpus, capsys):
    assert preflight_main(tmp_path / "run", corpus) == 0
    out = tmp_path / "run" / "preflight"
    report = (out / "report.md").read_text()
    assert "**PASSED**" in report
    results = rows(report)
    for name in ("training runs", "loss falls", "grad norm", "lr schedule", "checkpoint", "resume", "memory"):
        assert results[name] == "PASS", (name, report)
    assert results["throughput"] == "not checked"  # no --min-tokens-per-sec
    assert "bitwise equal" in report
    for name in ("loss.png", "grad_norm.png", "lr.png", "throughput.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
        assert f"]({name})" in report  # shown in the report
    assert (out / "full" / "checkpoints" / "iter_0000008").is_dir()
    assert not (tmp_path / "run" / "checkpoints").exists()  # RUN_DIR itself is left alone
    captured = capsys.readouterr()
    assert captured.err == ""  # no progress bar off a terminal
    closing = captured.out.strip().splitlines()[-1]  # one closing line: what was done, and where the report is
    assert re.fullmatch(r"preflight: PASSED 7 of 7 checks \(1 not checked\) in \d+ s; report: .*report\.md", closing)


def test_an_impossible_throughput_fails_and_is_named(tmp_path, corpus, capsys):
    assert preflight_main(tmp_path / "run", corpus, "--min-tokens-per-sec", "1e12") == 1
    report = (tmp_path / "run" / "preflight" / "report.md").read_text()
    assert "**FAILED** — 1 of" in report and rows(report)["throughput"] == "**FAIL**"
    assert rows(report)["resume"] == "PASS"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("preflight: FAILED throughput:")


def has_spike_fault() -> bool:
    try:
        load_config(None, ["--faults.spike_at", "3"])
    except ConfigError:
        return False
    return True


@pytest.mark.skipif(not has_spike_fault(), reason="faults.spike_at is not in the config yet")
def test_an_injected_loss_spike_fails_the_loss_or_resume_check(tmp_path, corpus, capsys):
    assert preflight_main(tmp_path / "run", corpus, "--faults.spike_at", "12") == 1
    report = (tmp_path / "run" / "preflight" / "report.md").read_text()
    results = rows(report)
    assert "**FAIL**" in (results["loss falls"], results["resume"]), report
    assert "FAILED loss falls" in capsys.readouterr().err or results["resume"] == "**FAIL**"


def test_bad_input_is_one_line_and_nothing_is_overwritten(tmp_path, corpus, capsys):
    kept = tmp_path / "run" / "preflight" / "report.md"
    kept.parent.mkdir(parents=True)
    kept.write_text("an earlier report")
    assert preflight_main(tmp_path / "run", corpus) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err and kept.read_text() == "an earlier report"
    assert preflight_main(tmp_path / "other", corpus, "--parallel.tp", "3") == 2
    assert "parallel.tp=3" in capsys.readouterr().err
    assert preflight_main(tmp_path / "other", corpus, "--trian.iters", "5") == 2
    assert "did you mean '--train.iters'" in capsys.readouterr().err
    assert preflight_main(tmp_path / "other", corpus, "--iters", "3") == 2
    assert "at least 4" in capsys.readouterr().err
    assert preflight_main(tmp_path / "other", corpus, "--layouts") == 2
    assert "--nproc-per-node" in capsys.readouterr().err
    assert preflight_main(tmp_path / "other", str(tmp_path / "missing_text_document")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing_text_document" in err
    assert not (tmp_path / "other").exists()


# -- the checks alone, on synthetic metrics ------------------------------------------------------


def run_of(losses, name="full", **fields) -> preflight.Run:
    records = [{"iter": i + 1, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 100.0,
                **fields} for i, loss in enumerate(losses)]
    return preflight.Run(name, "/nowhere", [], returncode=0, records=records)


def falling(n=20):
    return [5.0 - 0.1 * i + 0.01 * (-1) ** i for i in range(n)]


def test_loss_check_wants_a_fall_beyond_noise_and_no_spike():
    assert preflight.check_loss(run_of(falling())).ok
    flat = [3.0 + 0.2 * (-1) ** i for i in range(20)]
    assert not preflight.check_loss(run_of(flat)).ok
    spiked = falling()
    spiked[15] = 9.0
    check = preflight.check_loss(run_of(spiked))
    assert not check.ok and "spike at iteration 16" in check.measured
    rolled = run_of(falling())
    rolled.records.append({"iter": 12, "event": "rollback"})
    assert "rolled back at iteration 12" in preflight.check_loss(rolled).measured


def test_grad_norm_and_lr_checks():
    run = run_of(falling())
    assert preflight.check_grad_norm(run).ok
    run.records[3]["grad_norm"] = 42.0  # one clipped spike in 20 steps: allowed
    check = preflight.check_grad_norm(run)
    assert check.ok and "1 of 20 steps outside (1 allowed) (iter 4: 42)" in check.measured
    run.records[9]["grad_norm"] = 0.01  # a second step outside, the other way: not
    check = preflight.check_grad_norm(run)
    assert not check.ok and "2 of 20 steps outside" in check.measured and "iter 10: 0.01" in check.measured
    run.records[9]["grad_norm"] = float("nan")  # never a non-finite norm, even once
    run.records[3]["grad_norm"] = 1.0
    assert not preflight.check_grad_norm(run).ok
    short = run_of(falling(19))  # under 20 steps no step may leave the range
    short.records[3]["grad_norm"] = 42.0
    assert not preflight.check_grad_norm(short).ok
    schedule = LRSchedule(lr=1e-3, min_lr=1e-3, warmup_iters=0, decay_iters=20, decay="constant")
    assert preflight.check_lr([run], schedule).ok
    run.records[5]["lr"] = 5e-4  # e.g. a rollback's lr factor
    check = preflight.check_lr([run], schedule)
    assert not check.ok and "full iter 6" in check.measured


def test_resume_check_allows_1e_6_and_no_more():
    full = run_of(falling())
    resumed = run_of(falling(), name="resume")
    resumed.records = [r for r in resumed.records if r["iter"] > 10] + [{"iter": 10, "event": "resumed"}]
    check = preflight.check_resume(full, resumed, 10, 20, 1e-6)
    assert check.ok and "bitwise" in check.measured
    resumed.records[0]["loss"] += 5e-7
    assert preflight.check_resume(full, resumed, 10, 20, 1e-6).ok
    resumed.records[1]["loss"] += 1e-3
    check = preflight.check_resume(full, resumed, 10, 20, 1e-6)
    assert not check.ok and "first beyond 1e-06 at iteration 12" in check.measured


def test_throughput_and_memory_checks():
    run = run_of(falling(), memory_mb=2048.0)
    assert preflight.check_throughput(run, None, 20).ok is None
    assert preflight.check_throughput(run, 50.0, 20).ok
    assert not preflight.check_throughput(run, 1e12, 20).ok

    class Args:
        max_memory_gb, nproc_per_node = 1.5, 1

    check = preflight.check_memory([run], Config(), Args)
    assert not check.ok and "peak 2.00 GB" in check.measured
    Args.max_memory_gb = 4.0
    assert preflight.check_memory([run], Config(), Args).ok


def test_production_layout_check_simulates_every_role(tmp_path):
    """--world-size: the config's layout on that many GPUs, one rank per role simulated; fails when a
    peak plus the allowance exceeds the memory, or when the layout cannot run at that size."""
    import argparse

    overrides = TINY + ["--parallel.pp", "2", "--parallel.zero", "1", "--model.vocab_size", "300",
                        "--train.micro_batch_size", "1"]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), overrides)
    args = argparse.Namespace(config=os.path.join(ROOT, "configs", "tiny.yaml"), world_size=8, gpu="h100",
                              max_memory_gb=None)
    check = preflight.check_production(args, overrides, cfg, str(tmp_path))
    assert check.ok and "8 GPUs, 2 roles" in check.measured, check
    assert (tmp_path / "simulate" / "report.md").read_text().startswith("# Simulated ranks")
    args.max_memory_gb = 1.0  # below the 4 GB allowance alone
    assert not preflight.check_production(args, overrides, cfg, str(tmp_path)).ok
    args.world_size = 6  # tp 4 × pp 2 does not divide it
    bad = preflight.check_production(args, overrides + ["--parallel.tp", "4"], cfg, str(tmp_path))
    assert bad.ok is False and "must divide the world size 6" in bad.measured
    args.world_size, args.max_memory_gb = 8, None  # dp 4: the ramp-up's first batch, 2, is under one sample a rank
    ramp = preflight.check_production(args, overrides + ["--train.rampup_batch_size", "[2, 2, 100]"], cfg,
                                      str(tmp_path))
    assert ramp.ok is False and "the ramp's batch 2 is not a multiple" in ramp.measured, ramp
