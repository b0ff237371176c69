"""megapretrain package metadata.

``kernels/`` sits at the repository root but is installed as ``megapretrain.kernels`` (a different
PyPI package owns the top-level name ``kernels``, and transformers imports it). It is a namespace
portion, with no ``__init__.py``: when the repository root is on ``sys.path`` (``python -m`` from
the root), a regular ``kernels`` package installed anywhere on the path still wins the bare name.
The wheel installs its modules into ``megapretrain/kernels/``; an editable install and a checkout
that is not installed map it with ``megapretrain/__init__.py``'s finder.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["megapretrain", "megapretrain.*"])
packages.append("megapretrain.kernels")

setup(
    name="megapretrain",
    version="0.1.0",
    description="Megatron-style 3D-parallel LLM pretraining that also runs, and is tested, on CPU",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"megapretrain.kernels": "kernels"},
    install_requires=[
        # torch is not pinned to a build here: install the CPU or CUDA wheel you want first
        # (run_scripts/*.sh do, CPU: pip install torch==2.13.0).
        "torch>=2.5",
        "numpy>=1.24",
        "einops>=0.7",
        "pyyaml>=6.0",
        "tensorboard>=2.14",
        "tqdm>=4.60",
    ],
    extras_require={
        "hf": ["transformers>=4.45", "safetensors>=0.4", "tokenizers>=0.19"],
        "wandb": ["wandb>=0.16"],
        "triton": ["triton>=3.0"],
        "plots": ["matplotlib>=3.7"],
        # tests/test_downstream.py scores tasks with lm-evaluation-harness on the to-hf export
        # (0.4.13: the first release that imports under transformers 5)
        "eval-harness": ["lm_eval>=0.4.13", "transformers>=4.45"],
        "dev": ["pytest>=7.4", "pytest-timeout>=2.1", "ruff>=0.6", "matplotlib>=3.7", "triton>=3.0",
                "setuptools>=70", "wheel",
                "tokenizers>=0.19",
                "transformers>=4.45", "safetensors>=0.4",
                # data path tests: .zst and parquet inputs, HF datasets, the other tokenizer
                # backends, and megatron-core's IndexedDataset for the format compatibility tests
                # (CPU-only, no extra deps)
                "zstandard>=0.22", "pyarrow>=14", "datasets>=2.19", "sentencepiece>=0.2",
                "tiktoken>=0.7", "megatron-core>=0.16",
                # tools/plan.py --emit accelerate is checked with Accelerate's own parser (DeepSpeed
                # ships only a source build, which run_scripts/test.sh makes against the installed
                # torch)
                "accelerate>=0.30",
                # the real wandb package, tested offline (WANDB_MODE=offline: no network, no
                # account)
                "wandb>=0.16",
                # model.fp8's reference: tests compare the FP8 linears with torchao.float8's recipes
                # (0.15-0.18 run on torch 2.13 CPU; float8 training is plain Python there)
                "torchao>=0.15"],
    },
    entry_points={"console_scripts": [
        "megapretrain-train=megapretrain.train:main",
        # the tools (tools/NAME.py runs the same megapretrain.commands.NAME:main)
        "megapretrain-plan=megapretrain.commands.plan:main",
        "megapretrain-preflight=megapretrain.commands.preflight:main",
        "megapretrain-smoke-test=megapretrain.commands.smoke_test:main",
        "megapretrain-preprocess=megapretrain.commands.preprocess_data:main",
        "megapretrain-merge-datasets=megapretrain.commands.merge_datasets:main",
        "megapretrain-inspect-data=megapretrain.commands.inspect_data:main",
        "megapretrain-convert=megapretrain.commands.convert_checkpoint:main",
        "megapretrain-reshard=megapretrain.commands.reshard_checkpoint:main",
        "megapretrain-merge-checkpoints=megapretrain.commands.merge_checkpoints:main",
        "megapretrain-inspect-checkpoint=megapretrain.commands.inspect_checkpoint:main",
        "megapretrain-pipeline-schedule=megapretrain.commands.pipeline_schedule:main",
        "megapretrain-plot-run=megapretrain.commands.plot_run:main",
        "megapretrain-plot-schedule=megapretrain.commands.plot_schedule:main",
        "megapretrain-simulate=megapretrain.commands.simulate:main",
        "megapretrain-evaluate=megapretrain.commands.evaluate:main",
        "megapretrain-make-tasks=megapretrain.commands.make_tasks:main",
    ]},
)
