"""Inputs that would be given and then ignored, taken twice or taken literally, walked as rules:
every field of config.NEEDS alone, every tool's repeated flag and path flag, every list of inputs
with a duplicate, a run directory nested in a live run's, an option put under the wrong section."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from megapretrain import cli
from megapretrain.config import (
    NEEDS,
    Config,
    _all_paths,
    get_field,
    load_config,
    parse_overrides,
    repeated_overrides,
)
from megapretrain.errors import ConfigError
from megapretrain.resolve import resolve
from megapretrain.run_lock import RunLock

from helpers import TOOLS, load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -- a field that needs another setting: refused alone, naming both ---------------------------------

# a value other than the default for each field of NEEDS
OTHER = {"optim.muon_lr": 0.02, "optim.muon_momentum": 0.9, "optim.muon_nesterov": False,
         "optim.muon_ns_steps": 3, "optim.muon_ns_precision": "fp32",
         "optim.muon_adjust_lr": "match_rms_adamw", "optim.muon_weight_decay": 0.0,
         "optim.initial_loss_scale": 1024.0, "optim.loss_scale_window": 10,
         "optim.min_loss_scale": 2.0, "parallel.sequence_parallel": True,
         "parallel.pipeline_layers": [1, 1], "parallel.pp_trace": True, "parallel.cp_comm": "ring",
         "parallel.zero3_keep_gathered": True, "parallel.zero3_prefetch": False,
         "parallel.fp8_allgather": False, "model.fp8_skip": ["layers.0.*"],
         "model.sliding_window_pattern": 2, "schedule.wsd_decay_fraction": 0.5,
         "checkpoint.finetune": True, "recovery.skip_batches": 2, "recovery.max_rollbacks": 2,
         "recovery.lr_factor": 0.9, "recovery.prune_rolled_back": False, "watchdog.multiple": 5.0,
         "watchdog.floor_s": 60.0, "faults.slow_data_s": 1.0, "faults.slow_data_steps": 2,
         "faults.rank": 0, "faults.every_attempt": True}
NEEDING = [(f, rule) for rule in NEEDS for f in rule.fields]
# the partner turned off, where the defaults turn it on
OFF = {"recovery.action": ("--recovery.action", "alert"), "watchdog.timeout_s": ("--watchdog.timeout_s", "60")}


def _flag(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _cfg(*overrides: str) -> Config:
    return load_config(None, ["--model.vocab_size", "256", *overrides])


def test_every_field_of_the_table_exists_and_has_another_value_here():
    paths = set(_all_paths(Config))
    assert {f for f, _ in NEEDING} <= paths
    assert {f for f, _ in NEEDING} == set(OTHER)
    for rule in NEEDS:
        assert set(rule.shown) <= paths
        assert not rule.holds(_cfg(*OFF.get(rule.shown[0] if rule.shown else "", ()))), rule.partner


@pytest.mark.parametrize("field, rule", NEEDING, ids=[f for f, _ in NEEDING])
def test_a_field_that_needs_another_is_refused_alone(field, rule):
    value = OTHER[field]
    cfg = _cfg(f"--{field}", _flag(value), *OFF.get(rule.shown[0] if rule.shown else "", ()))
    assert get_field(cfg, field) == value and not rule.holds(cfg)
    with pytest.raises(ConfigError) as exc:
        resolve(cfg, 1)
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith(f"{field}=") and "does nothing without" in message
    assert rule.partner.split(" (")[0] in message and f"drop {field}" in message


@pytest.mark.parametrize("field, rule", NEEDING, ids=[f for f, _ in NEEDING])
def test_a_saved_field_whose_partner_a_tool_turns_off_is_reset_with_a_note(field, rule):
    """A saved run's config under a tool's new settings (a reshard to tp 1 of a tp 2 run with
    sequence parallelism): the saved field is reset to its default with a note, and the config
    resolves; the same field given on the command line is still refused."""
    from megapretrain.config import _default, check_needs, drop_inherited

    off = list(OFF.get(rule.shown[0] if rule.shown else "", ()))
    cfg = _cfg(f"--{field}", _flag(OTHER[field]), *off)
    notes = drop_inherited(cfg, off)
    assert get_field(cfg, field) == _default(field)
    assert [n for n in notes if n.startswith(f"{field}=")] and all("\n" not in n for n in notes)
    check_needs(cfg)
    given = _cfg(f"--{field}", _flag(OTHER[field]), *off)
    assert drop_inherited(given, [f"--{field}", _flag(OTHER[field]), *off]) == []
    with pytest.raises(ConfigError, match="does nothing without"):
        check_needs(given)


def test_a_saved_config_with_every_field_at_its_default_resolves(tmp_path):
    """A run's config.yaml lists every field: the defaults of the table's fields are no value."""
    from megapretrain.config import save_config

    path = tmp_path / "config.yaml"
    save_config(_cfg(), str(path))
    resolve(load_config(str(path)), 1)


def test_with_its_partner_the_field_takes_effect():
    resolve(_cfg("--optim.optimizer", "muon", "--optim.muon_lr", "0.02"), 1)
    resolve(_cfg("--parallel.tp", "2", "--parallel.sequence_parallel", "true"), 2)
    resolve(_cfg("--train.precision", "fp16", "--optim.loss_scale_window", "10"), 1)


@pytest.mark.parametrize("path", sorted(
    os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "configs")) for f in fs if f.endswith(".yaml")))
def test_no_shipped_config_sets_a_field_without_its_partner(path):
    from megapretrain.config import check_needs

    check_needs(load_config(path))


def test_the_run_scripts_and_docs_set_no_table_field_alone():
    """Every command line in run_scripts/ and the docs that sets a field of the table sets what
    it needs too (or takes it from a config that does)."""
    texts = [open(os.path.join(d, f)).read() for top in ("run_scripts", "docs")
             for d, _, fs in os.walk(os.path.join(ROOT, top)) for f in fs if f.endswith((".sh", ".md"))]
    texts.append(open(os.path.join(ROOT, "README.md")).read())
    for text in texts:
        for line in text.replace("\\\n", " ").splitlines():
            if not re.search(r"python |\.sh\b|torchrun|megapretrain-", line):
                continue  # prose, not a command
            given = dict(re.findall(r"--([a-z_0-9]+\.[a-z_0-9.]+)[ =](\S+)", line))
            for field, rule in NEEDING:
                if field in given and not any(p in given for p in rule.shown) and "--config" not in line:
                    if rule.shown:
                        pytest.fail(f"{field} without {rule.partner}: {line.strip()}")


# -- a config override given twice: the last wins, with a warning --------------------------------


def test_an_override_given_twice_warns_and_the_last_wins():
    assert parse_overrides(["--train.iters", "5", "--train.iters=7"]) == [("train.iters", 5), ("train.iters", 7)]
    assert load_config(None, ["--train.iters", "5", "--train.iters", "7"]).train.iters == 7
    assert repeated_overrides(["--train.iters", "5", "--optim.lr", "1", "--train.iters=7", "--optim.lr", "1"]) == [
        "--train.iters given twice (5, then 7): the last is used"]


def test_train_refuses_two_config_files(capsys):
    from megapretrain import train

    assert train.main(["--config", "a.yaml", "--config=b.yaml", "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--config given twice ('a.yaml', then 'b.yaml')" in err


# -- every tool's parser: a repeated flag refused, every path flag expanded ----------------------

class _Got(Exception):
    pass


def _parsers(name: str) -> list[argparse.ArgumentParser]:
    """The parsers ``tools/NAME.py`` builds (its subcommands' too), caught as it parses."""
    module, got = load_tool(name), []
    original = cli.ToolParser.parse_known_args

    def grab(self, args=None, namespace=None):
        got.append(self)
        raise _Got()

    cli.ToolParser.parse_known_args = grab
    try:
        module.main(["--help"])
    except (_Got, SystemExit):
        pass
    finally:
        cli.ToolParser.parse_known_args = original
    out = []
    for parser in got:
        out.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                out += list(dict.fromkeys(action.choices.values()))
    return out


# a flag whose name says "path" that is not one (a choice, a count, a name, a hub id's split)
NOT_PATHS = {"--input-format", "--json-keys", "--checkpoint-write-gbps", "--key-names", "--data-parallel"}
PATHISH = re.compile(r"config|checkpoint|output|input|dir|file|path|prefix|model|corpus|hf|data|tasks|fewshot|json|"
                     r"png|plot|emit|write|diff|from|dcp|megatron|nanogpt")


def _fill(parser, but: argparse.Action) -> list[str]:
    """Values for the parser's other required arguments and positionals."""
    argv = []
    for a in parser._actions:
        if a is but or isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        value = str(next(iter(a.choices))) if a.choices else "1"
        if not a.option_strings:
            argv.append(value)
        elif a.required:
            argv += [a.option_strings[0], value]
    return argv


def _valued(parser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.nargs != 0 and not isinstance(
        a, (argparse._HelpAction, argparse._SubParsersAction))]


ALL = {name: _parsers(name) for name in TOOLS}
PARSERS = [(f"{name}[{i}]", p) for name, ps in ALL.items() for i, p in enumerate(ps)
           if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)]


