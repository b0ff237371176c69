"""tools/plot_run.py and tools/plot_schedule.py: valid PNGs, the right panels, the right printed facts."""

from __future__ import annotations

import json
import os

import pytest

from megapretrain.commands import plot_run, plot_schedule
from megapretrain.monitor import plots

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PNG = b"\x89PNG\r\n\x1a\n"
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")


def assert_png(path) -> None:
    data = open(path, "rb").read()
    assert data.startswith(PNG) and len(data) > 5000, (path, len(data))


def write_metrics(run_dir, steps: int = 30) -> list[dict]:
    """A run's metrics.jsonl: training lines with a time breakdown, evaluations, events, and a last
    line cut short (a run killed mid-write)."""
    records = [{"iter": 0, "event": "memory", "total": 123}]
    for it in range(1, steps + 1):
        records.append({"iter": it, "loss": 5.5 - 0.1 * it, "grad_norm": 2.0 / it ** 0.5, "lr": 1e-3 * min(1, it / 3),
                        "tokens_per_sec": 1000.0 + it, "consumed_tokens": 512 * it, "step_time": 0.5,
                        "data_time": 0.01, "mfu": 0.4, "memory_mb": 250.0 + it,
                        "breakdown": {"forward_backward_s": 0.3, "optimizer_s": 0.1}, "checkpoint_stall_s": 0.0,
                        "elapsed_s": 0.5 * it, "eta_s": 0.5 * (steps - it)})
        if it % 10 == 0:
            records.append({"iter": it, "valid_loss": 5.4 - 0.1 * it})
            records.append({"iter": it, "event": "checkpoint_saved", "path": f"checkpoints/iter_{it:07d}"})
    records += [{"iter": 15, "event": "alert", "kind": "grad_norm"}, {"iter": 20, "event": "rollback"},
                {"iter": 10, "event": "resumed"}]
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records) + '{"iter": 31, "lo')
    return records


def test_plot_run_draws_every_logged_panel_with_events(tmp_path, capsys):
    run = tmp_path / "run"
    records = write_metrics(run)
    assert plot_run.main([str(run)]) == 0
    assert_png(run / "dashboard.png")
    assert "dashboard.png" in capsys.readouterr().out
    out = tmp_path / "elsewhere" / "d.png"
    assert plot_run.main([str(run / "metrics.jsonl"), "--output", str(out)]) == 0
    assert_png(out)

    train = [r for r in records if "loss" in r]
    titles = [title for title, _, _ in plots._panels(train, records)]
    assert titles == ["loss", "grad norm (before clipping)", "learning rate", "tokens/s", "MFU", "memory (MB)",
                      "time breakdown (s)"]
    assert [label for label, _, _ in plots._panels(train, records)[0][1]] == ["loss", "valid_loss"]
    assert plots.time_fields(train) == ["step_time", "data_time", "breakdown.forward_backward_s",
                                        "breakdown.optimizer_s", "checkpoint_stall_s"]
    marked = {mark.name for mark in plots.events(records)}
    assert marked == {"checkpoint_saved", "alert start", "rollback", "resumed"}  # the start-up memory line is not


def test_plot_run_draws_a_minimal_run(tmp_path):
    """Only the contract's fields (no MFU, memory or time breakdown): fewer panels, still a picture."""
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as fh:
        for it in range(1, 6):
            fh.write(json.dumps({"iter": it, "loss": 3.0 - 0.1 * it, "grad_norm": 1.0, "lr": 1e-3,
                                 "tokens_per_sec": 10.0, "consumed_tokens": it}) + "\n")
    assert plot_run.main([str(run)]) == 0
    assert_png(run / "dashboard.png")


def test_plot_run_bad_input_is_one_line(tmp_path, capsys):
    assert plot_run.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl" in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"iter": 0, "event": "memory"}\n')
    assert plot_run.main([str(tmp_path / "empty")]) == 2
    assert "no training lines" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('not json\n{"iter": 1, "loss": 1.0}\n')
    assert plot_run.main([str(tmp_path / "bad")]) == 2
    assert "line 1 is not JSON" in capsys.readouterr().err
    write_metrics(tmp_path / "run")
    assert plot_run.main([str(tmp_path / "run"), "--output", str(tmp_path / "x.jpg")]) == 2
    assert ".png" in capsys.readouterr().err


