"""The README and docs/ stay true: every command in them runs, every link resolves, and the
configuration reference is the one the schema generates.

Every command of a ```` ```bash ```` block in README.md and docs/*.md is run, in page order, in a
scratch copy of the repository's entry points (configs/, tools/, run_scripts/ and the interpreter
running the tests as .venv), shrunk to tiny size: training commands get overrides that shrink the
model, the batch and the run (appended, so they win), iteration counts are scaled down, and a few
commands are rewritten to fit a CPU (``REWRITES``, each with its reason). What cannot run here — a
GPU, a cluster, SLURM, the whole test suite — is in ``SKIP`` with the reason and a cheaper check of
the same command (its flags parsed, ``--dry-run``, a run by hand on one node). A trailing comment
``# exits N`` states the exit status a command is expected to end with (default 0).

The README's first commands (the quickstart, tokenizing your corpus) make what every page starts
from; each page then runs in its own copy of that, so pages do not depend on each other. Fixtures
stand in for what a user brings: a corpus, a Hugging Face tokenizer in data/tokenizer/ (and GPT-2's
files in gpt2/), and tiny random Llama and GPT-NeoX checkpoints where the docs name downloaded ones.
A ``python tools/X.py`` command without shell syntax runs the script's ``main`` in this process
(``megapretrain.commands.X.main`` for a user command; tests/test_tools.py runs the scripts
themselves), everything else in bash.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

from megapretrain.monitor.flops import native_half_precision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + [f"docs/{name}" for name in (
    "training.md", "configuration.md", "data.md", "parallelism.md", "checkpoints.md", "planner.md",
    "operations.md", "kernels.md", "performance.md", "model_families.md", "contributing.md",
    "evaluation.md")]
LANGUAGES = {"bash", "text", "yaml", "json", "python"}

# appended to every command that trains: a 4-layer, 64-wide model on 8 × 32-token samples per step
TINY = ("--model.num_layers 4 --model.hidden_size 64 --model.num_heads 4 --model.num_kv_heads 4 "
        "--model.ffn_hidden_size 256 --model.vocab_size 512 --model.head_dim null --train.seq_length 32 "
        "--train.micro_batch_size 1 --train.global_batch_size 8 --train.rampup_batch_size null "
        "--train.eval_interval 4 --train.eval_iters 1 --logging.interval 1 --logging.tensorboard false "
        "--checkpoint.interval 4 --schedule.warmup_iters 1")
TRAINS = re.compile(r"megapretrain\.train|tools/preflight\.py"
                    r"|run_scripts/(quickstart|pretrain_\w+|launch)\.sh(?!.*--dry-run)")
DEFAULT_ITERS = 6

# (pattern, replacement, reason): commands rewritten to fit a 2-core CPU
REWRITES = [
    (r"--nproc-per-node 8", "--nproc-per-node 2", "pre-flight of an 8-GPU node: 2 CPU ranks"),
    (r"(tools/preflight\.py.*)--iters \d+", r"\1--iters 8", "pre-flight: 8 iterations"),
    (r"(tools/preflight\.py.*)$", r"\1 --optim.lr 3e-3 --optim.min_lr 3e-4",
     "pre-flight: a learning rate at which a tiny model's loss falls measurably in 8 steps"),
    (r"--nproc_per_node 8 tools/smoke_test\.py", "--nproc_per_node 4 tools/smoke_test.py",
     "the 8-rank smoke test on 4 CPU ranks"),
    (r"--layouts \"tp=2,pp=2,vpp=2,sp=1,zero=1; tp=8; tp=2,cp=2,sp=1\"",
     "--layouts \"tp=2,pp=2,vpp=2,sp=1,zero=1; tp=4; tp=2,cp=2,sp=1\"", "tp=8 needs 8 ranks: tp=4 on 4"),
    (r"--nproc_per_node 4 tools/smoke_test\.py --workdir runs/smoke4$",
     "--nproc_per_node 2 tools/smoke_test.py --workdir runs/smoke4", "every layout of 2 ranks, not of 4"),
    (r"(smoke_test\.py.*)$", r"\1 --steps 2", "the smoke test: 2 steps per layout"),
    (r"--max-mb 40", "--max-mb 2", "a 2 MB demo corpus"),
    (r"(make_tasks\.py.*)--context-chars 40 --choice-chars 16", r"\1--context-chars 16 --choice-chars 8",
     "items that fit the tiny runs' 32-token samples"),
    (r"bench_train\.py (.*)", r"bench_train.py \1 --steps 1 --warmup 0 " + TINY, "one tiny timed step"),
    (r"bench_dp\.py(.*)", r"bench_dp.py\1 --layers 2 --hidden 64 --vocab 256 --seq 32 --steps 1 --warmup 0",
     "one tiny step per layout"),
    (r"bench_optim\.py(.*)", r"bench_optim.py\1 --dp 1 2 --zero 1 --layers 1 --hidden 64 --vocab 256 --seq 16 "
     r"--steps 1 --warmup 0", "one tiny step per optimizer, dp 1 and 2"),
    (r"(compare_optimizers\.py \w+.*?)( -- .*)$", r"\1 --iters 2 --eval-interval 1 --eval-iters 1\2 " + TINY,
     "two tiny steps per run"),
    (r"bench_checkpoint\.py(.*)", r"bench_checkpoint.py\1 --hidden 64 --layers 1 --vocab 256 --heads 4 --repeats 1",
     "a tiny model"),
    (r"bench_kernels\.py (.*)", r"bench_kernels.py \1 --tokens 64 --hidden 64 --iters 1 --no-compile",
     "64 rows of width 64"),
    (r"bench_kernels\.py --no-timing --vocab 32768 50304 131072", "bench_kernels.py --no-timing --vocab 512 1024",
     "small vocabularies"),
    (r"bench_data\.py preprocess (.*)", r"bench_data.py preprocess \1 --repeats 1", "one repeat"),
    (r"bench_data\.py memory --big-gb 2", "bench_data.py memory --big-gb 0.01", "a 10 MB input"),
    (r"bench_data\.py index --megatron", "bench_data.py index --repeats 1", "one repeat"),
    (r"bench_data\.py reads$", "bench_data.py reads --tokens 200000 --samples 200 --repeats 1", "a small shard"),
    (r"bench_data\.py verify --tokens \d+", "bench_data.py verify --tokens 200000", "a small shard"),
    (r"bench_data\.py blend .*", "bench_data.py blend --prefixes 3 40 --samples 1e4 --megatron", "10k samples"),
    (r"bench_data\.py startup .*", "bench_data.py startup --prefixes 3 --documents 20000 --train-tokens 1e7",
     "3 small prefixes"),
    (r"bench_attention\.py (.*)", r"bench_attention.py \1 --seqs 256 512 --docs short --iters 1",
     "two short sequences, one iteration"),
    (r"bench_pipeline\.py(.*)", r"bench_pipeline.py\1 --pp 2 --micro-batches 4 --layers 4 --hidden 32 --seq 16 "
     r"--vocab 128 --steps 1 --warmup 0", "two tiny stages, one step per schedule"),
    (r"bench_tp\.py(.*)", r"bench_tp.py\1 --layers 2 --hidden 64 --seq 32 --steps 1 --warmup 0",
     "two tiny layers, one step each way"),
    (r"--seq-length 2048", "--seq-length 32", "tiny samples"),
    (r"--schedule\.rewarm_iters \d+", "--schedule.rewarm_iters 1", "a re-warm inside the extension's scaled steps"),
]
if not native_half_precision("bf16"):
    # measured on an AVX2-only CPU: 281 s for configs/bench_cpu.yaml's bf16 bench, 19 s for its fp32 twin
    REWRITES.append((r"(bench_train\.py --config configs/bench_cpu\.yaml(?!.*--train\.precision).*)$",
                     r"\1 --train.precision fp32",
                     "no bf16 instructions on this CPU (no AVX-512 BF16, AMX): its bf16 matmuls are emulated, "
                     "~80x slower; the bench's bf16 runs in fp32 here"))

# command -> (why it is not run here, the check run instead: {TINY} and {ITERS} are expanded)
SKIP = {
    "bash run_scripts/test.sh": ("the whole test suite, this test included: CI's .ci/run runs it",
                                 "bash -n run_scripts/test.sh"),
    "sbatch run_scripts/pretrain_llama3_8b.sh": (
        "needs SLURM: the same script is run by hand on one node, one process, tiny",
        "NNODES=1 NPROC_PER_NODE=1 bash run_scripts/pretrain_llama3_8b.sh {TINY} --train.iters {ITERS}"),
    "sbatch run_scripts/pretrain_llama3_70b.sh": ("needs SLURM and 512 GPUs",
                                                  "bash run_scripts/pretrain_llama3_70b.sh --dry-run"),
    "NNODES=64 NODE_RANK=0 MASTER_ADDR=node0 bash run_scripts/pretrain_llama3_70b.sh": (
        "needs 64 nodes", "NNODES=64 NODE_RANK=0 MASTER_ADDR=node0 bash run_scripts/pretrain_llama3_70b.sh --dry-run"),
    "torchrun --nproc_per_node 8 --nnodes 2 --node_rank 0 --master_addr node0 -m megapretrain.train "
    "--config configs/llama3_8b.yaml --parallel.tp 8 --parallel.pp 2 --checkpoint.load ckpt/l31 "
    "--checkpoint.finetune true": (
        "needs 2 nodes of 8 GPUs: the layout is validated at 16 ranks",
        "python tools/plan.py --config configs/llama3_8b.yaml --gpus 16 --check --parallel.tp 8 --parallel.pp 2"),
    "bash run_scripts/gpu_check.sh --output runs/gpu_check": ("needs a GPU: its plan is printed",
                                                              "bash run_scripts/gpu_check.sh --output runs/gpu_check "
                                                              "--dry-run"),
    "python tools/simulate.py --config configs/llama3_8b.yaml --world-size 64 --rank 0": (
        "minutes of CPU under load: tests/test_simulate.py simulates Llama 3 8B at its layout",
        "python tools/plan.py --config configs/llama3_8b.yaml --gpus 64 --check"),
    "python tools/simulate.py --config configs/llama3_405b.yaml --world-size 16384 --roles --output runs/sim405b": (
        "ten minutes of CPU: tests/test_simulate.py simulates every role at tiny size",
        "python tools/plan.py --config configs/llama3_405b.yaml --gpus 16384 --check"),
    "python tools/simulate.py --config configs/llama3_70b.yaml --world-size 512 --rank 0 --rank 511 --json": (
        "minutes of CPU: tests/test_simulate.py checks the JSON of every role at tiny size",
        "python tools/plan.py --config configs/llama3_70b.yaml --gpus 512 --check --json"),
    "python tools/plan.py --config configs/llama3_8b.yaml --gpus 64 --simulate 3": (
        "three simulations of Llama 3 8B: tests/test_simulate_planner.py runs --simulate 1 at tiny size",
        "python tools/plan.py --config configs/llama3_8b.yaml --gpus 64 --top 3"),
    "python tools/preflight.py --config configs/llama3_8b.yaml --nproc-per-node 8 --world-size 64": (
        "pre-flight runs and a simulation per role: tests/test_preflight.py runs the production-layout check",
        "python tools/plan.py --config configs/llama3_8b.yaml --gpus 64 --check"),
    "python tools/check_planner.py --output runs/planner_sweep.jsonl": (
        "about an hour of CPU: tests/test_simulate_planner.py holds shortened layouts to the same bounds",
        "python tools/check_planner.py --help"),
    "python tools/check_planner.py --from runs/planner_sweep.jsonl": (
        "reads the sweep the command above writes", "python tools/check_planner.py --help"),
    "python tools/check_kernels.py": (
        "2-4 minutes of ptxas: tests/test_kernels_compile.py runs it (bf16 and fp32, three targets)",
        "python tools/check_kernels.py --help"),
}


# tools that set process-wide state (torch's threads), spawn processes or need their own launcher: run as scripts
OWN_PROCESS = {"bench_train", "bench_dp", "bench_optim", "bench_kernels", "bench_attention", "bench_pipeline",
               "bench_tp", "smoke_test", "check_kernels", "gpu_check"}


@dataclass
class Command:
    page: str
    line: int
    text: str           # as written (continuations joined, the trailing comment removed)
    setup: str          # the block's variable assignments before it (F="...")
    expect: int = 0     # its exit status (# exits N)

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def _comment(line: str) -> tuple[str, str]:
    """(code, comment) of a shell line: the first # outside quotes that follows a space starts it."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def blocks(page: str) -> list[tuple[str, int, list[str]]]:
    """(language, first line number, lines) of every fenced block of a page."""
    out, current = [], None
    for number, line in enumerate(open(os.path.join(ROOT, page)).read().split("\n"), 1):
        if line.startswith("```"):
            if current is None:
                current = (line[3:].strip(), number + 1, [])
            else:
                out.append(current)
                current = None
        elif current is not None:
            current[2].append(line)
    assert current is None, f"{page}: a fenced block is not closed"
    return out


