"""The checkpoint tools at the size they are for: ``--verify`` holds one part of each model at a
time (checked under an address-space cap a whole-model copy exceeds), an up-front refusal when even
that cannot fit, a reshard that writes what the checkpoint has (no invented Adam moments) with its
config beside it, and to-hf that takes only the config of the checkpoint's own run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from megapretrain.checkpoint import tensorfile
from megapretrain.checkpoint.format import MOMENTS, RankFile, read_metadata
from megapretrain.commands import convert_checkpoint as convert
from megapretrain.commands import reshard_checkpoint

from helpers import write_hf_llama

pytest.importorskip("transformers")


CAPPED = """
import resource, sys
from megapretrain.commands import convert_checkpoint
import megapretrain.checkpoint.hf, megapretrain.model.decoder  # noqa: F401
import transformers
from transformers.models.llama import modeling_llama  # noqa: F401 (imported before the cap)
def status(key):  # kB, from /proc/self/status
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))
before = status("VmSize")
cap = before * 1024 + int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
rc = convert_checkpoint.main(sys.argv[2:])
print(f"address space peak: {(status('VmPeak') - before) / 1024:.0f} MiB above the imports")
sys.exit(rc)
"""


@pytest.mark.slow
@pytest.mark.ci  # ~25 s of CPU, a minute or two of wall time on a busy 2-core machine (0.9 GB written)
def test_verify_round_trip_of_a_large_shape_holds_one_part_at_a_time(tmp_path, capsys):
    """hidden 2048, ffn 4096, 3 layers (0.12B parameters, 440 MiB in fp32) from HF, then back with
    to-hf --verify (bf16) under an address-space cap of 520 MiB above the imports. The conversion
    alone reaches ~250 MiB (its allocator's and lazy imports' share); a whole fp32 model on top of
    it does not fit, one decoder layer (136 MiB) and its reads do (~410 MiB)."""
    hf_dir, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    shapes = write_hf_llama(hf_dir, hidden=2048, ffn=4096, layers=3, vocab=2048, heads=16, kv=4)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    budget = 520 * 2**20
    assert 250 * 2**20 + 4 * params > 1.3 * budget  # a whole-model fp32 copy does not fit
    assert convert.main(["from-hf", "--hf", hf_dir, "--output", ckpt]) == 0
    proc = subprocess.run([sys.executable, "-c", CAPPED, str(budget), "to-hf", "--checkpoint", ckpt, "--output",
                           back, "--dtype", "bf16", "--verify"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-1000:] + proc.stderr[-3000:]
    assert "--verify: max logit difference" in proc.stdout, proc.stdout
    # bf16 in, bf16 out: the round trip is bitwise
    original = tensorfile.TensorFile(os.path.join(hf_dir, "model.safetensors"))
    again = tensorfile.TensorFile(os.path.join(back, "model.safetensors"))
    assert sorted(original.keys()) == sorted(again.keys())
    assert all(torch.equal(original.get(k), again.get(k)) for k in original.keys())


def test_verify_compares_what_transformers_computes(tmp_path, capsys):
    """The check is a real comparison: a layer's weight changed in the exported files after the
    conversion (our side keeps the right one) fails it, naming the difference."""
    from megapretrain.checkpoint.hf import hf_logits_by_layer, our_logits_by_layer, verify_tokens
    from megapretrain.checkpoint.reshard import GlobalWeights, saved_config_path
    from megapretrain.config import load_config

    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    write_hf_llama(hf_dir, hidden=64, ffn=128, layers=2, vocab=96, heads=4, kv=2, dtype=torch.float32)
    assert convert.main(["from-hf", "--hf", hf_dir, "--output", ckpt]) == 0
    cfg = load_config(saved_config_path(ckpt), [])
    weights = GlobalWeights(ckpt, cfg)
    tokens = verify_tokens(cfg)
    ours = our_logits_by_layer(cfg, weights.get, tokens)
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(tokens).logits
    torch.testing.assert_close(hf_logits_by_layer(hf_dir, tokens), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
    # a changed layer in the HF files: the by-layer HF logits move with it
    path = os.path.join(hf_dir, "model.safetensors")
    stored = tensorfile.TensorFile(path)
    tensors = {k: stored.get(k) for k in stored.keys()}
    stored.close()
    tensors["model.layers.1.mlp.down_proj.weight"] *= 1.5
    tensorfile.write(path, [(k, v.dtype, tuple(v.shape), lambda v=v: v) for k, v in tensors.items()],
                     {"format": "pt"})
    assert (hf_logits_by_layer(hf_dir, tokens) - ours).abs().max() > 1e-3
    weights.close()


def test_verify_that_cannot_fit_is_refused_before_writing(tmp_path, capsys, monkeypatch):
    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / "out")
    write_hf_llama(hf_dir, hidden=64, ffn=128, layers=2, vocab=96, heads=4, kv=2)
    monkeypatch.setattr("megapretrain.checkpoint.hf.available_bytes", lambda: 64 * 2**20)
    assert convert.main(["from-hf", "--hf", hf_dir, "--output", out, "--verify"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--verify needs about" in err and "64.0 MiB is available" in err
    assert "without --verify" in err and not os.path.exists(out)
    # without --verify it converts; to-hf --verify is refused the same way, before writing
    assert convert.main(["from-hf", "--hf", hf_dir, "--output", out]) == 0
    back = str(tmp_path / "back")
    assert convert.main(["to-hf", "--checkpoint", out, "--output", back, "--verify"]) == 2
    assert "--verify needs about" in capsys.readouterr().err and not os.path.exists(back)


def _distinct_bytes(directory: str) -> int:
    """Bytes of the distinct rank files in ``directory`` (hard links counted once)."""
    seen, total = set(), 0
    for name in os.listdir(directory):
        st = os.stat(os.path.join(directory, name))
        if name.endswith(".safetensors") and st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_size
    return total


def test_reshard_of_a_weights_only_checkpoint_writes_weights_only_with_its_config(tmp_path, capsys, monkeypatch):
    """A from-hf checkpoint has no Adam moments: the reshard writes none (no all-zero ones), its
    space check counts exactly the bytes written, config.yaml is beside the output, and to-hf takes
    it with no --config."""
    hf_dir, ckpt, out, back = (str(tmp_path / n) for n in ("hf", "ckpt", "out", "back"))
    write_hf_llama(hf_dir, hidden=64, ffn=128, layers=2, vocab=96, heads=4, kv=2, dtype=torch.float32)
    assert convert.main(["from-hf", "--hf", hf_dir, "--output", ckpt]) == 0
    assert os.path.exists(os.path.join(ckpt, "config.yaml"))
    checked = []
    import megapretrain.commands.reshard_checkpoint as module
    real = module.check_room
    monkeypatch.setattr(module, "check_room", lambda path, needed: (checked.append(needed), real(path, needed)))
    assert reshard_checkpoint.main(["--checkpoint", ckpt, "--output", out, "--world-size", "4",
                                    "--parallel.tp", "2", "--parallel.pp", "2"]) == 0
    assert "weights only" in capsys.readouterr().out
    assert os.path.exists(os.path.join(out, "config.yaml"))
    meta = read_metadata(out)
    assert meta["world_size"] == 4
    for rank in range(4):
        f = RankFile(out, rank, meta["format_version"])
        assert not any(key in e.values for e in f.entries["optimizer"].values() for key in MOMENTS)
        assert not any("exp_avg" in k for k in f._file.keys())
        f.close()
    assert checked == [_distinct_bytes(out)]
    # to-hf of the reshard's output: no --config needed, the weights come back bitwise
    assert convert.main(["to-hf", "--checkpoint", out, "--output", back, "--dtype", "fp32"]) == 0
    a = tensorfile.TensorFile(os.path.join(hf_dir, "model.safetensors"))
    b = tensorfile.TensorFile(os.path.join(back, "model.safetensors"))
    assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys())


def test_to_hf_never_takes_a_stray_config_from_further_up(tmp_path, capsys):
    """A checkpoint without config.yaml outside a run's checkpoints/ folder: to-hf asks for
    --config rather than taking a config.yaml two directories up."""
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    write_hf_llama(hf_dir, hidden=64, ffn=128, layers=2, vocab=96, heads=4, kv=2, dtype=torch.float32)
    assert convert.main(["from-hf", "--hf", hf_dir, "--output", ckpt]) == 0
    nested = tmp_path / "a" / "b" / "ckpt"
    shutil.copytree(ckpt, nested)
    os.remove(nested / "config.yaml")
    shutil.copyfile(os.path.join(ckpt, "config.yaml"), tmp_path / "a" / "config.yaml")  # the stray one
    capsys.readouterr()
    assert convert.main(["to-hf", "--checkpoint", str(nested), "--output", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "pass --config" in err and "not in a run's checkpoints/ folder" in err
    assert not os.path.exists(tmp_path / "x")
    assert convert.main(["to-hf", "--checkpoint", str(nested), "--output", str(tmp_path / "x"), "--config",
                         str(tmp_path / "a" / "config.yaml")]) == 0