def rolled_back_records() -> list[dict]:
    """A run that trained 1-12, rolled back to the checkpoint at 10 and went on to 20, with an alert
    that started at 12 and one that started at 4 and cleared at 6."""
    records = [{"iter": it, "loss": 5.0 - 0.1 * it + (2.0 if it == 12 else 0.0), "lr": 1e-3, "memory_mb": 1000.0}
               for it in range(1, 13)]
    records += [{"iter": 4, "event": "alert", "kind": "data_wait", "state": "start"},
                {"iter": 6, "event": "alert", "kind": "data_wait", "state": "clear", "since": 4},
                {"iter": 12, "event": "alert", "kind": "loss_spike"},
                {"iter": 10, "event": "rollback", "from_iter": 12, "lr_scale": 0.5}]
    records += [{"iter": it, "loss": 5.0 - 0.1 * it, "lr": 5e-4, "memory_mb": 985.0} for it in range(11, 21)]
    return records


def test_a_rollback_is_drawn_as_a_branch_not_a_line_running_back():
    records = rolled_back_records()
    (xs, ys), dropped = plots.trajectory(*plots.series(records, "loss"))
    assert xs == list(range(1, 21)) and ys[11] == pytest.approx(3.8)  # iteration 12 as trained again
    assert dropped == [([10, 11, 12], [pytest.approx(4.0), pytest.approx(3.9), pytest.approx(5.8)])]
    fig = plots.dashboard_figure(records, "run")
    for ax in fig.axes:
        for line in ax.get_lines():
            x = list(line.get_xdata())
            if len(x) > 1 and len(set(x)) > 1:  # a data line, not an event's vertical mark
                assert x == sorted(set(x)), (ax.get_title(), line.get_label(), x)
    marks = plots.events(records)
    assert plots.Mark(10, "rollback", (10, 12)) in marks and plots.Mark(6, "alert clear", (4, 6)) in marks
    assert plots.Mark(12, "alert start") in marks and plots.Mark(4, "alert start") in marks
    plots.pyplot().close(fig)


def test_event_marks_never_take_a_data_colour_and_alerts_start_and_clear_differ():
    from matplotlib.colors import to_rgb

    data = {to_rgb(c) for c in plots.DATA_COLOURS}
    assert not data & {to_rgb(colour) for colour, _, _ in [*plots.EVENT_STYLES.values(), plots.OTHER_EVENT]}
    assert plots.EVENT_STYLES["alert start"] != plots.EVENT_STYLES["alert clear"]
    fig = plots.dashboard_figure(rolled_back_records(), "run")
    loss = fig.axes[0]
    colours = [to_rgb(line.get_color()) for line in loss.get_lines() if line.get_label() in ("loss",)]
    assert colours and all(c in data for c in colours)
    plots.pyplot().close(fig)


def test_memory_starts_at_zero_and_states_its_range():
    """A 1.5% dip in memory is drawn as one: the axis starts at zero and the title gives the range."""
    fig = plots.dashboard_figure(rolled_back_records(), "run")
    (memory,) = [ax for ax in fig.axes if ax.get_title().startswith("memory")]
    assert memory.get_ylim()[0] == 0 and memory.get_ylim()[1] >= 1000
    assert memory.get_title() == "memory (MB): 985–1,000, spread 1.5% of the peak"
    plots.pyplot().close(fig)


def _inside(fig) -> None:
    """Every title, axis label and legend of the figure lies within the canvas: nothing is cut off."""
    fig.canvas.draw()
    canvas = fig.bbox
    texts = [fig._suptitle] if fig._suptitle else []
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label]
    for legend in [*fig.legends, *(ax.get_legend() for ax in fig.axes)]:
        texts += legend.get_texts() + [legend.get_title()] if legend else []
    for text in (t for t in texts if t.get_visible() and t.get_text()):
        box = text.get_window_extent()
        assert canvas.x0 - 1 <= box.x0 and box.x1 <= canvas.x1 + 1 and canvas.y0 - 1 <= box.y0 and \
            box.y1 <= canvas.y1 + 1, (text.get_text(), box, canvas)


