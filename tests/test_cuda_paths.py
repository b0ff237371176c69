"""What a CUDA run decides at start-up, checked on CPU where the logic allows: the process's GPU,
the gloo-only reduce-scatter fallback, TF32 and determinism, the pinned memory of async saves."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megapretrain import runtime
from megapretrain.errors import ConfigError
from megapretrain.monitor.flops import DEVICES, peak_for
from megapretrain.parallel import state
from megapretrain.parallel.state import Group, _CopyAfter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_single_cuda_process_binds_the_gpu_its_local_rank_names(monkeypatch):
    """LOCAL_RANK=1 without a process group (WORLD_SIZE 1): the model goes to cuda:1, and so must
    the current device, before anything touches CUDA."""
    from megapretrain.train import setup

    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append(torch.device(d)))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="data.paths is empty"):  # stops before any work, after binding
        setup(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--train.device", "cuda",
               "--model.vocab_size", "257", "--data.paths", "[]"])
    assert bound == [torch.device("cuda", 1)]


def test_bind_device_leaves_the_cpu_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device on a CPU run"))
    runtime.bind_device(torch.device("cpu"))


class _Work:
    def wait(self):
        pass


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_the_reduce_scatter_fallback_is_for_gloo_only(monkeypatch, backend):
    """A backend without a flat reduce-scatter (older gloo) gets an all-reduce instead; on any
    other backend the error is real and must surface on every rank alike, never a silent switch
    that leaves the other ranks waiting in a different collective."""
    def refuse(*args, **kwargs):
        raise RuntimeError("no reduce_scatter here")

    monkeypatch.setattr(state, "_reduce_scatter_single", refuse)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None, async_op=False, **kw: _Work())
    group = Group("dp", [0, 1], pg=object(), rank_in_group=1)
    flat, out = torch.arange(4.0), torch.empty(2)
    if backend == "nccl":
        with pytest.raises(RuntimeError, match="no reduce_scatter"):
            group.reduce_scatter_async(out, flat)
        assert group._native_reduce_scatter is None
    else:
        work = group.reduce_scatter_async(out, flat)
        assert isinstance(work, _CopyAfter) and group._native_reduce_scatter is False
        work.wait()
        assert out.tolist() == [2.0, 3.0]  # this rank's half of the (stand-in) sum


@pytest.fixture
def restore_numerics():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[0], saved[1]
    torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[4], saved[5]
    if saved[6] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[6]


def test_tf32_follows_the_config_and_the_plan_says_so(restore_numerics):
    cuda = torch.device("cuda", 0)
    assert runtime.set_numerics(True, False, "fp32", cuda) == "matmul=tf32"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert runtime.set_numerics(False, False, "fp32", cuda).startswith("matmul=fp32")
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert runtime.set_numerics(True, False, "bf16", cuda) == ""  # bf16 matmuls: nothing to say
    assert runtime.set_numerics(True, False, "fp32", torch.device("cpu")) == ""


def test_the_mfu_peak_follows_tf32():
    h100 = DEVICES["h100"]
    assert peak_for(h100, "bf16") == 989.0
    assert peak_for(h100, "fp32", tf32=True) == 989.0 / 2
    assert peak_for(h100, "fp32", tf32=False) == 67.0
    assert all(d.fp32_tflops > 0 for d in DEVICES.values())


def test_deterministic_switches_the_algorithms_and_fixes_the_cublas_workspace(restore_numerics, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    words = runtime.set_numerics(True, True, "fp32", torch.device("cpu"))
    assert words == "deterministic=on"
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == runtime.CUBLAS_WORKSPACE
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own setting stays
    runtime.set_numerics(True, True, "fp32", torch.device("cuda", 0))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_async_saves_without_zero_warn_with_the_pinned_bytes():
    cuda = torch.device("cuda", 0)
    warning = runtime.pinned_host_warning(cuda, True, 0, 8_000_000_000)
    assert warning is not None and "89.4 GiB" in warning and "parallel.zero 1" in warning
    assert runtime.pinned_host_warning(cuda, True, 1, 8_000_000_000) is None
    assert runtime.pinned_host_warning(cuda, False, 0, 8_000_000_000) is None
    assert runtime.pinned_host_warning(torch.device("cpu"), True, 0, 8_000_000_000) is None


def test_the_launcher_guards_against_fragmentation():
    with open(os.path.join(ROOT, "run_scripts", "launch.sh")) as fh:
        text = fh.read()
    assert 'PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"' in text
