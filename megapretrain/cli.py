"""What every entry point shares: argument types for the tools' command lines, so a bad number is
one argparse line (``tool.py: error: argument --workers: 0 is not a positive integer``), never a
division by zero or a crash deep inside; and the one printer of bad input, so a
:class:`~megapretrain.errors.UserError` is one ``error: MESSAGE`` line on stderr and exit status 2
in every tool and in training; and :class:`ToolParser`, the argument parser of every tool: a flag
given twice is refused, and a path flag's ``~`` and environment variables are expanded."""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable

from .config import check_distinct, expand_path
from .errors import UserError

USER_ERROR_EXIT = 2  # the exit status of bad input
# a training that would repeat the same failure at the same iteration once more (attempts.py): a
# launcher does not restart it
CRASH_LOOP_EXIT = 6
# set by megapretrain.launcher in its workers' environment: the rendezvous round of the attempt,
# the same on every node (parallel/state.py names the attempt's store by it)
ROUND_ENV = "MEGAPRETRAIN_RDZV_ROUND"


def print_error(message: object) -> None:
    """Print the one line an entry point gives for bad input or a failure it names."""
    print(f"error: {message}", file=sys.stderr)


def user_errors(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """``main(argv)`` that prints a :class:`UserError` as one line and returns 2; any other
    exception is a bug and keeps its traceback."""
    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except UserError as err:
            print_error(err)
            return USER_ERROR_EXIT
    return run


def number(kind, low: float | None = None, *, above: bool = False, high: float | None = None,
           what: str | None = None):
    """An argparse ``type`` for a number of ``kind`` (int or float), finite — never NaN or
    infinite — and at least ``low`` (``above``: greater than it) and at most ``high``. Every
    numeric flag of every tool goes through this, so a bad number is refused by argparse, before
    any work, with one line naming the flag."""
    if what is None:
        noun = "integer" if kind is int else "number"
        what = (f"a positive {noun}" if low == 0 and above else f"a non-negative {noun}" if low == 0
                else f"a finite {noun}")
        if high is not None:
            what += f" at most {high:g}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) \
                or (low is not None and (value < low or (above and value == low))) \
                or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value
    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive_int = number(int, 0, above=True)
non_negative_int = number(int, 0)
positive_float = number(float, 0.0, above=True)
non_negative_float = number(float, 0.0)
fraction = number(float, 0.0, above=True, high=1.0, what="a fraction in (0, 1]")


def progress_bar(total: float | None, desc: str, unit: str = "B", enabled: bool | None = None):
    """A progress bar on stderr for a tool's long work (tqdm): bytes shown in KiB/MiB/GiB, other
    units as counts. ``enabled`` None shows it only on a terminal, so logs and pipes stay clean; it
    disappears when done, leaving the tool's closing line alone."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024 if unit == "B"
                else 1000, file=sys.stderr, disable=None if enabled is None else not enabled,
                dynamic_ncols=True, leave=False)


# Every tool's flags that name a file or directory (long option, or a positional's dest): their
# ``~`` and environment variables are expanded (config.expand_path), so no tool takes
# ``~/ckpt`` literally. tests/test_flags.py walks every tool's parser and holds each flag whose
# name says it is a path to this list.
PATH_FLAGS = frozenset({
    "--config", "--configs", "--checkpoint", "--checkpoints", "--output", "--output-prefix",
    "--input", "--hf", "--hf-dataset", "--hf-data-files", "--dcp", "--megatron", "--dir",
    "--tmp-dir", "--workdir", "--output-dir", "--corpus", "--data", "--tasks", "--fewshot",
    "--diff", "--png", "--merge-file", "--vocab-file", "--tokenizer-model", "--compare-nanogpt",
    "--from", "--write-config", "--write-launch", "--emit", "--json", "--jsonl", "--plot",
    "path", "prefix", "run_dir",
})


# Flags that list inputs, each to be read once: an entry given twice is refused (it would be read
# twice: a checkpoint counted twice in a merge, a task scored twice, a data file tokenized twice).
# (preprocess_data's and merge_datasets' --input refuse their duplicates themselves, by content.)
DISTINCT_FLAGS = frozenset({"--checkpoints", "--tasks", "--hf-data-files"})


def _is_path(action: argparse.Action) -> bool:
    names = action.option_strings or [action.dest]
    return any(name in PATH_FLAGS for name in names)


def _expand(value, flag: str):
    """``value`` (a string, or lists of them: ``nargs``, ``append``) with every string expanded;
    anything else (a flag's bool, a default None) as it is."""
    if isinstance(value, str):
        return expand_path(value, flag)
    if isinstance(value, list):
        return [_expand(v, flag) for v in value]
    return value


class ToolParser(argparse.ArgumentParser):
    """The argument parser of every tool. A flag that takes a value given twice is refused (the
    last would win without a word: ``--output a --output b`` writes only b) — except where
    repeating is its meaning (``action="append"``/``"extend"``/``"count"``); a flag without a
    value given twice is harmless and passes. Every path flag (:data:`PATH_FLAGS`) has ``~`` and
    environment variables expanded, and a list of inputs (:data:`DISTINCT_FLAGS`) names each
    entry once. Dotted config overrides (``--train.iters``) are not this parser's:
    ``config.parse_overrides`` warns when one is given twice."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        self._refuse_repeats(args)
        namespace, rest = super().parse_known_args(args, namespace)
        for action in self._actions:
            if not _is_path(action) or not hasattr(namespace, action.dest):
                continue
            value, flag = getattr(namespace, action.dest), "/".join(action.option_strings) \
                or action.dest
            try:
                setattr(namespace, action.dest, value := _expand(value, flag))
                if isinstance(value, list) and DISTINCT_FLAGS & set(action.option_strings):
                    check_distinct(flag, value)
            except UserError as err:
                self.error(str(err))
        return namespace, rest

    def _option(self, arg: str) -> tuple[argparse.Action, str] | None:
        """The action ``arg`` (``--flag``, ``--flag=value`` or, with abbreviations allowed, a
        unique prefix) gives, with the flag as declared; None for anything else."""
        if not arg.startswith(tuple(self.prefix_chars)) or arg in ("-", "--"):
            return None
        name = arg.split("=", 1)[0] if arg.startswith("--") else arg
        if name in self._option_string_actions:
            return self._option_string_actions[name], name
        if self.allow_abbrev and name.startswith("--"):
            found = {a for o, a in self._option_string_actions.items() if o.startswith(name)}
            if len(found) == 1:
                action = found.pop()
                return action, action.option_strings[-1]
        return None

    def _refuse_repeats(self, args: list[str]) -> None:
        seen: dict[str, str] = {}
        for i, arg in enumerate(args):
            if arg == "--":
                break
            found = self._option(arg)
            if found is None:
                continue
            action, flag = found
            if action.nargs == 0 or isinstance(action, (argparse._AppendAction,
                                                        argparse._AppendConstAction,
                                                        argparse._ExtendAction,
                                                        argparse._CountAction)):
                continue
            value = arg.split("=", 1)[1] if "=" in arg and arg.startswith("--") \
                else " ".join(args[i + 1:i + 2])
            if action.dest in seen:
                self.error(f"argument {flag}: given twice ({seen[action.dest]!r}, then "
                           f"{value!r}): give it once"
                           + (", with all its values after it" if action.nargs in ("+", "*")
                              else ""))
            seen[action.dest] = value