def test_no_title_is_cut_off():
    title = ("configs/llama3_405b.yaml: cosine schedule, lr 8e-05 → 8e-06, decay_iters 484000, 484000 iterations, "
             "with a long run directory name as well")
    iters = list(range(1, 1001))
    fig = plots.schedule_figure(title, iters, [1e-4 * (1 - i / 1000) for i in iters], [4] * 100 + [16] * 900, 10, 1e-5)
    _inside(fig)
    plots.pyplot().close(fig)
    fig = plots.dashboard_figure(rolled_back_records(), "/a/rather/long/run/directory/" * 3)
    _inside(fig)
    plots.pyplot().close(fig)


def test_preflight_draws_the_full_run_under_the_resumed_one(tmp_path):
    """The resumed run's losses equal the full run's: the full run is the wide pale line underneath."""
    out = tmp_path / "loss.png"
    xs = list(range(1, 11))
    plots.plot_lines(str(out), "loss", [("full run", xs, [5 - 0.1 * x for x in xs], plots.UNDER),
                                        ("resumed", xs[5:], [5 - 0.1 * x for x in xs[5:]], plots.OVER)])
    assert_png(out)
    assert plots.UNDER["linewidth"] > 2 * plots.OVER["linewidth"] and plots.UNDER["alpha"] < 1


def schedule_facts(capsys, tmp_path, *overrides) -> list[str]:
    out = tmp_path / "lr.png"
    assert plot_schedule.main(["--config", TINY_YAML, "--output", str(out), *overrides]) == 0
    assert_png(out)
    return capsys.readouterr().out.splitlines()


def test_plot_schedule_states_the_warmup_share_and_min_lr(tmp_path, capsys):
    # configs/tiny.yaml: 300 iterations, warmup 15, cosine from 2e-3 to min_lr 2e-4 at decay_iters = iters
    lines = schedule_facts(capsys, tmp_path)
    assert lines[0] == "warmup: 15 of 300 iterations = 5.0% of the run"
    assert lines[1] == "min_lr: 0.0002 reached at iteration 300 of 300"
    lines = schedule_facts(capsys, tmp_path, "--schedule.warmup_iters", "60", "--schedule.decay_iters", "600")
    assert lines[0] == "warmup: 60 of 300 iterations = 20.0% of the run (more than 5%)"
    assert lines[1].startswith("min_lr: 0.0002 not reached: the last iteration's lr is ")
    assert "schedule.decay_iters=600 > train.iters=300" in lines[1]
    lines = schedule_facts(capsys, tmp_path, "--schedule.decay", "linear", "--schedule.decay_iters", "200")
    assert lines[1] == "min_lr: 0.0002 reached at iteration 200 of 300"
    lines = schedule_facts(capsys, tmp_path, "--schedule.decay", "constant")
    assert lines[1].startswith("min_lr: not reached (decay constant")
    assert not any(line.startswith("batch") for line in lines)


def test_plot_schedule_draws_the_batch_ramp_up(tmp_path, capsys):
    from megapretrain.config import ConfigError, load_config

    try:
        load_config(None, ["--train.rampup_batch_size", "[4, 4, 1600]"])
    except ConfigError:
        pytest.skip("train.rampup_batch_size is not in the config yet")
    lines = schedule_facts(capsys, tmp_path, "--train.rampup_batch_size", "[4, 4, 1600]")
    ramp = [line for line in lines if line.startswith("batch ramp-up")]
    # global 16 from 4 in steps of 4 over 1600 samples: 533⅓ samples per increment
    assert ramp == ["batch ramp-up: 4 → 16 samples per step, full from iteration 246"]
    cfg = load_config(TINY_YAML, ["--train.rampup_batch_size", "[4, 4, 1600]"])
    sizes = plot_schedule.batch_sizes(cfg.train, 300)
    assert sizes[0] == 4 and sizes[134] == 8 and sizes[-1] == 16 and sum(sizes[:245]) >= 1600


