"""What every entry point shares: argument types for the tools' command lines, so a bad number is
one argparse line (``tool.py: error: argument --workers: 0 is not a positive integer``), never a
division by zero or a crash deep inside; and the one printer of bad input, so a
:class:`~megapretrain.errors.UserError` is one ``error: MESSAGE`` line on stderr and exit status 2
in every tool and in training."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from .errors import UserError

USER_ERROR_EXIT = 2  # the exit status of bad input


def print_error(message: object) -> None:
    """Print the one line an entry point gives for bad input or a failure it names."""
    print(f"error: {message}", file=sys.stderr)


def user_errors(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """``main(argv)`` that prints a :class:`UserError` as one line and returns 2; any other exception
    is a bug and keeps its traceback."""
    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except UserError as err:
            print_error(err)
            return USER_ERROR_EXIT
    return run


def _number(kind, low: float, inclusive: bool, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value
    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive_int = _number(int, 1, True, "a positive integer")
non_negative_int = _number(int, 0, True, "a non-negative integer")
positive_float = _number(float, 0.0, False, "a positive number")
non_negative_float = _number(float, 0.0, True, "a non-negative number")
