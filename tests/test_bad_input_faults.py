"""Fault drills that can never fire are refused before any work: every ``faults.*`` field against
each condition under which it could not fire (an iteration past the run's end, a rank outside the
world, a stage without the loss, a wait of no time, a hang nothing ends, a field without its drill,
an iteration a resumed run has passed), and every drill of ``tools/drill.py`` against the nodes,
processes and iterations of its runs."""

from __future__ import annotations

import dataclasses
import os

import pytest

from megapretrain.commands import drill as drill_tool
from megapretrain.commands.drills import DRILLS
from megapretrain.config import FaultsConfig, load_config
from megapretrain.errors import ConfigError
from megapretrain.faults import Faults
from megapretrain.resolve import check_run_faults, resolve
from megapretrain.train import main as train_main

from conftest import assert_one_line
from helpers import TWO_STEPS

ITERS = 10
SMALL = ["--model.num_layers", "4", "--model.hidden_size", "64", "--model.num_heads", "4",
         "--model.vocab_size", "257", "--train.iters", str(ITERS), "--train.seq_length", "32",
         "--train.micro_batch_size", "1", "--train.global_batch_size", "4"]
PP2 = ["--parallel.pp", "2"]
ZBV = ["--parallel.pp", "2", "--parallel.vpp", "2", "--parallel.pp_schedule", "zbv"]

# field: [(overrides, world size, words of the refusal, the fix: overrides that make it fire)];
# the iteration fields (Faults.NAMES) also get the past-the-end case below, from the schema
NEVER_FIRE = {
    "nan_at": [(PP2 + ["--faults.nan_at", "3", "--faults.rank", "0"], 2,
                ["faults.nan_at=3", "faults.rank=0", "loss", "--faults.rank 1"],
                ["--faults.rank", "1"]),
               # ZB-V: the loss head sits on the first stage, not the last
               (ZBV + ["--faults.nan_at", "3", "--faults.rank", "1"], 2,
                ["faults.nan_at=3", "faults.rank=1", "--faults.rank 0"], ["--faults.rank", "0"])],
    "spike_at": [(PP2 + ["--faults.spike_at", "9", "--faults.rank", "0"], 2,
                  ["faults.spike_at=9", "faults.rank=0", "loss"], ["--faults.rank", "-1"])],
    "exit_at": [(["--faults.exit_at", "3", "--faults.rank", "1"], 1,
                 ["faults.rank=1", "1 rank", "--faults.rank 0"], ["--faults.rank", "0"])],
    "hang_at": [(["--faults.hang_at", "3", "--watchdog.timeout_s", "0"], 1,
                 ["faults.hang_at=3", "watchdog.timeout_s=0", "ever end the hang"],
                 ["--watchdog.timeout_s", "60"])],
    "slow_data_at": [(["--faults.slow_data_at", "3", "--faults.slow_data_s", "0"], 1,
                      ["faults.slow_data_at=3", "faults.slow_data_s=0", "no time"],
                      ["--faults.slow_data_s", "0.5"])],
    "oom_at": [(["--faults.oom_at", "3", "--faults.rank", "4"], 4,
                ["faults.rank=4", "0..3"], ["--faults.rank", "3"])],
    "slow_data_s": [(["--faults.slow_data_s", "5"], 1,
                     ["faults.slow_data_s=5", "does nothing without faults.slow_data_at"],
                     ["--faults.slow_data_at", "3"])],
    "slow_data_steps": [(["--faults.slow_data_steps", "3"], 1,
                         ["faults.slow_data_steps=3", "faults.slow_data_at"],
                         ["--faults.slow_data_at", "3"])],
    "rank": [(["--faults.rank", "0"], 1, ["faults.rank=0", "does nothing without a fault drill"],
              ["--faults.exit_at", "3"])],
    "every_attempt": [(["--faults.every_attempt", "true"], 1,
                       ["faults.every_attempt=true", "does nothing without"],
                       ["--faults.exit_at", "3"])],
}


def _cases():
    for name in Faults.NAMES:  # every iteration field: past the run's end
        yield (f"{name} past the end", ([f"--faults.{name}", str(ITERS + 1)], 1,
               [f"faults.{name}={ITERS + 1}", f"iteration {ITERS}", f"--faults.{name} {ITERS}"],
               [f"--faults.{name}", str(ITERS)]))
    for field, cases in NEVER_FIRE.items():
        for i, case in enumerate(cases):
            yield f"{field} #{i}", case


CASES = dict(_cases())


def _resolve(overrides: list[str], world: int):
    check_run_faults(resolve(load_config(None, [*SMALL, *overrides]), world))


def test_every_faults_field_has_a_never_fire_case():
    """A new field of the faults section fails here until it has a rule and a case; a new drill
    iteration (``*_at``) must be one of the drills the trainer injects (and gets its case)."""
    fields = {f.name for f in dataclasses.fields(FaultsConfig)}
    assert {f for f in fields if f.endswith("_at")} == set(Faults.NAMES)
    assert fields == set(NEVER_FIRE), fields ^ set(NEVER_FIRE)


