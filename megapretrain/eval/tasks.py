"""Multiple-choice task files: read, check and tokenize them the way lm-evaluation-harness does.

A task file is JSON lines, one item per line::

    {"context": "The capital of France is", "choices": [" Paris", " Rome"], "label": 0}

The task's name is the file's stem (``hellaswag.jsonl`` -> ``hellaswag``). Each choice is scored
by the summed log-probability of its continuation tokens given the context, with
lm-evaluation-harness's rule for where the context ends and the continuation begins
(``TemplateLM._encode_pair``):

1. trailing whitespace of the context moves to the front of the continuation;
2. ``whole = tokenize(context + continuation)``, ``ctx = tokenize(context)``;
3. the continuation is ``whole[len(ctx):]`` and the model reads ``ctx + continuation`` (so a BPE
   merge across the boundary shows up in the continuation, as there); an empty context is the
   tokenizer's end-of-document token, the continuation then ``tokenize(continuation)``.

No BOS is added: the tokenizer's ``tokenize`` is used as it is (the trainer's data has none either).
The model reads ``ctx + continuation`` minus its last token, which must fit in ``train.seq_length``:
a longer pair is refused, not truncated (a truncated context changes what is measured).

A few-shot prefix (``num_fewshot`` > 0) is built from a file of items of the same shape, with
lm-evaluation-harness's default sampler (``ContextSampler`` of ``lm_eval/api/samplers.py``): one
``random.Random(fewshot_seed)`` per task (its default seed 1234, as ``simple_evaluate``'s
``fewshot_random_seed``), and for each item in file order ``rng.sample(examples, K)``; when the
examples are the task's own file, ``K + 1`` are drawn and those equal to the item dropped, then the
first ``K`` kept. Its ``first_n`` sampler (``FirstNSampler``, MMLU's) takes the file's first
``K`` (``K + 1``) items in place of a draw. Each example is ``context + choices[label]``; they are
joined by a blank line and followed by one, then the item's context. Loading is the same on every
rank, so every layout scores the same prompts.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

from ..errors import DataError, MissingFileError
from ..user_files import check_kind

FEWSHOT_SEPARATOR = "\n\n"
FEWSHOT_SEED = 1234  # lm-evaluation-harness's default few-shot seed (fewshot_random_seed)
SAMPLERS = ("random", "first_n")  # its default ContextSampler, its FirstNSampler


@dataclass
class Item:
    """One question: its choices' token sequences (what the model reads, plus the last token) with
    the number of continuation tokens at their end, the right choice, and each choice's length in
    UTF-8 bytes (``acc_norm`` divides by it)."""

    requests: list[tuple[list[int], int]]
    label: int
    choice_bytes: list[int]


@dataclass
class Task:
    name: str
    path: str
    items: list[Item] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(item.requests) for item in self.items)


def task_name(path: str) -> str:
    """A task file's name in metrics: its file name without the extension(s)."""
    return os.path.basename(path).split(".")[0]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The context's and the continuation's tokens under lm-evaluation-harness's rule (above)."""
    if context == "":
        return [tokenizer.eod], list(tokenizer.tokenize(continuation))
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = list(tokenizer.tokenize(context + continuation))
    ctx = list(tokenizer.tokenize(context))
    return ctx, whole[len(ctx):]


def read_items(path: str) -> list[tuple[int, dict]]:
    """The file's items with their line numbers, each checked for shape: ``context`` a string,
    ``choices`` a non-empty list of strings, ``label`` an integer index into it. A bad line is one
    error naming the file, the line and the rule."""
    check_kind("task file", path, "a task file", "give a JSONL file of {\"context\", \"choices\", "
               "\"label\"} items (docs/evaluation.md)", also=("a task file (JSONL)",))
    if not os.path.isfile(path):
        raise MissingFileError(f"task file {path} not found: give a JSONL file of "
                               '{"context", "choices", "label"} items (docs/evaluation.md)')
    items = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"task file {path} line {number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not JSON ({exc.msg}); each line is one item "
                                '{"context": str, "choices": [str, ...], "label": int}') from None
            items.append((number, _checked(item, where)))
    if not items:
        raise DataError(f"task file {path} holds no items: one JSON object per line")
    return items