def test_plot_schedule_bad_input_is_one_line(tmp_path, capsys):
    assert plot_schedule.main(["--config", TINY_YAML, "--optim.min_lr", "1"]) == 2
    assert "optim.min_lr=1.0 must be between 0 and optim.lr" in capsys.readouterr().err
    assert plot_schedule.main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_plot_schedule_draws_pipeline_schedules_side_by_side(tmp_path, capsys):
    """--pipeline: one panel per schedule on one time axis, each one's idle share printed (at pp 4, 8
    micro-batches and a backward of 2 with a weight gradient of 1: 1F1B 9/33, ZB-H1 3/27, ZB-V
    1.5/25.5 — the formulas of parallel/pipeline.py's Schedule.idle)."""
    out = tmp_path / "pipeline.png"
    assert plot_schedule.main(["--pipeline", "--pp", "4", "--micro-batches", "8", "--output", str(out)]) == 0
    assert_png(out)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["        1f1b: step 33 forward-units, idle 27.3% of it on every stage",
                         "       zb_h1: step 27 forward-units, idle 11.1% of it on every stage",
                         "         zbv: step 25.5 forward-units, idle 5.9% of it on every stage"]
    with pytest.raises(SystemExit):
        plot_schedule.main(["--pipeline", "--pp", "4", "--micro-batches", "8", "--schedules", "zbv",
                            "--output", str(out), "--weight-cost", "2"])
    assert "--weight-cost=2 must be less than --backward-cost=2" in capsys.readouterr().err
    assert plot_schedule.main(["--pipeline", "--pp", "1", "--micro-batches", "8", "--schedules", "zb_h1",
                               "--output", str(out)]) == 2
    assert "zb_h1 needs parallel.pp > 1" in capsys.readouterr().err


def test_plot_run_marks_restarts_and_gives_the_effective_training_time(tmp_path):
    """A restart shades the steps trained again; under the title, the effective training time
    over the run's attempts (from RUN_DIR/attempts.jsonl)."""
    run = tmp_path / "run"
    records = write_metrics(run, steps=12)
    restart = {"iter": 4, "event": "restart", "attempt": 2, "resumed_iter": 4,
               "previous_last_iter": 6, "recomputed_iters": 2, "lost_s": 9.0}
    with open(run / "metrics.jsonl", "w") as fh:  # (the cut last line dropped: a finished run)
        fh.write("".join(json.dumps(r) + "\n" for r in records + [restart]))
    ledger = [{"attempt": 1, "record": "start", "launch": "a", "process_start": 0, "time": 1},
              {"attempt": 1, "record": "loaded", "iter": 0},
              {"attempt": 1, "record": "training", "time": 2},
              {"attempt": 1, "record": "end", "reason": "crash", "time": 12,
               "noticed_by": "next_start", "last_iter": 6, "last_alive": 8},
              {"attempt": 2, "record": "start", "launch": "a", "restart_count": 1,
               "process_start": 12, "time": 14},
              {"attempt": 2, "record": "loaded", "iter": 4},
              {"attempt": 2, "record": "training", "time": 15},
              {"attempt": 2, "record": "end", "reason": "finished", "time": 23, "last_iter": 12,
               "last_alive": 23}]
    with open(run / "attempts.jsonl", "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in ledger))
    assert plots.Mark(4, "restart", (4, 6)) in plots.events(records + [restart])
    note = plot_run.goodput_note(str(run), records)
    # productive: 4 of the first attempt's 6 steps (1 s each) and the second's 8 s; wall 0 → 23 s
    assert note.startswith("effective training time 52.2% (productive steps 12 s of 23 s over 2 "
                           "attempts)")
    assert "1 restart lost" in note
    assert plot_run.main([str(run)]) == 0
    assert_png(run / "dashboard.png")
    fig = plots.dashboard_figure(records + [restart], "run", note)
    assert fig._suptitle.get_text() == f"run\n{note}"
    _inside(fig)
    plots.pyplot().close(fig)
