"""tools/smoke_test.py: every layout of the job against a one-process reference, in one command."""

from __future__ import annotations

import json
import os

import pytest

from megapretrain.commands import smoke_test as smoke

from distributed import run_distributed


def test_auto_layouts_cover_every_split_of_the_world():
    names = [smoke.layout_name(layout, 8) for layout in smoke.parse_layouts("auto", 8)]
    assert names == ["tp1 pp1 dp8 zero1", "tp1 pp1 cp2 dp4 zero1", "tp1 pp2 vpp2 dp4 zero1",
                     "tp1 pp2 vpp2 cp2 dp2 zero1", "tp1 pp4 vpp2 dp2 zero1", "tp1 pp4 vpp2 cp2 dp1 zero1",
                     "tp1 pp8 dp1", "tp2 pp1 dp4 sp zero1", "tp2 pp1 cp2 dp2 sp zero1", "tp2 pp2 vpp2 dp2 sp zero1",
                     "tp2 pp2 vpp2 cp2 dp1 sp zero1", "tp2 pp4 vpp2 dp1 sp", "tp4 pp1 dp2 sp zero1",
                     "tp4 pp1 cp2 dp1 sp zero1", "tp4 pp2 vpp2 dp1 sp", "tp8 pp1 dp1 sp"]
    assert smoke.parse_layouts("auto", 1) == []
    assert smoke.parse_layouts("tp=2, pp=2,zero=1; tp=4; cp=2", 8) == [
        {"tp": 2, "pp": 2, "vpp": 1, "cp": 1, "sp": 0, "zero": 1},
        {"tp": 4, "pp": 1, "vpp": 1, "cp": 1, "sp": 0, "zero": 0},
        {"tp": 1, "pp": 1, "vpp": 1, "cp": 2, "sp": 0, "zero": 0}]
    with pytest.raises(SystemExit, match="'ep=2' must be one of tp/pp/vpp/cp/sp/zero"):
        smoke.parse_layouts("tp=2,ep=2", 8)


def _smoke(rank, world, workdir):
    return smoke.main(["--workdir", workdir, "--steps", "3", "--layouts", "auto; tp=2,pp=2"])


@pytest.mark.slow
def test_two_ranks_match_the_reference_and_an_impossible_layout_is_skipped(tmp_path):
    workdir = str(tmp_path / "smoke")
    assert run_distributed(_smoke, 2, workdir, timeout=300) == [0, 0]
    report = json.load(open(os.path.join(workdir, "smoke_test.json")))
    rows = {r[0]: r for r in report["rows"]}
    assert [rows[n][1] for n in ("tp1 pp1 dp2 zero1", "tp1 pp1 cp2 dp1 zero1", "tp1 pp2 vpp2 dp1",
                                 "tp2 pp1 dp1 sp")] == ["ok"] * 4
    assert rows["tp2 pp2 dp?"][1] == "skipped" and "must divide the world size 2" in rows["tp2 pp2 dp?"][4]
    assert len(report["reference"]) == 3 and report["reference"][-1] < report["reference"][0]
    assert run_distributed(_smoke, 2, workdir, timeout=300) == [2, 2]  # never into a used directory