@pytest.mark.parametrize("case", list(CASES))
def test_a_fault_that_can_never_fire_is_refused_naming_the_fix(case):
    overrides, world, words, fix = CASES[case]
    with pytest.raises(ConfigError) as refused:
        _resolve(overrides, world)
    message = str(refused.value)
    assert "\n" not in message and all(w in message for w in words), (words, message)
    _resolve([*overrides, *fix], world)  # the fix it names: the drill can fire, and is accepted


def test_the_training_refuses_it_before_any_work(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    status = train_main([*TWO_STEPS, "--data.paths", f"[{corpus}]", "--run.dir", str(run),
                         "--faults.exit_at", "50"])
    assert_one_line(capsys, status, 2, "faults.exit_at=50", "can never fire", "iteration 2")
    assert not (run / "checkpoints").exists()


def test_a_resume_refuses_a_drill_it_has_passed_unless_it_fired_or_fires_every_attempt(
        corpus, tmp_path, capsys):
    run = tmp_path / "run"
    base = [*TWO_STEPS, "--data.paths", f"[{corpus}]", "--run.dir", str(run),
            "--checkpoint.interval", "1"]
    assert train_main([*base, "--faults.nan_at", "1"]) == 0  # fires, and is recorded
    assert os.listdir(run / "faults") == ["nan_at.rank0.json"]
    capsys.readouterr()
    # a drill added on a resume past its iteration: never recorded, it can never fire
    status = train_main([*base, "--faults.nan_at", "1", "--faults.exit_at", "2", "--train.iters", "3"])
    assert_one_line(capsys, status, 2, "faults.exit_at=2", "resumes after iteration 2",
                    "--faults.exit_at 3")
    assert sorted(os.listdir(run / "checkpoints")) == ["iter_0000001", "iter_0000002", "latest"]
    # the drill that fired here goes by; with every attempt nothing is recorded, and a run that went
    # on past its drill may be restarted past it
    assert train_main([*base, "--faults.nan_at", "1", "--faults.exit_at", "2", "--faults.every_attempt", "true",
                       "--train.iters", "3"]) == 0


# -- the drills of tools/drill.py ------------------------------------------------------------------

# the drills that strike node 0 alone (a stop signal to every launcher) fire on one node; every
# other strikes a node other than node 0. A new drill fails here until it is placed in one.
ONE_NODE = {f"{sig}-{moment}" for sig in ("sigterm", "sigusr1")
            for moment in ("startup", "mid-step", "mid-save")}
TWO_NODES = {"worker-crash", "crash-twice", "node-loss", "hang", "rank-swap", "crash-loop",
             "corrupt-checkpoint"}
# the drills whose moment is no iteration (at start-up, during a save): they fire in any run
NO_ITERATION = {f"{sig}-{moment}" for sig in ("sigterm", "sigusr1")
                for moment in ("startup", "mid-save")}


def _settings(name: str, nodes: int, procs: int, tmp_path):
    args = drill_tool.parse_args(["--drill", name, "--nodes", str(nodes), "--procs-per-node",
                                  str(procs)])
    return drill_tool.Settings(args, str(tmp_path / "out"), str(tmp_path / "corpus"))


def test_every_drill_is_placed():
    assert set(DRILLS) == ONE_NODE | TWO_NODES and not ONE_NODE & TWO_NODES


@pytest.mark.parametrize("nodes,procs", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1)])
@pytest.mark.parametrize("name", list(DRILLS))
def test_every_drill_fires_or_is_refused_up_front(name, nodes, procs, tmp_path):
    why = drill_tool.cannot_fire(DRILLS[name], _settings(name, nodes, procs, tmp_path))
    if nodes >= 2 or name in ONE_NODE:
        assert why is None, why
    else:
        assert why is not None and f"--drill {name}" in why and "--nodes 2" in why, why


@pytest.mark.parametrize("name", list(DRILLS))
def test_every_drill_past_the_runs_end_is_refused(name, tmp_path, monkeypatch):
    """Runs too short for the drill's moment (its fault iteration, or the iteration it waits for):
    refused, naming the drill."""
    monkeypatch.setattr(drill_tool, "ITERS", 3)
    why = drill_tool.cannot_fire(DRILLS[name], _settings(name, 2, 1, tmp_path))
    if name in NO_ITERATION:
        assert why is None, why
    else:
        assert why is not None and f"--drill {name}" in why and "iteration" in why, why


def test_the_drill_tool_refuses_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "out"
    status = drill_tool.main(["--drill", "node-loss", "--drill", "worker-crash", "--nodes", "1",
                              "--output", str(out)])
    assert_one_line(capsys, status, 2, "--drill node-loss", "--nodes 1", "--nodes 2",
                    "worker-crash")
    assert not out.exists()
