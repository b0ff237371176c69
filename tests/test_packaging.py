"""kernels/ installs as megapretrain.kernels, from a regular (non-editable) build too, and the tools
run from that build: every tools/*.py --help, and its console scripts are declared.

kernels/ is a namespace portion (no ``__init__.py``), so it never shadows the hub's ``kernels``
package (which transformers imports) even with the repository root first on ``sys.path``: with a
stand-in ``kernels`` distribution installed, ``import kernels`` gives the stand-in while
``megapretrain.kernels.*`` resolve, in a checkout that is not installed, an editable install and a
wheel install. Each case runs in a fresh virtual environment that sees this interpreter's
packages (torch and the rest) through a ``.pth`` line; pip works offline (no index, no build
isolation)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import TOOLS, console_scripts, every_help

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_installed_wheel_provides_namespaced_kernels(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), ROOT], check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("megapretrain-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, cwd=tmp_path)
    code = ("import megapretrain, megapretrain.kernels.dispatch as k, megapretrain.model.llama; "
            "print(megapretrain.__file__); print(k.__file__)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True).stdout.split()
    assert all(path.startswith(str(site)) for path in out), out
    assert out[1].endswith(os.path.join("megapretrain", "kernels", "dispatch.py"))
    assert not (site / "megapretrain" / "kernels" / "__init__.py").exists()  # a namespace portion
    assert not (site / "kernels").exists()  # never the bare top-level name

    # the tools' paths run against the installed package (not this checkout's sources)
    result = every_help(env=env, cwd=str(tmp_path))
    assert result["package"].startswith(str(site)), result
    assert set(result["codes"].values()) == {0} and len(result["codes"]) == len(TOOLS), result
    (entry_points,) = site.glob("megapretrain-*.dist-info/entry_points.txt")
    declared = dict(line.replace(" ", "").split("=", 1) for line in entry_points.read_text().splitlines()
                    if "=" in line)
    assert declared == console_scripts()



PIP = ["-m", "pip", "--disable-pip-version-check", "install", "--quiet", "--no-deps",
       "--no-build-isolation", "--no-index"]
STAND_IN = "hub kernels stand-in"
CHECKOUT = (os.path.join(ROOT, "megapretrain"), os.path.join(ROOT, "kernels"))
PROBE = """\
import json, sys
import kernels
import megapretrain.kernels.dispatch, megapretrain.kernels.rope, megapretrain.model.llama
m = sys.modules
print(json.dumps({"kernels": getattr(kernels, "MARKER", None),
                  "megapretrain": m["megapretrain"].__file__,
                  "dispatch": m["megapretrain.kernels.dispatch"].__file__,
                  "rope": m["megapretrain.kernels.rope"].__file__}))
"""


def _run(*args, cwd) -> str:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def _purelib(python: str) -> str:
    return _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                cwd=ROOT).strip()


def _outer_path() -> list[str]:
    """The folders this interpreter imports packages from (its site-packages and what their .pth
    files add), less the checkout's own source folders (a virtual environment inside the checkout,
    such as run_scripts' .venv, stays)."""
    root = os.path.realpath(ROOT)
    folders = [os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)]
    installed = ("site-packages", "dist-packages")
    return [p for p in dict.fromkeys(folders)
            if os.path.commonpath([p, root]) != root or any(part in installed for part in p.split(os.sep))]


def _venv(path) -> str:
    """A virtual environment at ``path`` seeing this interpreter's packages, with a stand-in of the
    hub's ``kernels`` (a regular package) installed into it; its python."""
    _run(sys.executable, "-m", "venv", "--without-pip", str(path), cwd=path.parent)
    python = str(path / "bin" / "python")
    with open(os.path.join(_purelib(python), "outer.pth"), "w") as f:
        f.write("".join(f"{p}\n" for p in _outer_path()))
    src = path.parent / f"{path.name}-stand-in"
    (src / "kernels" / "_internals").mkdir(parents=True)
    (src / "kernels" / "__init__.py").write_text(f"MARKER = {STAND_IN!r}\n")
    # the hub's package registers an egg_info writer (kernels._internals.locking) that every
    # setuptools build in an environment holding it calls: where it is installed outside, the
    # stand-in that shadows it answers that call
    (src / "kernels" / "_internals" / "__init__.py").write_text("")
    (src / "kernels" / "_internals" / "locking.py").write_text(
        "def write_egg_lockfile(cmd, basename, filename):\n    pass\n")
    (src / "setup.py").write_text("from setuptools import setup\n"
                                  "setup(name='kernels', version='0.0.1',\n"
                                  "      packages=['kernels', 'kernels._internals'])\n")
    _run(python, *PIP, str(src), cwd=path.parent)
    return python


def _probe(python: str, cwd) -> dict:
    return json.loads(_run(python, "-c", PROBE, cwd=cwd).strip().splitlines()[-1])


def _sources(megapretrain_dir: str, kernels: str) -> dict:
    """:data:`PROBE`'s answer for megapretrain in ``megapretrain_dir``, kernels in ``kernels``."""
    return {"kernels": STAND_IN, "megapretrain": os.path.join(megapretrain_dir, "__init__.py"),
            "dispatch": os.path.join(kernels, "dispatch.py"),
            "rope": os.path.join(kernels, "rope.py")}


def test_kernels_is_a_namespace_portion():
    assert not os.path.exists(os.path.join(ROOT, "kernels", "__init__.py"))
    assert os.path.isfile(os.path.join(ROOT, "kernels", "dispatch.py"))


def test_checkout_run_from_its_root_leaves_kernels_to_the_hub(tmp_path):
    python = _venv(tmp_path / "env")
    assert _probe(python, ROOT) == _sources(*CHECKOUT)


def test_editable_install_leaves_kernels_to_the_hub(tmp_path):
    python = _venv(tmp_path / "env")
    _run(python, *PIP, "--editable", ROOT, cwd=tmp_path)
    assert _probe(python, ROOT) == _sources(*CHECKOUT)
    assert _probe(python, tmp_path) == _sources(*CHECKOUT)  # the install maps the checkout


def test_wheel_install_leaves_kernels_to_the_hub(tmp_path):
    python = _venv(tmp_path / "env")
    src = tmp_path / "src"  # a clean copy: no build/ left from an earlier build of the checkout
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for name in ("megapretrain", "kernels"):
        shutil.copytree(os.path.join(ROOT, name), src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp_path / "wheels"
    _run(python, "-m", "pip", "--disable-pip-version-check", "wheel", "--quiet", "--no-deps",
         "--no-build-isolation", "--no-index", "-w", str(wheels), str(src), cwd=tmp_path)
    (wheel,) = wheels.glob("megapretrain-*.whl")
    _run(python, *PIP, str(wheel), cwd=tmp_path)
    site = os.path.join(_purelib(python), "megapretrain")
    assert not os.path.exists(os.path.join(site, "kernels", "__init__.py"))
    assert _probe(python, tmp_path) == _sources(site, os.path.join(site, "kernels"))
    # from the root the checkout's sources come first on the path, as when it is not installed
    assert _probe(python, ROOT) == _sources(*CHECKOUT)
