"""The fault drills of tools/drill.py at 2 nodes × 1 process on CPU: two run_scripts/launch.sh
launchers on one machine, one failure each, judged against a straight run (bitwise losses, every
launcher's exit status, the launchers out promptly after the last iteration).

The worker-crash, node-loss and start-up-signal drills share one invocation (one straight run) and
are not marked slow: CI runs them. The others are slow. Margins on times are wide: the verdicts
must hold on a loaded machine."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from megapretrain.commands import drill

CI = ("worker-crash", "node-loss", "sigterm-startup")


def _drills(names, output) -> dict:
    """One invocation of the drill tool (one straight run for all ``names``): the report by
    drill."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = drill.main([*(a for n in names for a in ("--drill", n)), "--output", str(output),
                             "--json", "--timeout", "400", "--exit-within", "60"])
    report = json.loads(out.getvalue())
    assert status == (0 if all(r["passed"] for r in report["drills"]) else 1)
    return {r["drill"]: r for r in report["drills"]}


@pytest.fixture(scope="module")
def ci_drills(tmp_path_factory):
    return _drills(CI, tmp_path_factory.mktemp("drills") / "out")


def _passed(result: dict) -> None:
    failed = [f"{c['check']}: {c['detail']}" for c in result["checks"] if not c["ok"]]
    assert result["passed"] and not failed, (failed, result["logs"])


def test_a_worker_crash_on_node_1_restarts_on_the_straight_losses(ci_drills):
    r = ci_drills["worker-crash"]
    _passed(r)
    assert r["losses_bitwise"] is True
    assert r["exit_statuses"] == [0, 0]
    assert r["exit_after_s"] is not None and r["exit_after_s"] < 60
    assert r["detection_s"] is not None and r["restart_s"] > r["detection_s"]
    assert r["iterations_lost"] == 1  # crash at 6, checkpoint at 4: iteration 5 trained again
    assert 0 < r["goodput"] < 1


def test_a_lost_node_lets_the_survivor_out_and_a_relaunch_finishes(ci_drills):
    r = ci_drills["node-loss"]
    _passed(r)
    assert r["losses_bitwise"] is True
    assert r["exit_statuses"] == [0, 0] and r["attempts_launched"] == 2
    assert r["exit_after_s"] < 60


def test_sigterm_at_start_up_stops_cleanly_and_a_relaunch_resumes(ci_drills):
    r = ci_drills["sigterm-startup"]
    _passed(r)
    assert r["losses_bitwise"] is True
    assert r["exit_statuses"] == [0, 0] and r["attempts_launched"] == 2


def test_list_names_every_drill(capsys):
    assert drill.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in drill.DRILLS:
        assert name in out


def test_an_unknown_drill_is_one_line(tmp_path, capsys):
    assert drill.main(["--drill", "meteor", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 1 and "--drill meteor" in err and "worker-crash" in err


SLOW = [n for n in drill.DRILLS if n not in CI]


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_the_other_drills(name, tmp_path):
    r = _drills([name], tmp_path / "out")[name]
    _passed(r)
