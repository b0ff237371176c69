"""Validating argument types for the tools' command lines: a bad number is one argparse line
(``tool.py: error: argument --workers: 0 is not a positive integer``), never a division by zero
or a crash deep inside."""

from __future__ import annotations

import argparse


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