def test_every_tool_builds_its_parser_as_a_tool_parser():
    assert all(ALL.values()), [name for name, ps in ALL.items() if not ps]
    assert all(isinstance(p, cli.ToolParser) for ps in ALL.values() for p in ps)


@pytest.mark.parametrize("name, parser", PARSERS, ids=[n for n, _ in PARSERS])
def test_every_path_flag_of_every_tool_expands_home_and_variables(name, parser, monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.setenv("FLAGS_ROOT", "/data")
    checked = 0
    for action in _valued(parser):
        names = action.option_strings or [action.dest]
        if not any(PATHISH.search(n) for n in names) or set(names) & NOT_PATHS or action.choices \
                or action.type not in (None, str):
            continue
        assert cli._is_path(action), f"{name}: {names} names a path: add it to cli.PATH_FLAGS"
        values = ["fmt", "~/x"] if action.nargs == 2 else ["~/x", "$FLAGS_ROOT/y"] \
            if action.nargs in ("+", "*") else ["~/x"]
        argv = [*(action.option_strings[:1]), *values] if action.option_strings else values
        if not action.option_strings:
            argv = []
            for a in parser._actions:  # the positionals in their order
                if not a.option_strings and not isinstance(a, argparse._HelpAction):
                    argv.append("~/x" if a is action else "1")
            argv += [x for x in _fill(parser, action) if x.startswith("-") or x in ("1",)][len(argv):]
        else:
            argv = _fill(parser, action) + argv
        ns, _ = parser.parse_known_args(argv)
        got = json.dumps(getattr(ns, action.dest))
        assert "/home/someone/x" in got and "~" not in got, (name, names, got)
        if "$FLAGS_ROOT/y" in values:
            assert "/data/y" in got
        checked += 1
    if name.startswith(("merge_datasets", "preprocess_data", "convert_checkpoint[1]", "reshard")):
        assert checked, f"{name}: no path flag found"


@pytest.mark.parametrize("name, parser", PARSERS, ids=[n for n, _ in PARSERS])
def test_every_valued_flag_of_every_tool_is_refused_twice(name, parser):
    for action in _valued(parser):
        if not action.option_strings or isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
            continue
        flag = action.option_strings[-1]
        value = str(next(iter(action.choices))) if action.choices else "1"
        values = [value] * (action.nargs if isinstance(action.nargs, int) else 1)
        with pytest.raises((SystemExit, cli.UserError)):
            parser.parse_known_args([flag, *values, flag, *values])


def test_a_repeated_flag_is_one_line_naming_it_and_both_values(capsys):
    from megapretrain.commands import inspect_data

    with pytest.raises(SystemExit) as exc:
        inspect_data.main(["p", "--seq-length", "8", "--seq-length=16"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("error: argument --seq-length: given twice ('8', then '16'): give it once")


def test_append_flags_and_flags_without_a_value_repeat():
    p = cli.ToolParser()
    p.add_argument("--rank", action="append")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(["--rank", "1", "--json", "--rank", "2", "--json"])
    assert ns.rank == ["1", "2"] and ns.json


def test_an_unset_variable_in_a_path_flag_is_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.delenv("FLAGS_NOT_SET", raising=False)
    p = cli.ToolParser(prog="tool")
    p.add_argument("--output")
    with pytest.raises(SystemExit):
        p.parse_args(["--output", "$FLAGS_NOT_SET/x"])
    assert "--output='$FLAGS_NOT_SET/x': environment variable FLAGS_NOT_SET is not set" in capsys.readouterr().err


# -- a list of inputs names each once -----------------------------------------------------------

DISTINCT = [("data.paths", "[0.5, /d/a_text_document, 0.5, /d/a_text_document]"),
            ("data.paths", "[a_text_document, ./a_text_document]"), ("eval.tasks", "[t.jsonl, t.jsonl]")]


@pytest.mark.parametrize("field, value", DISTINCT)
def test_a_config_list_of_inputs_with_a_duplicate_is_refused(field, value):
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)} names '.*' twice.*give each input once"):
        resolve(_cfg(f"--{field}", value, "--train.eval_interval", "10"), 1)


def test_every_distinct_field_is_a_list_of_paths():
    from dataclasses import fields, is_dataclass

    def walk(node):
        for f in fields(node):
            value = getattr(node, f.name)
            if is_dataclass(value):
                yield from walk(value)
            elif f.metadata.get("distinct"):
                yield f
    found = list(walk(Config()))
    assert {f.name for f in found} == {"paths", "tasks"}
    assert all(f.metadata.get("path") for f in found)


@pytest.mark.parametrize("flag", sorted(cli.DISTINCT_FLAGS))
def test_a_tool_list_of_inputs_with_a_duplicate_is_refused(flag, capsys):
    p = cli.ToolParser(prog="tool")
    p.add_argument(flag, nargs="+")
    with pytest.raises(SystemExit):
        p.parse_args([flag, "a", "b", "./a"])
    assert f"{flag} names './a' twice (as 'a'): give each input once" in capsys.readouterr().err
    used = [name for name, ps in ALL.items() for parser in ps for a in parser._actions if flag in a.option_strings]
    assert used, f"{flag}: no tool has it"


# -- a run directory nested in a live run's ------------------------------------------------------


def _live_lock(directory) -> subprocess.Popen:
    """A live training's lock on ``directory``: held by a process that sleeps."""
    os.makedirs(directory, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(os.path.join(directory, ".lock"), "w") as fh:
        json.dump({"pid": proc.pid, "host": socket.gethostname(), "started": time.time()}, fh)
    return proc


@pytest.mark.parametrize("inner", [True, False], ids=["inside", "holding"])
def test_a_run_dir_nested_with_a_live_run_is_refused(tmp_path, inner):
    outer, nested = tmp_path / "run", tmp_path / "run" / "sub" / "run2"
    live, mine = (outer, nested) if inner else (nested, outer)
    proc = _live_lock(live)
    try:
        with pytest.raises(ConfigError) as exc:
            RunLock(str(mine)).acquire()
        message = str(exc.value)
        assert str(mine) in message and os.path.realpath(live) in message and f"PID {proc.pid}" in message
        assert ("is inside" if inner else "holds") in message and "choose a --run.dir" in message
    finally:
        proc.kill()
        proc.wait()
    lock = RunLock(str(mine))  # the other run gone: its lock is stale, nothing is nested any more
    lock.acquire()
    lock.release()


def test_sibling_run_dirs_are_not_nested(tmp_path):
    proc = _live_lock(tmp_path / "a")
    try:
        lock = RunLock(str(tmp_path / "ab"))
        lock.acquire()
        lock.release()
    finally:
        proc.kill()
        proc.wait()


# -- an option under the wrong section: the suggestion searches every section ---------------------

NAMES = {}
for _path in _all_paths(Config):
    NAMES.setdefault(_path.rsplit(".", 1)[-1], []).append(_path)
ELSEWHERE = [(p, s) for name, ps in NAMES.items() for p in ps
             for s in ("train", "optim", "model", "parallel", "data") if not p.startswith(s + ".")
             and f"{s}.{name}" not in _all_paths(Config)][::7]


@pytest.mark.parametrize("path, section", ELSEWHERE, ids=[f"{s}.{p}" for p, s in ELSEWHERE])
def test_an_option_under_another_section_suggests_where_it_is(path, section):
    wrong = f"{section}.{path.rsplit('.', 1)[-1]}"
    with pytest.raises(ConfigError, match=re.escape(f"'--{path}'")):
        load_config(None, [f"--{wrong}", "1"])
