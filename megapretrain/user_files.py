"""Files and directories a user names, read or checked before any work: YAML text (UTF-8, no
key given twice) and the directories a run writes into. Plain helpers: they know nothing of the
config's schema, only of files, and raise :class:`~megapretrain.errors.ConfigError` naming the file.
"""

from __future__ import annotations

import codecs
import errno
import os
import re
import tempfile

import yaml

from .errors import ConfigError, WrongKindError


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
    """Why ``path`` cannot be a directory this process writes into, or None. Tried for real (a
    file created in the nearest directory of it that exists, and removed; the missing
    directories' names checked against the file system's limit): permission bits say nothing for
    root, nor about a read-only mount or a full inode table. No directory is made: probes of
    several processes at once (ranks, dry runs started together) cannot remove one another's
    parent or leave one behind."""
    if not str(path).strip():
        return "an empty path; give the directory to write into, e.g. runs/NAME"
    for tries_left in reversed(range(8)):
        try:
            return _probe(os.path.abspath(path))
        except FileNotFoundError as exc:  # the directory found went before the file was made
            if not tries_left:
                return f"cannot be written ({exc.strerror}); choose a writable path"


def _probe(path: str) -> str | None:
    """One try of ``not_writable_dir``; FileNotFoundError when a parent vanished mid-way."""
    here = path
    while not os.path.exists(here):  # the nearest part of it that exists
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        what = "is a file" if here == path else f"cannot be made: {here} is a file"
        return f"{what}, not a directory; choose another path"
    try:
        longest = os.pathconf(here, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    for part in _missing_parts(path, here):
        if len(os.fsencode(os.path.basename(part))) > longest:
            return (f"cannot be made ({os.strerror(errno.ENAMETOOLONG)}: "
                    f"{os.path.basename(part)[:20]}... is over {longest} bytes); choose a "
                    "shorter path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=here)
        os.close(fd)
        os.remove(probe)
    except FileNotFoundError:
        raise
    except OSError as exc:
        return f"cannot be written ({exc.strerror}); choose a writable path"
    return None


def _missing_parts(path: str, existing: str) -> list[str]:
    """The directories between ``existing`` (an ancestor of ``path``) and ``path``, outermost
    first."""
    parts = []
    while path != existing:
        parts.append(path)
        path = os.path.dirname(path)
    return parts[::-1]


# -- what a path is --------------------------------------------------------------------------------

# The files and directories the project knows, by what marks them (their owners: the checkpoint
# format, the indexed dataset, the Hugging Face, Megatron-LM and torchtitan converters, the run
# directory); read here only to name a path given where another kind belongs.
_DIRECTORY_KINDS = (  # (a file inside it, what the directory is)
    ("metadata.json", "a megapretrain checkpoint (an iter_* directory)"),
    ("checkpoints", "a megapretrain run directory"),
    ("latest", "a megapretrain run's checkpoints/ folder"),
    ("config.json", "a Hugging Face model directory"),
    ("latest_checkpointed_iteration.txt", "a Megatron-LM checkpoint directory"),
    (".metadata", "a torchtitan (DCP) checkpoint"),
)
MEGATRON_ITER = "a Megatron-LM checkpoint (an iter_* directory)"
DATASET = "a tokenized dataset prefix (.bin/.idx)"
# what a path may be where a kind is wanted without being another kind the project knows
UNKNOWN_KINDS = ("a directory", "a text file", "a file", "a binary file")


def describe_path(path: str) -> str | None:
    """What ``path`` is, in words, as the project knows files (``"a tokenized dataset prefix
    (.bin/.idx)"``, ``"a megapretrain run directory"``, ``"an empty file"``, ...), or None when
    nothing is there. For an error that names the wrong kind a user gave."""
    if os.path.isdir(path):
        if _names_a_backend(os.path.join(path, "metadata.json")):
            return MEGATRON_ITER  # its metadata.json names a sharded_backend (torch_dist, ...)
        for marker, kind in _DIRECTORY_KINDS:
            if os.path.exists(os.path.join(path, marker)):
                return kind
        return "a directory"
    if os.path.isfile(path):
        return _describe_file(path)
    if os.path.isfile(path + ".idx") and os.path.isfile(path + ".bin"):
        return DATASET
    return None


def _names_a_backend(metadata: str) -> bool:
    """Whether ``metadata`` is a Megatron-LM checkpoint's ``metadata.json`` (it names the
    ``sharded_backend``), not a megapretrain checkpoint's."""
    try:
        with open(metadata, "rb") as fh:
            return b'"sharded_backend"' in fh.read(4096)
    except OSError:
        return False


def _describe_file(path: str) -> str:
    name = os.path.basename(path)
    if os.path.getsize(path) == 0:
        return "an empty file"
    if name.endswith((".bin", ".idx")):
        return f"a tokenized dataset's .{name.rsplit('.', 1)[1]} file"
    if name.endswith(".safetensors"):
        return "a checkpoint's rank file (safetensors)" if name.startswith("rank_") else \
            "a safetensors weights file"
    if name.endswith((".yaml", ".yml")):
        return "a YAML file"
    try:
        with open(path, "rb") as fh:
            head = fh.read(65536)
    except OSError:
        return "a file"
    if b"\0" in head:
        return "a binary file"
    first = head.split(b"\n", 1)[0].strip()
    if first.startswith(b"{"):
        if name == "metrics.jsonl" or re.match(rb'\{"(iter|event)"', first):
            return "a run's metrics.jsonl"
        if b'"choices"' in first:
            return "a task file (JSONL)"
        return "a JSON lines file" if name.endswith(".jsonl") or b"\n{" in head else "a JSON file"
    return "a text file"


def not_the_kind(path: str, wanted: str, also: tuple[str, ...] = ()) -> str | None:
    """``"PATH is <what it is>, not <wanted>"`` when ``path`` is a kind of file the project knows
    other than ``wanted`` (e.g. ``"a checkpoint"``) and the kinds in ``also`` that pass for it,
    else None (nothing there, or nothing known: the caller's own message says what is missing)."""
    kind = describe_path(path)
    if kind is None or kind in UNKNOWN_KINDS or kind in also:
        return None
    return f"{path} is {kind}, not {wanted}"


def check_kind(where: str, path: str, wanted: str, fix: str, also: tuple[str, ...] = ()) -> None:
    """Refuse ``path``, given as ``where`` (a flag or a field), when it is a kind of file the
    project knows other than ``wanted`` (and the kinds in ``also``): one line naming what it is
    and ``fix``. Anything else passes: the reader's own message says what is missing."""
    other = not_the_kind(path, wanted, also)
    if other:
        raise WrongKindError(f"{where} {other}: {fix}".lstrip())
