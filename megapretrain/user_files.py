"""Files and directories a user names, read or checked before any work: YAML text (UTF-8, no
key given twice) and the directories a run writes into. Plain helpers: they know nothing of the
config's schema, only of files, and raise :class:`~megapretrain.errors.ConfigError` naming the file.
"""

from __future__ import annotations

import codecs
import os
import tempfile

import yaml

from .errors import ConfigError


class DuplicateKey(yaml.constructor.ConstructorError):
    """A key given twice in one YAML mapping (YAML itself would keep the last one silently)."""


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in a mapping: a second ``train:`` section
    would otherwise replace the first without a word."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # '<<: *base' merges on purpose; its keys may be overridden
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: the ordinary error comes below
                    continue
                if first is not key_node.start_mark:
                    raise DuplicateKey(None, None, f"key '{key}' appears twice in one mapping "
                                                   f"(first at line {first.line + 1}); YAML would "
                                                   "keep only the second: merge them",
                                       key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What a YAML error says, on one line, with its line number when it has one."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return (f"at line {mark.line + 1}: " if mark is not None else "") + problem


_OTHER_ENCODINGS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                    (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def read_text(path: str) -> str:
    """The text of config file ``path``: UTF-8 (a byte-order mark allowed), else one line naming
    the file and what it is instead."""
    fix = "--config takes a UTF-8 YAML file, see configs/"
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' not found (see configs/ for examples)") from None
    except OSError as exc:  # a directory, no permission, ...
        raise ConfigError(f"config file '{path}' cannot be read ({exc.strerror}); {fix}") from None
    for bom, name in _OTHER_ENCODINGS:  # UTF-32's marks begin with UTF-16's: tried first
        if data.startswith(bom):
            raise ConfigError(f"config file '{path}' is {name} text: save it as UTF-8 ({fix})")
    if b"\0" in data:
        raise ConfigError(f"config file '{path}' is not a text file (it holds NUL bytes); {fix}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {exc.start}, line "
                          f"{line}): save it as UTF-8 ({fix})") from None


def not_writable_dir(path: str) -> str | None:
    """Why ``path`` cannot be a directory this process writes into, or None. Tried for real (the
    missing directories made, a file created in it, both removed again): permission bits say
    nothing for root, nor about a read-only mount or a full inode table."""
    if not str(path).strip():
        return "an empty path; give the directory to write into, e.g. runs/NAME"
    here = os.path.abspath(path)
    while not os.path.exists(here):  # the nearest part of it that exists
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        what = "is a file" if here == os.path.abspath(path) else f"cannot be made: {here} is a file"
        return f"{what}, not a directory; choose another path"
    made = []  # other ranks may probe the same path at once: what they make or remove is theirs
    try:
        for part in _missing_parts(os.path.abspath(path), here):
            try:
                os.mkdir(part)
                made.append(part)
            except FileExistsError:
                pass
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        return f"cannot be written ({exc.strerror}); choose a writable path"
    finally:
        for part in reversed(made):
            try:
                os.rmdir(part)
            except OSError:  # another rank's probe or run is inside it now
                break
    return None


def _missing_parts(path: str, existing: str) -> list[str]:
    """The directories between ``existing`` (an ancestor of ``path``) and ``path``, outermost
    first."""
    parts = []
    while path != existing:
        parts.append(path)
        path = os.path.dirname(path)
    return parts[::-1]
