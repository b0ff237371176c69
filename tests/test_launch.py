"""run_scripts/: every script parses; every pretrain script's --dry-run validates its config at the
world size it would launch, prints the plan and each node's torchrun command, and launches nothing;
the SLURM and the by-hand (NNODES / NODE_RANK / MASTER_ADDR) paths build the right command."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

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
        f'if [ "$1" = "-m" ] && [ "$2" = "torch.distributed.run" ]; then echo "torchrun $*" >> {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(CLEAN, PATH=f"{bin_dir}:/usr/bin:/bin", PYTHON=str(bin_dir / "python"))
    return env, log


def run(argv, env, **extra):
    return subprocess.Popen(["bash", *argv], env=dict(env, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)


def finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def test_every_script_parses():
    assert PRETRAIN and all(subprocess.run(["bash", "-n", s]).returncode == 0 for s in SCRIPTS)


def test_every_pretrain_script_dry_runs_at_its_size(fake_bin):
    env, log = fake_bin
    procs = {s: run([s, "--dry-run"], env) for s in PRETRAIN}  # in parallel: each plans its config
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
        assert f"--nnodes {nodes} --node_rank {nodes - 1} --nproc_per_node 8" in last
        assert f"-m megapretrain.train --config {ROOT}/configs/{name}.yaml" in last
    assert not log.exists()


def test_a_dry_run_under_slurm_reads_its_nodes(fake_bin):
    env, log = fake_bin
    # no scontrol on this PATH: the launcher expands the node list itself (ranges, zero padding, lists)
    slurm = dict(SLURM_JOB_ID="4242", SLURM_NNODES="3", SLURM_NODEID="1", SLURM_JOB_NODELIST="gpu-a[07-08],login1",
                 SLURM_GPUS_ON_NODE="8")
    script = os.path.join(ROOT, "run_scripts", "pretrain_llama3_8b.sh")
    # 24 GPUs: dp 24, which the config's batch ramp-up (multiples of dp 64) does not fit: turned off
    rc, out, err = finish(run([script, "--dry-run", "--train.rampup_batch_size", "null", "--train.eval_iters", "5"],
                              env, **slurm))
    assert rc == 0, err
    assert "on 3 node(s) × 8 processes = 24" in out
    assert re.findall(r"^node \d+ \((\S+)\)", out, re.M) == ["gpu-a07", "gpu-a08", "login1"]
    assert out.count("--master_addr gpu-a07 ") == 3 and "--nnodes 3 --node_rank 2 " in out
    assert out.rstrip().endswith("--train.eval_iters 5")
    assert not log.exists()
    # without --dry-run the batch script starts one launcher per node through srun (here: recorded)
    rc, _, err = finish(run([script, "--train.rampup_batch_size", "null"], env, **slurm))
    assert rc == 0, err
    assert log.read_text().startswith(f"srun --ntasks-per-node 1 bash {LAUNCH} {ROOT}/configs/llama3_8b.yaml")
    # and inside that step (SLURM_STEP_ID set), each node runs torchrun with its rank
    log.unlink()
    rc, _, err = finish(run([LAUNCH, "configs/llama3_8b.yaml", "--train.rampup_batch_size", "null"], env,
                            SLURM_STEP_ID="0", **slurm))
    assert rc == 0, err
    assert "--nnodes 3 --node_rank 1 --nproc_per_node 8 --master_addr gpu-a07" in log.read_text()


def test_by_hand_with_nnodes_node_rank_and_master_addr(fake_bin):
    env, log = fake_bin
    hand = dict(NNODES="8", NODE_RANK="3", MASTER_ADDR="10.1.2.3", MASTER_PORT="29600")
    rc, out, err = finish(run([os.path.join(ROOT, "run_scripts", "pretrain_llama3_8b.sh"), "--dry-run"], env,
                              **hand))
    assert rc == 0, err
    assert "on 8 node(s) × 8 processes = 64" in out and out.count("--master_addr 10.1.2.3 --master_port 29600") == 8
    assert not log.exists()
    rc, _, err = finish(run([os.path.join(ROOT, "run_scripts", "pretrain_llama3_8b.sh")], env, NPROC_PER_NODE="8",
                            **hand))
    assert rc == 0, err
    launched = log.read_text()
    assert "--nnodes 8 --node_rank 3 --nproc_per_node 8 --master_addr 10.1.2.3 --master_port 29600" in launched


def test_a_dry_run_refuses_a_world_size_the_config_cannot_use(fake_bin):
    env, log = fake_bin
    rc, out, err = finish(run([LAUNCH, "configs/llama3_70b.yaml", "--dry-run"], env, NNODES="1",
                              NPROC_PER_NODE="7"))
    assert rc == 2 and "must divide the world size 7" in err and "node 0" not in out
    assert not log.exists()
