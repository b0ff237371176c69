"""CPU training keeps freed host memory for the next step (megapretrain/host_memory.py): a large
tensor allocated again after a free costs no fresh page faults, and a user's own malloc tuning is
left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megapretrain.host_memory import user_tuned_malloc

PROBE = """
import json, resource, sys
import torch
from megapretrain.host_memory import keep_freed_host_memory
applied = keep_freed_host_memory() if sys.argv[1] == "keep" else False
def step():  # a training step's pattern: large blocks (above any mmap threshold) made and freed
    a = torch.ones(64 << 20, dtype=torch.uint8)
    b = torch.ones(96 << 20, dtype=torch.uint8)
    del a
    c = torch.ones(40 << 20, dtype=torch.uint8)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _probe(mode: str, **env) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                          env={**environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_large_tensors_are_reused_without_page_faults():
    default, kept = _probe("default"), _probe("keep")
    pages = 10 * (200 << 20) // 4096  # what ten steps of fresh blocks fault in
    assert default["faults"] > pages // 2, default  # glibc's default: each block mapped afresh
    assert kept["applied"] and kept["faults"] < default["faults"] // 4, (kept, default)


def test_a_users_malloc_tuning_is_left_alone():
    assert user_tuned_malloc({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1000000"})
    assert user_tuned_malloc({"MALLOC_MMAP_THRESHOLD_": "1000000"})
    assert not user_tuned_malloc({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2", "PATH": "/bin"})
    got = _probe("keep", MALLOC_TRIM_THRESHOLD_="1000000")
    assert got["applied"] is False
