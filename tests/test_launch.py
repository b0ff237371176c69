"""run_scripts/: every script parses; every pretrain script's --dry-run validates its config, data and
tokenizer at the world size it would launch, prints the plan and each node's torchrun command, and
launches nothing; the SLURM and the by-hand (NNODES / NODE_RANK / MASTER_ADDR) paths build the right
command, with restarts and a rendezvous that outlives them."""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "run_scripts", "*.sh")))
PRETRAIN = sorted(p for p in SCRIPTS if os.path.basename(p).startswith("pretrain_"))
LAUNCH = os.path.join(ROOT, "run_scripts", "launch.sh")
CLEAN = {k: v for k, v in os.environ.items()
         if not k.startswith("SLURM_") and k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                                                      "NPROC_PER_NODE", "DEFAULT_NNODES", "DEFAULT_NPROC_PER_NODE")}


@pytest.fixture
def fake_bin(tmp_path):
    """A PATH whose srun records its arguments, and a PYTHON that records (instead of running) any
    torchrun launch: a dry run must leave both logs empty."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "launched.log"
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "srun $*" >> {log}\n')
    (bin_dir / "python").write_text(
        "#!/bin/bash\n"
        f'if [ "$1" = "-m" ] && [ "$2" = "megapretrain.launcher" ]; then echo "torchrun $*" >> {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(CLEAN, PATH=f"{bin_dir}:/usr/bin:/bin", PYTHON=str(bin_dir / "python"))
    return env, log


def run(argv, env, **extra):
    return subprocess.Popen(["bash", *argv], env=dict(env, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)


def data(corpus) -> list[str]:
    """The test corpus in place of a config's data and tokenizer (a dry run checks both)."""
    return ["--data.paths", f"[{corpus}]", "--data.tokenizer.type", "ByteTokenizer", "--data.tokenizer.model", "null"]


def finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def test_every_script_parses():
    assert PRETRAIN and all(subprocess.run(["bash", "-n", s]).returncode == 0 for s in SCRIPTS)


def test_every_pretrain_script_dry_runs_at_its_size(fake_bin, corpus):
    env, log = fake_bin
    procs = {s: run([s, "--dry-run", *data(corpus)], env) for s in PRETRAIN}  # in parallel: each plans its config
    for script, proc in procs.items():
        rc, out, err = finish(proc)
        name = os.path.basename(script)[len("pretrain_"):-3]
        assert rc == 0, f"{name}: {err}"
        with open(os.path.join(ROOT, "configs", f"{name}.yaml")) as fh:
            gpus = int(re.search(r"(\d+) GPUs", fh.readline()).group(1))
        nodes = gpus // 8
        assert f"on {nodes} node(s) × 8 processes = {gpus}; nothing is launched" in out
        assert "layout: --parallel.tp" in out and "MFU" in out and " wall-clock, " in out  # the plan
        commands = [line for line in out.splitlines() if line.startswith("node ")]
        assert len(commands) == nodes
        last = commands[-1]
        assert f"--nnodes {nodes} --nproc_per_node 8 --max-restarts 3 " in last
        assert ("--standalone" if nodes == 1 else "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500") in last
        assert f"-m megapretrain.train --config {ROOT}/configs/{name}.yaml" in last
        assert f"check: the config, its data ({corpus})" in out
    assert not log.exists()