def commands(page: str) -> list[Command]:
    out = []
    for language, first, lines in blocks(page):
        if language != "bash":
            continue
        setup, pending, start = [], "", first
        for number, line in enumerate(lines, first):
            start = number if not pending else start
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1].strip() + " "
                continue
            text, comment = _comment(pending + line.strip())
            pending = ""
            if not text:
                continue
            if re.fullmatch(r"[A-Za-z_]\w*=\S.*", text) and not re.search(r"\s(python|bash|torchrun)\s", text):
                setup.append(text)  # a variable later commands of the block use
                continue
            expect = re.search(r"exits (\d+)", comment)
            out.append(Command(page, start, text, "\n".join(setup), int(expect[1]) if expect else 0))
    return out


# a tool flag (not a dotted config override) with its values, up to the next flag or command
TOOL_FLAG = re.compile(r"\s--([a-z][\w-]*)(?=\s|$)((?:\s+(?!-)[^\s|;&]+)*)")


# the tool flags the rewrites set (a page's own repeated flags, e.g. an appended input, are kept)
REWRITTEN = {m[1] for _, replacement, _ in REWRITES for m in TOOL_FLAG.finditer(" " + replacement)}


def _last_flag_wins(text: str) -> str:
    """``text`` with every tool flag that a rewrite sets kept once, at its last place: every tool
    refuses a value flag given twice (cli.ToolParser); dotted overrides may repeat."""
    last = {m[1]: m.start() for m in TOOL_FLAG.finditer(text)}
    return TOOL_FLAG.sub(lambda m: m[0] if m[1] not in REWRITTEN or last[m[1]] == m.start()
                         else "", text)


