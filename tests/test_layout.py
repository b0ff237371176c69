"""The one Layout: built once from the config (its rules, its grid, its checkpoint form), and the
code that reads a layout — process groups, resharding, the planner, the OOM advice — reading it
alike."""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from megapretrain.config import ConfigError, load_config
from megapretrain.monitor.flops import DEVICES
from megapretrain.oom import remedies
from megapretrain.parallel.layout import Layout
from megapretrain.parallel.pipeline import SCHEDULES
from megapretrain.parallel.state import grid_groups
from megapretrain.planner import GIB, estimate_run
from megapretrain.resolve import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def _gpus(path: str) -> int:
    with open(path) as fh:
        found = re.search(r"(\d+) GPUs", fh.readline())
    return int(found.group(1)) if found else 1


def _config(path: str, *overrides: str):
    cfg = load_config(path, list(overrides))
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = 257
    return cfg


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 1, 2), (3, 2, 2, 4), (4, 1, 2, 1), (1, 8, 1, 8)])
def test_coords_invert_the_grid(shape):
    pp, dp, cp, tp = shape
    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp)
    grid = layout.grid()
    assert grid.shape == (pp, dp, cp, tp) and layout.world_size == grid.size
    for rank, coords in enumerate(layout.all_coords()):
        assert grid[coords] == rank
        assert coords == layout.coords(rank)
    # the process groups' rank lists are the grid's rows: every tp group is tp consecutive ranks
    for ranks in grid_groups(grid)["tp"]:
        assert list(ranks) == list(range(ranks[0], ranks[0] + tp))
    with pytest.raises(ValueError):
        layout.coords(layout.world_size)


def test_meta_round_trip_and_checkpoints_saved_before_cp():
    layout = Layout(tp=2, pp=4, dp=8, cp=2, vpp=2, zero=3)
    meta = layout.meta(v_shape=False)
    assert meta == {"tp": 2, "pp": 4, "dp": 8, "cp": 2, "vpp": 2}  # vpp: which layers each stage holds
    zbv = Layout(tp=2, pp=4, dp=8, cp=2, vpp=2, pp_schedule="zbv")
    assert zbv.meta(v_shape=SCHEDULES["zbv"].v_shape)["placement"] == "v"
    back = Layout.from_meta(json.loads(json.dumps(meta)))
    assert back.all_coords() == layout.all_coords()
    old = Layout.from_meta({"tp": 2, "pp": 1, "dp": 2})
    assert old.cp == 1 and old.world_size == 4


def test_from_config_reads_every_field_and_checks_its_rules():
    cfg = _config(os.path.join(ROOT, "configs", "tiny.yaml"), "--parallel.tp", "2", "--parallel.pp", "2",
                  "--parallel.sequence_parallel", "true", "--parallel.zero", "1", "--parallel.zero_shard_size", "2",
                  "--train.micro_batch_size", "2", "--parallel.recompute", "selective")
    layout = Layout.from_config(cfg, 16)
    assert (layout.tp, layout.pp, layout.dp, layout.cp, layout.shard) == (2, 2, 4, 1, 2)
    assert layout.sequence_parallel and layout.micro_batch == 2 and layout.recompute == "selective"
    assert layout.shard_ranks == 2
    full = Layout.from_config(_config(os.path.join(ROOT, "configs", "tiny.yaml"), "--parallel.zero", "1",
                                      "--parallel.zero_shard_size", "4"), 4)
    assert full.shard is None and full.shard_ranks == 4  # sharding over all of dp × cp is plain ZeRO
    for overrides, world, message in [
            (("--parallel.tp", "3"), 4, r"parallel.tp=3 × parallel.pp=1 = 3 must divide the world size 4"),
            (("--parallel.zero_shard_size", "2"), 4, r"needs parallel.zero 1, 2 or 3"),
            (("--parallel.zero", "1", "--parallel.zero_shard_size", "3"), 4, r"must divide dp × cp = 4"),
            (("--parallel.pp", "3"), 3, r"must divide model.num_layers"),
            (("--parallel.cp", "2", "--train.seq_length", "30"), 2, r"multiple of 2 × parallel.cp = 4")]:
        with pytest.raises(ConfigError, match=re.escape(message) if "×" in message else message):
            Layout.from_config(_config(os.path.join(ROOT, "configs", "tiny.yaml"), *overrides), world)


