"""The tools' entry points: every tools/NAME.py runs megapretrain.commands.NAME or, for a benchmark
or a developer check, is a script over the package (``--help`` works, exit codes pass through), the
console scripts setup.py declares resolve to a callable ``main``, and running without the package
installed says so in one line."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from helpers import TOOLS, console_scripts, every_help, load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_tool_help_exits_0():
    result = every_help()
    assert result["codes"] == {os.path.join(ROOT, "tools", f"{name}.py"): 0 for name in TOOLS}


def test_every_tool_is_a_command_with_a_main():
    """A command's tools/NAME.py runs megapretrain.commands.NAME.main; a script defines its own."""
    for name in TOOLS:
        module = load_tool(name)
        assert callable(module.main) and module.main.__module__ == module.__name__, name
        assert module.__doc__ and module.__doc__.strip(), name
        if module.__name__.startswith("megapretrain."):  # the script runs it
            script = open(os.path.join(ROOT, "tools", f"{name}.py")).read()
            assert f"megapretrain.commands.{name}" in script, name


def test_console_scripts_resolve_to_a_callable_main():
    scripts = console_scripts()
    assert {"megapretrain-train", "megapretrain-plan", "megapretrain-preprocess", "megapretrain-convert",
            "megapretrain-reshard", "megapretrain-preflight", "megapretrain-smoke-test", "megapretrain-inspect-data",
            "megapretrain-inspect-checkpoint", "megapretrain-merge-datasets",
            "megapretrain-pipeline-schedule"} <= set(scripts)
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert function == "main", name
        assert callable(getattr(importlib.import_module(module), function)), name


def test_a_tool_passes_its_exit_status_and_one_error_line_through(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "inspect_checkpoint.py"),
                           str(tmp_path / "nothing")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("tool", ["plan", "gen_config_reference", "gpu_check"])
def test_a_tool_without_the_package_installed_says_how_to_install_it(tmp_path, tool):
    """``python -S``: no site-packages, so neither an installed nor an editable megapretrain."""
    script = os.path.join(ROOT, "tools", f"{tool}.py")
    proc = subprocess.run([sys.executable, "-S", script, "--help"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "pip install -e ." in proc.stderr, proc.stderr


def test_a_checkout_that_is_not_installed_finds_its_kernels(tmp_path):
    """From the repository root without an install (the editable mapping taken away), the model code
    still imports: kernels/ is megapretrain.kernels, never a top-level ``kernels``."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(f).lower()]; "
            "import megapretrain.model.llama, megapretrain.optim.optimizer; "
            "import megapretrain.kernels.dispatch as k; "
            "print(megapretrain.__file__); print(k.__file__); print('kernels' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=True).stdout.split()
    assert out == [os.path.join(ROOT, "megapretrain", "__init__.py"),
                   os.path.join(ROOT, "kernels", "dispatch.py"), "False"]
