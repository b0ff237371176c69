"""Benchmark checkpointing on this machine: the training loop's stall during an async save against
a synchronous save, the load time, and the time and peak host memory of ``to-hf`` / ``from-hf``.

    python tools/bench_checkpoint.py [--hidden 768 --layers 8 --vocab 32000] [--dir /tmp/bench] [--json]

Builds a model of a few hundred MB, its optimizer (one step taken) and checkpoint manager as the
trainer does (one process, fp32), then times a save as ``RunState.save`` makes it — synchronously,
and asynchronously, followed by what the training loop does next (one forward and backward, then
``wait_snapshot`` before the optimizer step): the stall is what the loop waits for in ``save``
plus in ``wait_snapshot``; the publication is timed until ``latest`` moves — the load of the
checkpoint into the optimizer, and both conversions in fresh processes (peak RSS above their
imports, from /proc/self/status). The target: the async stall
under 10% of the synchronous save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import _tool  # noqa: F401  (the package installed, or one line saying how)

from megapretrain.cli import ToolParser, positive_int, user_errors

MEASURE = """
import json, sys, time
from megapretrain.commands import convert_checkpoint as tool
def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))
open("/proc/self/clear_refs", "w").write("5")
before, start = status("VmRSS"), time.perf_counter()
rc = tool.main(sys.argv[1:])
seconds, extra = time.perf_counter() - start, (status("VmHWM") - before) / 1024
print(json.dumps({"rc": rc, "seconds": seconds, "peak_extra_mib": extra}))
"""


def parse_args(argv):
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=positive_int, default=768)
    ap.add_argument("--layers", type=positive_int, default=8)
    ap.add_argument("--vocab", type=positive_int, default=32000)
    ap.add_argument("--heads", type=positive_int, default=12)
    ap.add_argument("--repeats", type=positive_int, default=3, help="saves of each kind (the median is reported)")
    ap.add_argument("--dir", help="where to write (default: a temporary directory, removed after)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap.parse_args(argv)


def _build(args, run: str):
    """The model chunk, optimizer and checkpoint manager of a one-process fp32 run, built as the
    trainer builds them (``build_model_chunks``, ``MixedPrecisionAdamW``, ``CheckpointManager``)."""
    import torch

    from megapretrain.checkpoint.manager import CheckpointManager
    from megapretrain.checkpoint.reshard import global_shapes
    from megapretrain.config import load_config
    from megapretrain.model.build import build_model_chunks
    from megapretrain.optim.optimizer import MixedPrecisionAdamW
    from megapretrain.parallel.state import ParallelState
    from megapretrain.resolve import resolve

    cfg = load_config(None, ["--run.dir", run, "--model.vocab_size", str(args.vocab), "--model.hidden_size",
                             str(args.hidden), "--model.num_layers", str(args.layers), "--model.num_heads",
                             str(args.heads), "--checkpoint.keep_last", "0"])
    sizes = resolve(cfg, 1).sizes
    ps = ParallelState(device=torch.device("cpu"))
    (model,), specs = build_model_chunks(cfg, ps)
    opt = MixedPrecisionAdamW(list(model.named_parameters()), specs, cfg.optim, cfg.train.precision, ps)
    for grads in opt.buffers.grad_buffers:  # one step on random grads: the Adam moments hold values
        grads.normal_()
    opt.step(1e-4)
    manager = CheckpointManager(run, rank=0, world_size=1, layout={"tp": 1, "pp": 1, "dp": 1},
                                vocab_size=args.vocab, padded_vocab=sizes.padded_vocab, keep_last=0,
                                tensors=global_shapes(cfg))
    return cfg, model, opt, manager


def _state(model, opt, iteration: int) -> dict:
    """What ``RunState.save`` hands the manager (the same calls)."""
    import torch

    from megapretrain.checkpoint.format import rank_state
    from megapretrain.checkpoint.manager import optimizer_views

    weights, moments = optimizer_views(opt)
    rng = {"cpu": torch.get_rng_state(), "tracker": model.rng.get_states(), "cuda": None}
    return rank_state(iteration=iteration, consumed_samples=iteration, model=weights, optimizer_step=opt.step_count,
                      moments=moments, scaler=opt.scaler.state_dict(), rng=rng)


def _forward_backward(model, args) -> None:
    """One micro-batch's forward and backward (4 × 256 tokens), as the step after a save runs."""
    import torch

    tokens = torch.randint(0, args.vocab, (4, 257))
    model(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    for p in model.parameters():
        p.grad = None


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def _convert(*argv) -> dict:
    proc = subprocess.run([sys.executable, "-c", MEASURE, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"conversion failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench(args, work: str) -> dict:
    import yaml

    from megapretrain.checkpoint.format import read_rank_state
    from megapretrain.checkpoint.manager import restore_optimizer
    from megapretrain.config import to_dict

    run = os.path.join(work, "run")
    cfg, model, opt, manager = _build(args, run)
    with open(os.path.join(run, "config.yaml"), "w") as fh:  # for to-hf
        yaml.safe_dump(to_dict(cfg), fh, sort_keys=False)
    nbytes = sum(p.numel() for p in model.parameters()) * 4
    sync, stall, published = [], [], []
    for i in range(args.repeats):
        manager.async_save = False
        start = time.perf_counter()
        manager.save(10 + i, _state(model, opt, 10 + i))
        sync.append(time.perf_counter() - start)
        manager.async_save = True
        start = time.perf_counter()
        manager.save(100 + i, _state(model, opt, 100 + i))
        blocked = time.perf_counter() - start
        _forward_backward(model, args)  # the next step, while the writer copies and writes
        blocked += manager.wait_snapshot()  # before the optimizer step may change the state
        stall.append(blocked)  # what the training loop waits for
        latest = os.path.join(manager.root, "latest")
        while open(latest).read().strip() != f"iter_{100 + i:07d}":
            time.sleep(0.001)
        published.append(time.perf_counter() - start)
        manager.finalize()
    path = os.path.join(manager.root, f"iter_{100 + args.repeats - 1:07d}")
    on_disk = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    start = time.perf_counter()
    state = read_rank_state(path, 0)
    restore_optimizer(opt, state, where=path)
    load = time.perf_counter() - start
    hf_dir, back = os.path.join(work, "hf"), os.path.join(work, "back")
    to_hf = _convert("to-hf", "--checkpoint", path, "--output", hf_dir, "--dtype", "bf16")
    from_hf = _convert("from-hf", "--hf", hf_dir, "--output", back, "--parallel.tp", "2", "--world-size", "2")
    return {"model_mib": nbytes / 2**20, "checkpoint_mib": on_disk / 2**20,
            "sync_save_s": _median(sync), "async_stall_s": _median(stall), "async_published_s": _median(published),
            "stall_fraction": _median(stall) / _median(sync), "load_s": load,
            "to_hf_s": to_hf["seconds"], "to_hf_peak_extra_mib": to_hf["peak_extra_mib"],
            "from_hf_s": from_hf["seconds"], "from_hf_peak_extra_mib": from_hf["peak_extra_mib"]}


@user_errors
def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    work = args.dir or tempfile.mkdtemp(prefix="bench_checkpoint-")
    os.makedirs(work, exist_ok=True)
    try:
        r = bench(args, work)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"model {r['model_mib']:,.0f} MiB fp32, checkpoint {r['checkpoint_mib']:,.0f} MiB on disk")
    print(f"sync save {r['sync_save_s']:.3f} s | async stall {r['async_stall_s']:.3f} s "
          f"({100 * r['stall_fraction']:.1f}% of sync; target < 10%), published after {r['async_published_s']:.3f} s")
    print(f"load {r['load_s']:.3f} s")
    print(f"to-hf (bf16) {r['to_hf_s']:.2f} s, peak +{r['to_hf_peak_extra_mib']:,.0f} MiB | from-hf (tp=2) "
          f"{r['from_hf_s']:.2f} s, peak +{r['from_hf_peak_extra_mib']:,.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