def _checked(item, where: str) -> dict:
    if not isinstance(item, dict):
        raise DataError(f"{where}: an item is a JSON object "
                        '{"context": str, "choices": [str, ...], "label": int}')
    for key in ("context", "choices", "label"):
        if key not in item:
            raise DataError(f"{where}: missing key '{key}' (an item has context, choices, label)")
    if not isinstance(item["context"], str):
        raise DataError(f"{where}: 'context' must be a string")
    choices = item["choices"]
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise DataError(f"{where}: 'choices' must be a list of strings")
    if not choices:
        raise DataError(f"{where}: 'choices' is empty: an item needs at least one choice")
    if "" in choices:
        raise DataError(f"{where}: choice {choices.index('')} is empty: every choice needs text")
    label = item["label"]
    if not isinstance(label, int) or isinstance(label, bool):
        raise DataError(f"{where}: 'label' must be an integer (the index of the right choice)")
    if not 0 <= label < len(choices):
        raise DataError(f"{where}: label {label} is out of range for {len(choices)} choices "
                        f"(0..{len(choices) - 1})")
    return item


class FewshotSampler:
    """The few-shot prefix of each item of a task, drawn as lm-evaluation-harness draws it (see
    the module docstring): ``path``'s examples, ``num_fewshot`` of them per item, from one seeded
    generator consumed item by item, or (``sampler="first_n"``) the file's first ones;
    ``same_file``: the examples are the task's own items."""

    def __init__(self, path: str, num_fewshot: int, seed: int = FEWSHOT_SEED,
                 same_file: bool = False, sampler: str = "random"):
        if sampler not in SAMPLERS:
            raise DataError(f"few-shot sampler '{sampler}' is not one of {', '.join(SAMPLERS)}")
        self.examples = [item for _, item in read_items(path)]
        self.num, self.same_file, self.first_n = num_fewshot, same_file, sampler == "first_n"
        if len(self.examples) < num_fewshot + same_file:
            itself = " + the item itself" if same_file else ""
            raise DataError(f"few-shot file {path} holds {len(self.examples)} items, fewer than "
                            f"num_fewshot={num_fewshot}{itself}: add items or ask for fewer")
        self.rng = random.Random(seed)

    def prefix(self, item: dict) -> str:
        """The next item's prefix: its examples answered, each followed by a blank line."""
        count = self.num + self.same_file
        drawn = self.examples[:count] if self.first_n else self.rng.sample(self.examples, count)
        shots = [x for x in drawn if x != item][:self.num]
        return "".join(x["context"] + x["choices"][x["label"]] + FEWSHOT_SEPARATOR for x in shots)


def load_task(path: str, tokenizer, seq_length: int, fewshot: str | None = None,
              num_fewshot: int = 0, fewshot_seed: int = FEWSHOT_SEED,
              sampler: str = "random") -> Task:
    """Read, check and tokenize task file ``path``; ``fewshot``: the file of its examples (needed
    when ``num_fewshot`` > 0; it may be ``path`` itself). Refuses an item whose context, or context
    and choice, the model cannot read in ``seq_length`` tokens."""
    if num_fewshot and not fewshot:
        raise DataError(f"task file {path}: num_fewshot={num_fewshot} needs a few-shot file of "
                        "example items for it")
    items = read_items(path)
    sampler = FewshotSampler(fewshot, num_fewshot, fewshot_seed,
                             os.path.realpath(fewshot) == os.path.realpath(path), sampler) \
        if num_fewshot else None
    task = Task(task_name(path), path)
    for number, item in items:
        where = f"task file {path} line {number}"
        context = (sampler.prefix(item) if sampler else "") + item["context"]
        requests = []
        for i, choice in enumerate(item["choices"]):
            ctx, cont = encode_pair(tokenizer, context, choice)
            if not ctx:
                raise DataError(f"{where}: the context is only whitespace: give it text, or "
                                "leave it empty (\"\") for the end-of-document token")
            if len(ctx) > seq_length:
                raise DataError(f"{where}: the context is {len(ctx)} tokens, longer than "
                                f"train.seq_length={seq_length}: shorten it (or use fewer "
                                "few-shot examples); items are not truncated")
            if not cont:
                raise DataError(f"{where}: choice {i} has no tokens of its own after the context")
            if len(ctx) + len(cont) - 1 > seq_length:
                raise DataError(f"{where}: context and choice {i} are {len(ctx) + len(cont)} "
                                f"tokens; the model reads all but the last, which must fit in "
                                f"train.seq_length={seq_length}: shorten the item; items are not "
                                "truncated")
            requests.append((ctx + cont, len(cont)))
        task.items.append(Item(requests, item["label"],
                               [len(c.encode("utf-8")) for c in item["choices"]]))
    return task


