"""kernels/ installs as megapretrain.kernels, from a regular (non-editable) build too, and the tools
run from that build: every tools/*.py --help, and its console scripts are declared."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_installed_wheel_provides_namespaced_kernels(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), ROOT], check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("megapretrain-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, cwd=tmp_path)
    code = ("import megapretrain, megapretrain.kernels as k, megapretrain.model.llama; "
            "print(megapretrain.__file__); print(k.__file__)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True).stdout.split()
    assert all(path.startswith(str(site)) for path in out), out
    assert out[1].endswith(os.path.join("megapretrain", "kernels", "__init__.py"))
    assert not (site / "kernels").exists()  # never the bare top-level name

    # the tools' paths run against the installed package (not this checkout's sources)
    from test_tools import TOOLS, console_scripts, every_help

    result = every_help(env=env, cwd=str(tmp_path))
    assert result["package"].startswith(str(site)), result
    assert set(result["codes"].values()) == {0} and len(result["codes"]) == len(TOOLS), result
    (entry_points,) = site.glob("megapretrain-*.dist-info/entry_points.txt")
    declared = dict(line.replace(" ", "").split("=", 1) for line in entry_points.read_text().splitlines()
                    if "=" in line)
    assert declared == console_scripts()