def test_resolve_hands_one_layout_to_the_sizes():
    cfg = _config(os.path.join(ROOT, "configs", "tiny.yaml"), "--parallel.tp", "2", "--parallel.pp", "2")
    run = resolve(cfg, 8)
    assert run.sizes.layout is run.layout
    assert (run.sizes.tp, run.sizes.pp, run.sizes.dp, run.sizes.world_size) == (2, 2, 2, 8)
    assert run.sizes.schedule.name == "1f1b" and run.model.num_layers == cfg.model.num_layers


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p)[:-5])
def test_the_oom_advice_quotes_what_the_planner_says_of_each_change(path):
    """Every remedy's figure is the planner's estimate of the config with that change applied,
    through the same resolve() as `tools/plan.py --check`: the two never disagree on a layout."""
    cfg, gpus = _config(path), _gpus(path)
    layout = resolve(cfg, gpus).layout
    advice = remedies(cfg, layout, torch.device("cpu"))
    checked = 0
    for line in advice:
        flags, _, quoted = line.partition(" (planner: ")
        if not quoted:
            continue
        changed = _config(path, *flags.split())
        want = estimate_run(changed, resolve(changed, gpus).layout, DEVICES["h100"])
        assert quoted.startswith(f"{want.memory['total'] / GIB:.1f} GB"), (line, want.memory["total"] / GIB)
        checked += 1
    assert checked or gpus == 1


def test_the_oom_advice_keeps_the_configs_sequence_parallelism():
    """llama3_8b at tp 2 without sequence parallelism: the advice's layouts keep sp off, as the
    run has it (it once assumed sp on and quoted 21.6 GB where the layout needs 22.7)."""
    path = os.path.join(ROOT, "configs", "llama3_8b.yaml")
    off = _config(path, "--parallel.tp", "2", "--parallel.sequence_parallel", "false")
    on = _config(path, "--parallel.tp", "2", "--parallel.sequence_parallel", "true")
    gpus = _gpus(path)
    advice_off = remedies(off, resolve(off, gpus).layout, torch.device("cpu"))
    advice_on = remedies(on, resolve(on, gpus).layout, torch.device("cpu"))
    assert advice_off[0].startswith("--parallel.recompute full") and advice_off != advice_on
    changed = _config(path, "--parallel.tp", "2", "--parallel.sequence_parallel", "false",
                      "--parallel.recompute", "full")
    plan = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), "--config", path, "--gpus",
                           str(gpus), "--check", "--json", "--parallel.tp", "2", "--parallel.sequence_parallel",
                           "false", "--parallel.recompute", "full"], capture_output=True, text=True, check=True)
    total = json.loads(plan.stdout)["memory_gb"]["total"]
    assert f"(planner: {total:.1f} GB" in advice_off[0], (advice_off[0], total)
    assert not resolve(changed, gpus).layout.sequence_parallel


def test_the_grid_is_the_one_the_checkpoint_readers_use():
    """Resharding reads a saved checkpoint's ranks through Layout.from_meta: the same coordinates
    ParallelState gives each rank."""
    for tp, pp, dp, cp in itertools.product((1, 2), (1, 3), (1, 2), (1, 2)):
        layout = Layout.from_meta({"tp": tp, "pp": pp, "dp": dp, "cp": cp})
        grid = np.arange(tp * pp * dp * cp).reshape(pp, dp, cp, tp)
        for rank, (p, d, c, t) in enumerate(layout.all_coords()):
            assert grid[p, d, c, t] == rank


def test_the_oom_advice_says_what_optimizer_offload_saves():
    """The offload remedy quotes the planner's memory with optim.offload and the device memory it
    saves: the optimizer state the planner counts on the GPU without it."""
    path = os.path.join(ROOT, "configs", "llama3_8b.yaml")
    cfg, gpus = _config(path), _gpus(path)
    layout = resolve(cfg, gpus).layout
    line, = [r for r in remedies(cfg, layout, torch.device("cpu")) if r.startswith("--optim.offload")]
    before = estimate_run(cfg, layout, DEVICES["h100"]).memory
    after = estimate_run(_config(path, "--optim.offload", "true"), layout, DEVICES["h100"]).memory
    saved = before["total"] - after["total"]
    assert saved == pytest.approx(before["parts"]["optimizer"]) and saved > GIB / 10
    assert f"(planner: {after['total'] / GIB:.1f} GB per GPU on H100 SXM 80GB, {saved / GIB:.1f} GB less" in line
    # Muon's state goes to the host as AdamW's does: its remedy quotes Muon's own figures
    muon = _config(path, "--optim.optimizer", "muon")
    line, = [r for r in remedies(muon, layout, torch.device("cpu")) if r.startswith("--optim.offload")]
    before = estimate_run(muon, layout, DEVICES["h100"]).memory
    after = estimate_run(_config(path, "--optim.optimizer", "muon", "--optim.offload", "true"), layout,
                         DEVICES["h100"]).memory
    assert after["host_optimizer"] == pytest.approx(before["parts"]["optimizer"])
    assert f"{(before['total'] - after['total']) / GIB:.1f} GB less" in line