def load_tasks(paths: list[str], tokenizer, seq_length: int, fewshot: list[str] | None = None,
               num_fewshot: int = 0, fewshot_seed: int = FEWSHOT_SEED,
               sampler: str = "random") -> list[Task]:
    """Every task file of ``paths``; ``fewshot``: one example file per task (or none). Two files of
    the same stem are refused (their metrics would share names)."""
    fewshot = fewshot or []
    if fewshot and len(fewshot) != len(paths):
        raise DataError(f"{len(fewshot)} few-shot files for {len(paths)} task files: give one "
                        "per task, in the same order")
    names = [task_name(p) for p in paths]
    for name in names:
        if names.count(name) > 1:
            twins = [p for p in paths if task_name(p) == name]
            raise DataError(f"task files {twins} share the name '{name}' (metrics are named by the "
                            "file's stem): rename one")
    return [load_task(p, tokenizer, seq_length, fewshot[i] if fewshot else None, num_fewshot,
                      fewshot_seed, sampler) for i, p in enumerate(paths)]


def corpus_documents(prefix: str, tokenizer, limit: int = 1000) -> list[str]:
    """The text of the first ``limit`` documents of indexed dataset ``prefix`` (.bin/.idx), the
    end-of-document token dropped: what :func:`tasks_from_corpus` makes items of."""
    from ..data.indexed_dataset import IndexedDataset

    data = IndexedDataset(prefix)
    return [tokenizer.detokenize([int(t) for t in data[i] if int(t) != tokenizer.eod])
            for i in range(min(limit, len(data)))]


def tasks_from_corpus(documents: list[str], path: str, *, num_items: int = 16,
                      num_choices: int = 4, context_chars: int = 48, choice_chars: int = 16,
                      seed: int = 0) -> str:
    """Write a task file made from ``documents`` (texts of a corpus): each item's context is a
    stretch of a document, its right choice the text that follows it there, the wrong choices
    stretches of the same length from elsewhere in the corpus. A model that learned the corpus
    scores above chance on it. Returns ``path``."""
    rng = random.Random(seed)
    span = context_chars + choice_chars
    long_enough = [d for d in documents if len(d) > span]
    if not long_enough:
        raise DataError(f"no document is longer than {span} characters: nothing to make items of")
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(num_items):
            doc = rng.choice(long_enough)
            start = rng.randrange(len(doc) - span)
            context = doc[start:start + context_chars]
            right = doc[start + context_chars:start + span]
            choices, tries = [right], 0
            while len(choices) < num_choices:
                tries += 1
                if tries > 100 * num_choices:  # a corpus of one repeated text has no others
                    raise DataError(f"found no {num_choices - 1} distinct wrong choices in the "
                                    "corpus")
                other = rng.choice(long_enough)
                at = rng.randrange(len(other) - choice_chars)
                wrong = other[at:at + choice_chars]
                if wrong not in choices:
                    choices.append(wrong)
            rng.shuffle(choices)
            fh.write(json.dumps({"context": context, "choices": choices,
                                 "label": choices.index(right)}) + "\n")
    return path