def shrink(text: str) -> str:
    """The command at tiny size (see the module docstring)."""
    for pattern, replacement, _ in REWRITES:
        text = re.sub(pattern, replacement, text)
    text = _last_flag_wins(text)
    if TRAINS.search(text) and "--help" not in text and not re.search(r"\s--check(\s|$)", text):  # trains nothing
        iters = re.search(r"--train\.iters (\d+)", text)
        if iters and not re.search(r"--faults\.\w+_at ", text):  # (a drill keeps its length: it
            # must reach its iteration, or the trainer refuses it as one that can never fire)
            text = text.replace(iters[0], f"--train.iters {max(2, math.ceil(int(iters[1]) / 10))}")
        budget = re.search(r"--train\.train_tokens \S+", text)
        if budget:  # a token budget: DEFAULT_ITERS steps of TINY's 8 × 32 tokens
            text = text.replace(budget[0], f"--train.train_tokens {DEFAULT_ITERS * 8 * 32}")
        text += f" {TINY}" + ("" if iters or budget or "preflight" in text else f" --train.iters {DEFAULT_ITERS}")
    return text


# ----------------------------------------------------------------------------------------------
# The scratch directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv(sandbox: str) -> None:
    """.venv as env.sh finds it installed: this interpreter's environment, with env.sh's stamp."""
    venv = os.path.join(sandbox, ".venv")
    if sys.prefix != sys.base_prefix:  # the tests run in a virtualenv (CI: the one test.sh made)
        os.makedirs(venv)
        for name in os.listdir(sys.prefix):
            if not name.startswith(".installed-"):
                os.symlink(os.path.join(sys.prefix, name), os.path.join(venv, name))
    else:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], check=True)
    digest = hashlib.sha1(open(os.path.join(ROOT, "setup.py"), "rb").read()).hexdigest()[:12]
    open(os.path.join(venv, f".installed-{digest}"), "w").close()


