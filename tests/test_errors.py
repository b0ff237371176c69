"""One user-error family: bad input prints one line and exits 2; a bug shows its traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megapretrain.errors import CheckpointError, ConfigError, DataError, MissingFileError, PipelineError, UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": "1"}
    return subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


TRAIN = "import sys; from megapretrain.train import main; sys.exit(main(sys.argv[1:]))"
# the same, with a programming error planted inside setup (after validation, while building)
TRAIN_WITH_BUG = ("import sys, megapretrain.trainer as t\n"
                  "def broken(*a, **k): raise KeyError('a bug')\n"
                  "t.build_model_chunks = broken\n" + TRAIN)


def test_a_user_error_is_one_line_and_exit_2(corpus, tmp_path):
    done = _run(TRAIN, "--config", "configs/tiny.yaml", "--run.dir", str(tmp_path), "--data.paths", f"[{corpus}]",
                "--model.num_kv_heads", "0")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: model.num_kv_heads=0 must be at least 1 (or null for the default)")
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1


def test_a_bug_inside_setup_shows_its_traceback(corpus, tmp_path):
    done = _run(TRAIN_WITH_BUG, "--config", "configs/tiny.yaml", "--run.dir", str(tmp_path), "--data.paths",
                f"[{corpus}]")
    assert done.returncode not in (0, 2)
    assert "Traceback" in done.stderr and "KeyError: 'a bug'" in done.stderr


def test_a_plain_value_error_is_not_bad_input(corpus, tmp_path, monkeypatch):
    """A ValueError from inside the code (not a UserError) propagates out of main()."""
    from megapretrain import train, trainer

    def broken(*args, **kwargs):
        raise ValueError("an internal inconsistency")

    monkeypatch.setattr(trainer, "build_model_chunks", broken)
    with pytest.raises(ValueError, match="internal inconsistency"):
        train.main(["--config", "configs/tiny.yaml", "--run.dir", str(tmp_path), "--data.paths", f"[{corpus}]"])


def test_the_error_family():
    for cls in (ConfigError, DataError, CheckpointError, PipelineError, MissingFileError):
        assert issubclass(cls, UserError) and issubclass(cls, ValueError)
    assert issubclass(MissingFileError, FileNotFoundError)
    assert not issubclass(KeyError, UserError)


def test_tools_catch_only_user_errors(tmp_path, monkeypatch, capsys):
    from megapretrain.commands import reshard_checkpoint as reshard

    argv = ["--checkpoint", str(tmp_path / "none"), "--output", str(tmp_path / "out"), "--world-size", "1"]
    assert reshard.main(argv) == 2
    assert capsys.readouterr().err.startswith("error: ")

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the tool")

    monkeypatch.setattr(reshard, "resolve_checkpoint", broken)
    with pytest.raises(RuntimeError, match="a bug in the tool"):
        reshard.main(argv)