def test_a_dry_run_under_slurm_reads_its_nodes(fake_bin, corpus):
    env, log = fake_bin
    # no scontrol on this PATH: the launcher expands the node list itself (ranges, zero padding, lists)
    slurm = dict(SLURM_JOB_ID="4242", SLURM_NNODES="3", SLURM_NODEID="1", SLURM_JOB_NODELIST="gpu-a[07-08],login1",
                 SLURM_GPUS_ON_NODE="8")
    script = os.path.join(ROOT, "run_scripts", "pretrain_llama3_8b.sh")
    # 24 GPUs: dp 24, which the config's batch ramp-up (multiples of dp 64) does not fit: turned off
    rc, out, err = finish(run([script, "--dry-run", "--train.rampup_batch_size", "null", *data(corpus),
                               "--train.eval_iters", "5"], env, **slurm))
    assert rc == 0, err
    assert "on 3 node(s) × 8 processes = 24" in out
    assert re.findall(r"^node \d+ \((\S+)\)", out, re.M) == ["gpu-a07", "gpu-a08", "login1"]
    assert out.count("--rdzv-backend c10d --rdzv-endpoint gpu-a07:29500 --rdzv-id 4242 ") == 3
    assert out.rstrip().endswith("--train.eval_iters 5")
    assert not log.exists()
    # without --dry-run the batch script starts one launcher per node through srun (here: recorded)
    rc, _, err = finish(run([script, "--train.rampup_batch_size", "null", *data(corpus)], env, **slurm))
    assert rc == 0, err
    assert log.read_text().startswith(f"srun --ntasks-per-node 1 bash {LAUNCH} {ROOT}/configs/llama3_8b.yaml")
    assert "scontrol" not in log.read_text()  # no stop signal: no requeue
    # and inside that step (SLURM_STEP_ID set), each node runs torchrun with its rank
    log.unlink()
    rc, _, err = finish(run([LAUNCH, "configs/llama3_8b.yaml", "--train.rampup_batch_size", "null", *data(corpus)],
                            env, SLURM_STEP_ID="0", **slurm))
    assert rc == 0, err
    assert "--nnodes 3 --nproc_per_node 8 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint gpu-a07:29500" \
        in log.read_text()
    assert "--rdzv-conf join_timeout=120,last_call_timeout=30,close_timeout=30 -m megapretrain.train" \
        in log.read_text()


def test_by_hand_with_nnodes_node_rank_and_master_addr(fake_bin, corpus):
    env, log = fake_bin
    hand = dict(NNODES="8", NODE_RANK="3", MASTER_ADDR="10.1.2.3", MASTER_PORT="29600")
    rc, out, err = finish(run([os.path.join(ROOT, "run_scripts", "pretrain_llama3_8b.sh"), "--dry-run",
                               *data(corpus)], env, **hand))
    assert rc == 0, err
    assert "on 8 node(s) × 8 processes = 64" in out and out.count("--rdzv-endpoint 10.1.2.3:29600") == 8
    assert not log.exists()
    rc, _, err = finish(run([os.path.join(ROOT, "run_scripts", "pretrain_llama3_8b.sh"), *data(corpus)], env,
                            NPROC_PER_NODE="8",
                            **hand))
    assert rc == 0, err
    launched = log.read_text()
    assert "--nnodes 8 --nproc_per_node 8 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint 10.1.2.3:29600 " \
        "--rdzv-id megapretrain" in launched


def test_a_dry_run_refuses_a_world_size_the_config_cannot_use(fake_bin, corpus):
    env, log = fake_bin
    rc, out, err = finish(run([LAUNCH, "configs/llama3_70b.yaml", "--dry-run", *data(corpus)], env, NNODES="1",
                              NPROC_PER_NODE="7"))
    assert rc == 2 and "must divide the world size 7" in err and "node 0" not in out
    assert not log.exists()


@pytest.mark.parametrize("variables, words", [
    (dict(NNODES="0"), "NNODES=0 must be a whole number from 1 up"),
    (dict(NNODES="abc"), "NNODES=abc must be a whole number from 1 up"),
    (dict(NNODES="2", NODE_RANK="2"), "NODE_RANK=2 must be a whole number from 0 to 1"),
    (dict(NPROC_PER_NODE="-8"), "NPROC_PER_NODE=-8 must be a whole number from 1 up"),
    (dict(MASTER_PORT="99999"), "MASTER_PORT=99999 must be a whole number from 1 to 65535"),
    (dict(MAX_RESTARTS="many"), "MAX_RESTARTS=many must be a whole number from 0 up"),
    (dict(OMP_NUM_THREADS="0"), "OMP_NUM_THREADS=0 must be a whole number from 1 up"),
    (dict(RDZV_JOIN_TIMEOUT="0"), "RDZV_JOIN_TIMEOUT=0 must be a whole number from 1 up"),
    (dict(RDZV_CLOSE_TIMEOUT="30s"), "RDZV_CLOSE_TIMEOUT=30s must be a whole number from 1 up"),
    (dict(DEFAULT_NNODES="x"), "DEFAULT_NNODES=x must be a whole number from 1 up"),
    (dict(NNODES=""), "NNODES is set but empty"),
    (dict(MASTER_ADDR="node 0"), "MASTER_ADDR='node 0' must be node 0's host name or address"),
    (dict(PYTHON="/bin/false"), "PYTHON=/bin/false cannot import torch"),
])
@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "launch"])
def test_every_variable_is_checked_in_one_line_before_anything(fake_bin, variables, words, dry):
    env, log = fake_bin
    rc, out, err = finish(run([LAUNCH, "configs/llama3_8b.yaml", *(["--dry-run"] if dry else [])], env, **variables))
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    assert out == "" and not log.exists()


