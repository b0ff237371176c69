"""The shipped model configs: their architecture against the published parameter count, their recipe
(optimizer, schedule, batch), and their layout at the GPU count their first line names."""

from __future__ import annotations

import glob
import os
import re
import shlex

import pytest

from megapretrain.config import load_config
from megapretrain.model.build import model_args, rank_param_specs
from megapretrain.model.decoder import num_parameters
from megapretrain.monitor.flops import DEVICES
from megapretrain.planner import Layout, estimate
from megapretrain.planner.emit import layout_line
from megapretrain.resolve import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Published parameter counts, with their sources
PUBLISHED = {
    # Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (GPT-3 Small, Medium, XL):
    # the same shapes as Llama decoders (SwiGLU, RoPE, tied GPT-2 vocabulary)
    "llama_125m": 125e6,
    "llama_350m": 350e6,
    "llama_1p3b": 1.3e9,
    # Meta, Llama 3.2 model card (2024): Llama 3.2 3B, 3.21B parameters
    "llama3_3b": 3.21e9,
    # Touvron et al. 2023, "Llama 2", Table 1 / the released checkpoints: 6.74B and 13.0B
    "llama2_7b": 6.74e9,
    "llama2_13b": 13.0e9,
    # Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3 / the released checkpoints: 8.03B, 70.6B, 405B
    "llama3_8b": 8.03e9,
    "llama3_70b": 70.6e9,
    "llama3_405b": 405e9,
    # Biderman et al. 2023, "Pythia", Table 1 / the released checkpoints (GPT-NeoX family), exactly
    "pythia_160m": 162_322_944,
    "pythia_1p4b": 1_414_647_808,
    # Team OLMo, "2 OLMo 2 Furious" (2025) / the allenai/OLMo-2-0425-1B release: 1.48B; OLMo 3 7B
    # (Team OLMo 2025, arXiv 2512.13961): 7.3B (exact counts against transformers:
    # tests/test_model_families.py)
    "olmo2_1b": 1.48e9,
    "olmo3_7b": 7.30e9,
}
CPU_CONFIGS = {"tiny", "bench_cpu"}  # for this machine, not a published model
NAMES = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def _config(name: str):
    return load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))


def gpus_of(name: str) -> int:
    """The GPU count the config's first line names (as tools/pipeline_schedule.py reads it)."""
    with open(os.path.join(ROOT, "configs", f"{name}.yaml")) as fh:
        return int(re.search(r"(\d+) GPUs", fh.readline()).group(1))


def test_every_model_config_has_a_published_count():
    assert set(NAMES) - CPU_CONFIGS == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_model_built_on_meta_has_the_published_parameter_count(name):
    cfg = _config(name)
    for key in ("tp", "pp", "vpp"):  # one rank holding the whole model
        setattr(cfg.parallel, key, 1)
    cfg.parallel.pipeline_layers = None
    specs = rank_param_specs(cfg, 0, 0)
    built = sum(s.numel for s in specs.values() if not s.duplicate)
    assert built == num_parameters(model_args(cfg))
    assert built == pytest.approx(PUBLISHED[name], rel=0.01), f"{name}: {built / 1e9:.3f}B"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_recipe(name):
    cfg = _config(name)
    o, s, t = cfg.optim, cfg.schedule, cfg.train
    assert o.min_lr == pytest.approx(0.1 * o.lr) and 1e-5 <= o.lr <= 1e-3
    decay = 0.01 if name.startswith("pythia") else 0.1  # Pythia's recipe (Biderman et al. 2023, Appendix E)
    assert (o.betas, o.weight_decay, o.clip_grad, s.decay, t.precision) == ([0.9, 0.95], decay, 1.0, "cosine", "bf16")
    tokens = t.global_batch_size * t.seq_length
    params = num_parameters(model_args(cfg))
    if name == "llama3_405b":  # Llama 3's final 16M-token batch (Dubey et al. 2024, Table 4)
        assert tokens == 2048 * 8192
    elif params > 1e9:  # 2-4M tokens as the Llama papers count them (M = 2^20)
        assert 2 * 2**20 <= tokens <= 4 * 2**20
    # the peak LR by size: GPT-3's 6e-4 to 2e-4 up to 1.3B, Llama's 3e-4 to 13B, 1.5e-4 for 70B, 8e-5 for 405B
    assert o.lr <= (6e-4 if params < 2e8 else 3e-4 if params < 2e10 else 1.5e-4 if params < 1e11 else 8e-5)
    warnings = resolve(cfg, gpus_of(name)).warnings
    assert not [w for w in warnings if "warmup" in w]  # warmup within 5% of the steps


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_layout_is_for_nodes_of_8_h100s_and_fits(name):
    cfg = _config(name)
    gpus = gpus_of(name)
    assert gpus % 8 == 0 and cfg.parallel.tp <= 8
    sizes = resolve(cfg, gpus).sizes
    p, t = cfg.parallel, cfg.train
    layout = Layout(p.tp, p.pp, sizes.dp, p.vpp, t.micro_batch_size, p.zero, p.recompute,
                    tuple(p.pipeline_layers) if p.pipeline_layers else None, p.sequence_parallel)
    e = estimate(model_args(cfg), t.seq_length, layout, t.global_batch_size, DEVICES["h100"], t.precision)
    assert e.fits, f"{name}: {e.memory['total'] / 2**30:.1f} GB"
    assert p.sequence_parallel == (p.tp > 1)
    # its run script launches it on that many nodes
    script = open(os.path.join(ROOT, "run_scripts", f"pretrain_{name}.sh")).read()
    assert f"#SBATCH --nodes={gpus // 8}" in script and f"DEFAULT_NNODES={gpus // 8} " in script
    assert shlex.quote(f"configs/{name}.yaml") in script


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_header_states_the_layout_the_config_has(name):
    """The first line's layout is the one planner/emit.py's layout_line writes for the config's own
    fields; no header states a planner figure or ranking (they change with the planner's model):
    the plan.py command it names, at the config's GPU count, gives them."""
    with open(os.path.join(ROOT, "configs", f"{name}.yaml")) as fh:
        header = [line for line in fh if line.startswith("#")]
    expected = layout_line(_config(name), gpus_of(name))
    assert f" — {expected};" in header[0], f"configs/{name}.yaml's first line should say: {expected}"
    text = "".join(header)
    assert "fastest fit" not in text and not re.search(r"\d% MFU", text), text
    for gpus in re.findall(rf"tools/plan\.py --config configs/{name}\.yaml --gpus (\d+)", text):
        assert int(gpus) == gpus_of(name)