def _corpus(path: str) -> None:
    """A user's corpus: this repository's Python sources, one document each."""
    with open(path, "w") as fh:
        for directory in ("megapretrain", "tests", "kernels"):
            for base, _, files in sorted(os.walk(os.path.join(ROOT, directory))):
                for name in sorted(f for f in files if f.endswith(".py")):
                    fh.write(json.dumps({"text": open(os.path.join(base, name)).read()}) + "\n")


def _tokenizer(corpus: str, path: str) -> None:
    """A user's Hugging Face tokenizer: a byte-level BPE of 400 ids trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((json.loads(line)["text"] for line in open(corpus)), trainer)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tok.save(path)


def _gpt2_files(corpus: str, directory: str) -> None:
    """GPT-2's tokenizer files as the benchmarks name them (gpt2/vocab.json, merges.txt): a tiny
    byte-level BPE of that format."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator((json.loads(line)["text"] for line in open(corpus)), vocab_size=400,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    os.makedirs(directory)
    tok.save_model(directory)


def _hf_models(sandbox: str) -> None:
    """Tiny random checkpoints where the docs convert downloaded ones (Llama 3.1 8B, Pythia-160M,
    OLMo 2 1B),
    with TINY's shape so that the commands that train from them fit."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # 1000 ids: at tp 8 every rank holds real rows (from-hf fails on a rank that holds padding alone)
    llama = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=8, rope_theta=500000.0,
                        max_position_embeddings=131072,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    LlamaForCausalLM(llama).save_pretrained(os.path.join(sandbox, "hf", "llama-3.1-8b"))
    neox = GPTNeoXConfig(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)
    GPTNeoXForCausalLM(neox).save_pretrained(os.path.join(sandbox, "hf", "pythia-160m"))
    from transformers import Olmo2Config, Olmo2ForCausalLM
    olmo = Olmo2Config(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, pad_token_id=None, eos_token_id=None)
    Olmo2ForCausalLM(olmo).save_pretrained(os.path.join(sandbox, "hf", "olmo-2-0425-1b"))


@dataclass
class Result:
    command: Command
    ran: str
    status: int
    output: str
    seconds: float


class Sandbox:
    """A scratch directory that looks like the repository's root to the commands."""

    def __init__(self, path: str):
        self.path = path
        self.results: list[Result] = []

    def env(self) -> dict:
        env = dict(os.environ, MASTER_PORT=str(_free_port()), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env["PATH"] = os.pathsep.join([os.path.join(self.path, "bin"), os.path.dirname(sys.executable), env["PATH"]])
        return env

    def run(self, command: Command, text: str) -> Result:
        start = time.time()
        inproc = re.fullmatch(r"python tools/(\w+)\.py((?: [^|<>&;$`\\]*)?)", text)
        if inproc and not command.setup and inproc[1] not in OWN_PROCESS:
            status, output = self._in_process(inproc[1], shlex.split(inproc[2]))
        else:
            script = "\n".join(filter(None, [command.setup, text]))
            proc = subprocess.run(["bash", "-c", script], cwd=self.path, env=self.env(), capture_output=True,
                                  text=True, timeout=600)
            status, output = proc.returncode, proc.stdout + proc.stderr
        result = Result(command, text, status, output, time.time() - start)
        self.results.append(result)
        print(f"{result.seconds:6.1f} s  exit {status}  {command.page}:{command.line}  {text[:150]}", flush=True)
        return result

    def _in_process(self, tool: str, argv: list[str]) -> tuple[int, str]:
        from helpers import load_tool

        main = load_tool(tool).main  # what tools/NAME.py runs: its own main or its command's
        buffer, cwd = io.StringIO(), os.getcwd()
        os.chdir(self.path)
        try:
            with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
                try:
                    status = main(argv)
                except SystemExit as exit:
                    status = exit.code if isinstance(exit.code, int) else 1
        finally:
            os.chdir(cwd)
        return status or 0, buffer.getvalue()


def _check(sandbox: Sandbox, command: Command) -> None:
    if command.text in SKIP:
        _, check = SKIP[command.text]
        ran = check.format(TINY=TINY, ITERS=DEFAULT_ITERS)
        result = sandbox.run(Command(command.page, command.line, ran, command.setup), ran)
        expect = 0
    else:
        result = sandbox.run(command, shrink(command.text))
        expect = command.expect
    assert result.status == expect, (f"{command}\nran: {result.ran}\nexit {result.status}, expected {expect}:\n"
                                     f"{result.output[-4000:]}")


BASE_COMMANDS = 3  # the README's quickstart, its test command (skipped) and step 1 make every page's start


@pytest.fixture(scope="module")
def base():
    """The quickstart and step 1 of the README, run once: demo/, runs/tiny, data/corpus_text_document.
    In a directory of its own (not pytest's numbered ones, which other sessions prune)."""
    with tempfile.TemporaryDirectory(prefix="megapretrain-docs-") as top:
        yield _base(os.path.join(top, "base"))


def _base(path: str) -> Sandbox:
    os.makedirs(path)
    for name in ("configs", "tools", "run_scripts", "setup.py"):
        os.symlink(os.path.join(ROOT, name), os.path.join(path, name))
    _venv(path)
    os.makedirs(os.path.join(path, "bin"))
    shim = os.path.join(path, "bin", "torchrun")  # torchrun on a free port, whichever python runs the tests
    with open(shim, "w") as fh:
        fh.write(f"#!/usr/bin/env bash\nexec {shlex.quote(sys.executable)} -m torch.distributed.run "
                 '--standalone "$@"\n')
    os.chmod(shim, 0o755)
    _corpus(os.path.join(path, "corpus.jsonl"))
    _tokenizer(os.path.join(path, "corpus.jsonl"), os.path.join(path, "data", "tokenizer", "tokenizer.json"))
    os.makedirs(os.path.join(path, "data", "gpt-neox-20b"))  # Pythia's configs name GPT-NeoX's tokenizer here
    shutil.copy(os.path.join(path, "data", "tokenizer", "tokenizer.json"), os.path.join(path, "data", "gpt-neox-20b"))
    _gpt2_files(os.path.join(path, "corpus.jsonl"), os.path.join(path, "gpt2"))
    _hf_models(path)
    sandbox = Sandbox(path)
    for command in commands("README.md")[:BASE_COMMANDS]:
        _check(sandbox, command)
    return sandbox


def _page_sandbox(base: Sandbox, page: str) -> Sandbox:
    """A copy of the base for one page (demo/, read only, linked)."""
    path = os.path.join(os.path.dirname(base.path), "page-" + re.sub(r"\W", "_", page))
    shutil.copytree(base.path, path, symlinks=True, ignore=shutil.ignore_patterns("demo"))
    os.symlink(os.path.join(base.path, "demo"), os.path.join(path, "demo"))
    return Sandbox(path)


@pytest.mark.slow
@pytest.mark.ci  # every documented command runs in CI, so that none goes stale
@pytest.mark.timeout(1800)  # the README's includes the quickstart: minutes on a loaded 2-core machine
@pytest.mark.parametrize("page", PAGES)
def test_every_command_runs(base, page):
    """Every command of the page, at tiny size, in order, ends with the status it states (0 unless
    ``# exits N``); a skipped one's check passes."""
    sandbox = _page_sandbox(base, page)
    todo = commands(page)[BASE_COMMANDS if page == "README.md" else 0:]
    for command in todo:
        _check(sandbox, command)


def test_the_skip_list_names_commands_that_exist():
    """Each SKIP entry is a command of the docs, with its reason; a stale entry is an error."""
    every = {c.text for page in PAGES for c in commands(page)}
    assert set(SKIP) <= every, sorted(set(SKIP) - every)
    assert all(reason and check for reason, check in SKIP.values())


def test_commands_are_found_and_shrunk():
    """The extraction and shrinking themselves: continuations joined, comments dropped, assignments
    kept as setup, # exits N read, training commands shrunk and their iterations scaled."""
    found = {c.text: c for page in PAGES for c in commands(page)}
    exits = [c for c in found.values() if c.expect]
    assert {c.expect for c in exits} == {1, 2}  # a failing check or drill, and bad input
    assert any(c.setup.startswith("F=") and "$F" in c.text for c in found.values())
    assert not any("\\" in c.text.split("'")[0] or c.text.endswith("#") for c in found.values())
    quickstart = shrink("bash run_scripts/quickstart.sh")
    assert quickstart.endswith(f"{TINY} --train.iters {DEFAULT_ITERS}")
    assert "--train.iters 4 " in shrink("torchrun -m megapretrain.train --train.iters 40 --parallel.zero 1")
    assert shrink("python tools/plan.py --config configs/llama3_8b.yaml --gpus 64").endswith("--gpus 64")
    budget = shrink("python -m megapretrain.train --train.iters null --train.train_tokens 2e12")
    assert "--train.train_tokens 1536 " in budget and budget.endswith(TINY)
    check = "python -m megapretrain.train --config c.yaml --check"
    assert shrink(check) == check
    saves = shrink("python -m megapretrain.train --checkpoint.interval 5")  # --check... is not --check
    assert saves.endswith(f"{TINY} --train.iters {DEFAULT_ITERS}")


def test_every_fence_has_a_language_and_no_prompt():
    """Commands are in ```bash blocks (which this test runs), output in ```text; nothing unlabelled,
    and no `$ ` prompt hiding a command in an output block."""
    for page in PAGES:
        for language, first, lines in blocks(page):
            assert language in LANGUAGES, f"{page}:{first - 1}: a fence without a known language ({language!r})"
            if language == "text":
                assert not any(line.startswith("$ ") for line in lines), f"{page}:{first}: a prompt in output"


def test_links_and_pictures_resolve():
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else \
                os.path.join(ROOT, page)
            assert os.path.exists(full), f"{page}: link to {target}: no such file"
            if anchor and full.endswith(".md"):
                headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", open(full).read(), re.M)}
                assert anchor in headings, f"{page}: link to {target}: no heading #{anchor}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_a_path():
    lines = open(os.path.join(ROOT, "README.md")).read().split("\n")
    assert len(lines) < 250, len(lines)
    text = "\n".join(lines)
    for command in ("bash run_scripts/quickstart.sh", "bash run_scripts/test.sh"):
        assert f"\n{command} " in text
    assert "bash run_scripts/test.sh" in open(os.path.join(ROOT, ".ci", "run")).read()
    steps = re.findall(r"^\*\*(\d)\. (\w+)", text, re.M)
    assert [word for _, word in steps] == ["Tokenize", "Choose", "Plan", "Pre", "Launch", "Watch", "Convert"]


def test_the_configuration_reference_is_generated_from_the_schema():
    """docs/configuration.md is what tools/gen_config_reference.py writes: a field added, renamed or
    re-described in config.py without rerunning it fails here."""
    from helpers import load_tool

    gen_config_reference = load_tool("gen_config_reference")
    from megapretrain.config import Config, _all_paths

    page = open(os.path.join(ROOT, "docs", "configuration.md")).read()
    assert page == gen_config_reference.reference(), "run: python tools/gen_config_reference.py"
    for path in _all_paths(Config):
        assert f"| `{path}` |" in page, path
    assert gen_config_reference.main(["--check"]) == 0