def test_a_dry_run_checks_the_data_and_fails_on_a_planner_crash(fake_bin, corpus, tmp_path):
    env, log = fake_bin
    rc, out, err = finish(run([LAUNCH, "configs/llama3_8b.yaml", "--dry-run", *data(corpus), "--data.paths",
                               "[does/not/exist]"], env))
    assert rc == 2 and "does/not/exist" in err and "node 0" not in out
    rc, out, err = finish(run([LAUNCH, "configs/llama3_8b.yaml", "--dry-run", *data(corpus),
                               "--data.tokenizer.type", "GPT2BPETokenizer"], env))
    assert rc == 2 and "GPT2BPETokenizer" in err  # the tokenizer the config names cannot be built here
    crashing = tmp_path / "crashing_python"  # a planner that fails with a traceback
    crashing.write_text("#!/bin/bash\n"
                        f'case "$1" in *tools/plan.py) exec {sys.executable} -c "raise RuntimeError(42)";; esac\n'
                        f'exec {sys.executable} "$@"\n')
    crashing.chmod(0o755)
    rc, out, err = finish(run([LAUNCH, "configs/llama3_8b.yaml", "--dry-run", *data(corpus)], env,
                              PYTHON=str(crashing)))
    assert rc == 1 and "RuntimeError: 42" in err and "the planner failed" in err and "node 0" not in out


def _wait_for_line(path, text, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in {path}")


def test_a_stop_signal_reaches_the_training_processes_and_slurm_requeues_the_job(fake_bin, tmp_path, corpus):
    env, log = fake_bin
    bin_dir = tmp_path / "bin"
    # srun starts the per-node launcher as SLURM would (SLURM_STEP_ID set); the "training process"
    # under the fake torchrun records the stop signal it gets and exits 0 (it saved)
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "srun $*" >> {log}\nshift 2\nSLURM_STEP_ID=0 exec "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "scontrol $*" >> {log}\n'
                                      '[ "$1 $2" != "show hostnames" ] || echo "$3"\n')
    (bin_dir / "python").write_text(
        "#!/bin/bash\n"
        'if [ "$1" = "-m" ] && [ "$2" = "megapretrain.launcher" ]; then\n'
        f'  bash -c \'trap "echo worker got USR1 >> {log}; exit 0" USR1; echo worker up >> {log}; '
        "while :; do sleep 0.1; done' &\n"
        "  wait $!; exit $?\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    slurm = dict(SLURM_JOB_ID="4242", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_NODELIST="gpu-a07",
                 SLURM_GPUS_ON_NODE="8")
    proc = run([LAUNCH, "configs/llama3_8b.yaml", "--train.rampup_batch_size", "null", *data(corpus)], env, **slurm)
    try:
        _wait_for_line(log, "worker up", timeout=300)  # after the config check (a python start: slow when busy)
    except AssertionError:
        proc.kill()
        raise AssertionError(proc.communicate()[1][-3000:]) from None
    proc.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@300` sends the batch script
    rc, _, err = finish(proc)
    lines = log.read_text().splitlines()
    assert rc == 0, err
    assert "worker got USR1" in lines and lines[-1] == "scontrol requeue 4242"
    assert "saves at its next step" in err and "requeueing job 4242" in err
