"""What every entry point shares: argument types for the tools' command lines, so a bad number is
one argparse line (``tool.py: error: argument --workers: 0 is not a positive integer``), never a
division by zero or a crash deep inside; and the one printer of bad input, so a
:class:`~megapretrain.errors.UserError` is one ``error: MESSAGE`` line on stderr and exit status 2
in every tool and in training."""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable

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
