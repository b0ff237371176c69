"""The one family of user-facing errors.

Anything the user controls — a config field, a data file, a checkpoint, a layout, a tool's flag —
raises a :class:`UserError` whose message is one line naming the field or file, the rule and the
fix. Entry points and tools catch ``UserError`` alone and print that line (exit status 2); every
other exception is a bug and keeps its traceback.

``UserError`` derives from ``ValueError`` so code that already catches ``ValueError`` around a
library call keeps working; the converse does not hold: a plain ``ValueError`` is never shown as
bad input.
"""

from __future__ import annotations

import json


class UserError(ValueError):
    """Bad input; the message is one line that says what is wrong and what to do."""


class ConfigError(UserError):
    """A config field (or a combination of fields) that cannot work."""


class DataError(UserError):
    """A dataset, tokenizer or input file that cannot be used."""


class MissingFileError(DataError, FileNotFoundError):
    """A file or directory the user named does not exist."""


class MissingPackageError(UserError, ImportError):
    """An optional package the chosen feature needs is not installed."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used."""


class PipelineError(UserError):
    """An impossible pipeline layout or schedule."""


def require(ok: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``ok``: a config rule, stated where it lives."""
    if not ok:
        raise ConfigError(message)


def divisors(n: int) -> str:
    """``n``'s divisors, as a message offers them: ``parallel.tp=3 must divide 32 (valid: 1, 2, 4, ...)``."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def read_json_file(path: str, error: type[UserError], fix: str, missing: str = "not found"):
    """The JSON value in ``path``; a missing or unreadable file raises ``error`` naming it, what is
    wrong (``missing`` for an absent file) and ``fix``."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise error(f"{path} {missing}; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path} cannot be read as JSON ({exc}); {fix}") from None
