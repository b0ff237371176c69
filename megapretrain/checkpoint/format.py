"""The checkpoint file format: one module writes and reads it, whoever saves or loads.

A checkpoint (format version 2) is a directory::

    metadata.json            JSON, written last: format and version, iteration, world size, layout,
                             vocabulary, every file's size and CRC-32, every tensor's global shape
    rank_00000.safetensors   one safetensors file per rank: its tensors, and its small state as
    rank_00001.safetensors   JSON in the header (``__metadata__["megapretrain.state"]``)
    ...

Nothing is ever unpickled: the tensors are raw bytes read by byte range (``tensorfile.py``), the
rest is JSON. Version 1 checkpoints (``rank_NNNNN.pt``, torch pickles of tensors) still load,
through ``torch.load(weights_only=True)``, on that legacy path only.

A rank's state (:func:`rank_state`) holds the iteration, the consumed samples, the fp32 master
weights and the optimizer state, both keyed by global parameter name, and (when saved by training)
the rank's random-number states. Each weight or moment is one :class:`Entry` (its ``tree`` is what
the state holds, in one of these forms):

- a tensor: the parameter's whole tp shard (zero 0 masters, converted or resharded weights);
- ``{"start": s, "end": e, KEY: flat}``: elements [s, e) of the flattened tp shard (zero >= 1);
- ``{KEY: tensor, ...}``: whole tp shards by key (the moments of a resharded checkpoint);
- ``{}``: nothing yet (optimizer state saved before the first step).

Every writer and reader goes through :class:`Entry`, which checks itself. In the safetensors file
a tensor is stored under its path in the state (``model/NAME``,
``optimizer/params/NAME/exp_avg``, ``rng/cpu``...) and the JSON skeleton holds
``{"__tensor__": PATH}`` in its place, so a reader can look at an entry's range before it reads any
of its bytes (:class:`RankFile`). ``FORMAT_VERSION`` grows when this changes, and ``FORMAT`` (the
name ``metadata.json`` carries) with it; a checkpoint of a newer version is refused with a message
that says so.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError, read_json_file
from . import tensorfile

FORMAT_VERSION = 2
_FAMILY = "megapretrain-per-rank-v"  # the format's name, then its version
FORMAT = f"{_FAMILY}{FORMAT_VERSION}"
LEGACY_FORMAT = f"{_FAMILY}1"  # what versions 1 and 2 were written under before: still read
METADATA = "metadata.json"
STATE_KEY = "megapretrain.state"
# required; "cp" is written too, and read as 1 where absent (older ones)
_LAYOUT_KEYS = ("tp", "pp", "dp")
# where a pipeline stage's layers sit, recorded only when not one even chunk per stage (Layout.meta)
_PLACEMENT_KEYS = ("vpp", "placement", "pipeline_layers")
_TENSOR = "__tensor__"


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through ``path.part``: flushed and fsynced, then renamed, then
    the directory fsynced, so the file is either the old one or the whole new one (a failed write,
    a full disk say, leaves no ``.part`` behind)."""
    try:
        with open(path + ".part", "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(path + ".part", path)
    except BaseException:
        _remove(path + ".part")
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# -- a rank's state --------------------------------------------------------------------------------


def rank_file(directory: str, rank: int, version: int = FORMAT_VERSION) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.{'pt' if version == 1 else 'safetensors'}")


def rank_state(*, iteration: int, consumed_samples: int, model: dict, optimizer_step: int,
               moments: dict, scaler: dict | None, rng: dict | None = None, lr_scale: float = 1.0,
               schedule: dict | None = None) -> dict:
    """One rank's checkpoint state. ``model`` and ``moments`` map parameter names to entries (see
    the module docstring; moments carry ``exp_avg`` and ``exp_avg_sq``); ``scaler`` is the loss
    scaler's state (None: a fresh one); ``rng`` the rank's random states (None: not carried);
    ``lr_scale`` the learning-rate factor rollbacks have applied so far; ``schedule`` the
    learning-rate schedule trained with (``LRSchedule.to_dict``; None: not recorded)."""
    state = {"iteration": int(iteration), "consumed_samples": int(consumed_samples), "model": model,
             "optimizer": {"step": int(optimizer_step), "params": moments, "scaler": scaler},
             "lr_scale": float(lr_scale)}
    if rng is not None:
        state["rng"] = rng
    if schedule is not None:
        state["schedule"] = schedule
    return state


@dataclass(frozen=True)
class LazyTensor:
    """A tensor of ``dtype`` and ``shape`` that ``read()`` produces when it is written: a state
    may hold these so a writer holds one tensor in memory at a time (conversion, resharding)."""
    dtype: torch.dtype
    shape: tuple
    read: Callable[[], torch.Tensor]


WEIGHT = ("master",)  # what a weight entry holds: the fp32 master
MOMENTS = ("exp_avg", "exp_avg_sq")  # what a moment entry holds: Adam's two moments
MUON_MOMENTS = ("momentum",)  # or Muon's one (optim.optimizer muon: the decoder layers' matrices)
KEYS = WEIGHT + MOMENTS + MUON_MOMENTS


def _numel(value) -> int:
    """Elements of an entry's value: a tensor or a :class:`LazyTensor` (file references are
    sized by the file that holds them: :class:`RankFile`)."""
    return value.numel() if torch.is_tensor(value) else math.prod(value.shape)


@dataclass(frozen=True)
class Entry:
    """One parameter's weight or Adam moments in a rank's state; every save and load goes
    through it (after Megatron-Core's ``ShardedTensor``: it declares what it holds and checks
    itself).

    ``name``: the parameter's global name (its key in the state); ``start``, ``end``: the
    elements ``[start, end)`` of the parameter's flattened tp shard it holds; ``values``: by key
    (``KEYS``), ``end - start`` elements each — flat, or the tp shard itself when ``whole`` — as
    tensors, :class:`LazyTensor` or, read from a file's header, references to its tensors;
    ``whole``: stored as whole tp shards, with no range. Its :meth:`tree` is how a state stores
    it (module docstring); a field added here goes into :meth:`tree` and :meth:`from_tree`
    (``tests/test_checkpoint_entry.py`` checks that every field round-trips)."""
    name: str
    start: int
    end: int
    values: dict = field(default_factory=dict)
    whole: bool = False

    @classmethod
    def of(cls, fragment, keys: tuple[str, ...], whole: bool = False) -> Entry:
        """The entry of ``keys`` of an optimizer's fragment (``optim.optimizer.FragmentState``):
        ``whole``, its tensors shaped as the tp shard (only for a fragment that is all of it)."""
        values = {k: fragment.tensors[k] for k in keys}
        if whole:
            values = {k: v.view(fragment.shape) for k, v in values.items()}
        return cls(fragment.name, fragment.start, fragment.end, values, whole)

    @classmethod
    def shards(cls, name: str, values: dict, numel=_numel) -> Entry:
        """The entry of whole tp shards: ``values`` by key (empty: nothing yet, as the moments
        of a checkpoint converted from other weights); ``numel`` sizes a value."""
        end = numel(next(iter(values.values()))) if values else 0
        return cls(name, 0, end, values, whole=True)

    def tree(self):
        """This entry as a rank's state holds it: a whole weight as its tensor, other whole
        values by key, a range as ``{"start", "end", KEY...}``."""
        if not self.whole:
            return {"start": self.start, "end": self.end, **self.values}
        return self.values["master"] if set(self.values) == {"master"} else dict(self.values)

    @classmethod
    def from_tree(cls, name: str, tree, where: str, numel=_numel) -> Entry:
        """The entry a state holds as ``tree`` under ``name``, checked (:meth:`problem`);
        ``where`` names the file (or state) in the one line a malformed entry raises; ``numel``
        sizes a value (:class:`RankFile` sizes its references from the file's header)."""
        def damaged(problem: str) -> CheckpointError:
            return CheckpointError(f"{where}: {problem}; the file is damaged (or was written by "
                                   "another program): load another checkpoint with "
                                   "--checkpoint.load")
        if torch.is_tensor(tree) or isinstance(tree, LazyTensor) or _is_ref(tree):
            tree = {"master": tree}
        if not isinstance(tree, dict):
            raise damaged(f"the entry of '{name}' is {tree!r}, not a tensor or a range of one")
        # (the oldest moments also hold torch's "step": the state's, read with it)
        values = {k: v for k, v in tree.items() if k in KEYS}
        if "start" in tree or "end" in tree:
            entry = cls(name, tree.get("start"), tree.get("end"), values)
        else:
            entry = cls.shards(name, values, numel)
        problem = entry.problem(numel)
        if problem:
            raise damaged(problem)
        return entry

    def problem(self, numel=_numel) -> str | None:
        """What is wrong with this entry on its own, or None: a range that is not one, or a
        value of another size than its range."""
        where, start, end = f"the entry of '{self.name}'", self.start, self.end
        if not (_is_int(start) and _is_int(end) and 0 <= start <= end):
            return f"{where} holds elements [{start!r}, {end!r}), which is not a range"
        for key, value in self.values.items():
            if numel(value) != end - start:
                return (f"{where} holds {numel(value)} values of {key} for its range "
                        f"[{start}, {end}) of {end - start}")
        return None

    def within(self, numel: int, where: str) -> Entry:
        """This entry, checked to be part of a tp shard of ``numel`` elements."""
        if self.end > numel:
            held = f"'{self.name}' holds elements [{self.start}, {self.end})"
            raise CheckpointError(f"{where}: {held} of a tp shard of {numel}: it was saved from "
                                  "another model (compare model.* with the config.yaml of the run "
                                  "that saved it)")
        return self

    def cut(self, key: str, start: int, end: int, shape: tuple, where: str) -> torch.Tensor:
        """Elements ``[start, end)`` of ``key`` of the flattened tp shard of ``shape``: checked
        that the entry was saved from a shard of that shape and holds those elements."""
        value, name = self.values[key], self.name
        if self.whole and tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"{where}: '{name}' has shape {tuple(value.shape)}, the model "
                                  f"expects {tuple(shape)}")
        self.within(math.prod(shape), where)
        if not (self.start <= start and end <= self.end):
            raise CheckpointError(f"{where} holds elements [{self.start}, {self.end}) of '{name}' "
                                  f"on this rank, which needs [{start}, {end}): it was saved with "
                                  "another parallel.zero or parallel.bucket_size_mb; relaunch with "
                                  "the saved ones")
        return value.reshape(-1)[start - self.start:end - self.start]


def read_entries(section: dict, where: str) -> dict[str, Entry]:
    """The entries of a loaded state's ``section`` (its ``model``, or its ``optimizer``'s
    ``params``), by name, each checked; ``where`` names the checkpoint."""
    return {name: Entry.from_tree(name, tree, where) for name, tree in section.items()}


def _split(tree, path: str, tensors: dict):
    """``tree`` with every tensor replaced by a reference to its key in ``tensors``."""
    if torch.is_tensor(tree) or isinstance(tree, LazyTensor):
        tensors[path] = tree
        return {_TENSOR: path}
    if isinstance(tree, dict):
        return {str(k): _split(v, f"{path}/{k}" if path else str(k), tensors) for k,
                v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_split(v, f"{path}/{i}", tensors) for i, v in enumerate(tree)]
    return tree


def _file_entries(state: dict) -> tuple[list, dict[str, str]]:
    """A rank state's tensors as the file's entries, in the order written, and its header
    metadata."""
    tensors: dict = {}
    skeleton = _split(state, "", tensors)
    # larger elements first: every tensor's bytes start aligned to its element size
    order = sorted(tensors, key=lambda k: -tensors[k].dtype.itemsize)
    entries = [(k, t.dtype, tuple(t.shape), t.read if isinstance(t, LazyTensor) else t)
               for k, t in ((k, tensors[k]) for k in order)]
    return entries, {STATE_KEY: json.dumps(skeleton)}


def write_rank_state(path: str, state: dict) -> tuple[int, int]:
    """Write ``state`` (its tensors may be :class:`LazyTensor`) to ``path`` through ``path.part``
    (fsynced before the rename). Returns the file's size and CRC-32 (for the metadata)."""
    entries, meta = _file_entries(state)
    try:
        size, crc = tensorfile.write(path + ".part", entries, meta)
        os.replace(path + ".part", path)
    except BaseException:  # a full disk, say: no partial file stays behind
        _remove(path + ".part")
        raise
    return size, crc


def rank_state_size(state: dict) -> int:
    """The size of the file :func:`write_rank_state` would write for ``state``, reading no tensor
    (a simulation's save: its tensors have no data)."""
    return tensorfile.file_size(*_file_entries(state))


def planned_size(state: dict) -> int:
    """The bytes of ``state``'s tensors (what :func:`write_rank_state` writes, less its header)."""
    tensors: dict = {}
    _split(state, "", tensors)
    return sum(math.prod(t.shape) * t.dtype.itemsize for t in tensors.values())


class RankFile:
    """One rank's saved state, opened without reading its tensors: its entries checked and
    described from the header (:meth:`entry`), their elements read by range (:meth:`flat`), or
    the whole state read (:meth:`load`)."""

    def __init__(self, directory: str, rank: int, version: int):
        self.path = rank_file(directory, rank, version)
        if version == 1:  # a torch pickle of tensors (weights_only), mapped: pages read on use
            self._file, self.skeleton = None, _read_v1(self.path)
        else:
            self._file = tensorfile.TensorFile(self.path)
            try:
                self.skeleton = json.loads(self._file.metadata[STATE_KEY])
            except (KeyError, json.JSONDecodeError) as exc:
                self._file.close()
                raise CheckpointError(f"{self.path} holds no readable megapretrain state ({exc}); "
                                      "it is damaged: load another checkpoint with "
                                      "--checkpoint.load") from None
        try:  # (version 1 states are torch's own objects: read as they come, as they always were)
            v2 = self._file is not None
            problem = _skeleton_problem(self.skeleton, set(self._file.keys())) if v2 else None
            if problem:
                raise CheckpointError(f"{self.path}: {problem}; the file is damaged (or was "
                                      "written by another program): load another checkpoint with "
                                      "--checkpoint.load")
            self.entries = {section: {name: Entry.from_tree(name, tree, self.path, self._numel)
                                      for name, tree in self._section(section).items()}
                            for section in ("model", "optimizer")}
            for name in self.entries["model"]:
                dtype = self.dtype(name)
                problem = dtype and tensorfile.weight_dtype_problem(name, dtype)
                if problem:
                    raise CheckpointError(f"{self.path}: {problem}; load another checkpoint with "
                                          "--checkpoint.load")
        except CheckpointError:
            self.close()
            raise

    def _section(self, section: str) -> dict:
        state = self.skeleton
        return state["model"] if section == "model" else state["optimizer"]["params"]

    def _tensor(self, ref) -> torch.Tensor:
        return ref if torch.is_tensor(ref) else self._file.get(ref[_TENSOR])

    def _numel(self, ref) -> int:
        return ref.numel() if torch.is_tensor(ref) else math.prod(self._file.shape(ref[_TENSOR]))

    def dtype(self, name: str) -> torch.dtype | None:
        """The saved dtype of parameter ``name``'s weight in this file, read from the header."""
        entry = self.entries["model"].get(name)
        ref = entry.values.get("master") if entry is not None else None
        if torch.is_tensor(ref):
            return ref.dtype
        return self._file.dtype(ref[_TENSOR]) if _is_ref(ref) else None

    def load(self) -> dict:
        """The whole state, tensors read."""
        def build(node):
            if _is_ref(node) or torch.is_tensor(node):
                return self._tensor(node)
            if isinstance(node, dict):
                return {k: build(v) for k, v in node.items()}
            if isinstance(node, list):
                return [build(v) for v in node]
            return node
        return build(self.skeleton)

    def entry(self, name: str, key: str, numel: int) -> Entry | None:
        """The entry holding ``key`` ("master", "exp_avg" or "exp_avg_sq") of parameter ``name``,
        whose tp shard has ``numel`` elements (checked), or None when this rank holds no such
        entry. Its ``values`` lack ``key`` when it holds the parameter but no values yet."""
        entry = self.entries["model" if key in WEIGHT else "optimizer"].get(name)
        return None if entry is None else entry.within(numel, f"checkpoint {self.path}")

    def flat(self, entry: Entry, key: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of ``key`` of the flattened tp shard, within ``entry``'s."""
        ref = entry.values[key]
        if torch.is_tensor(ref):
            return ref.reshape(-1)[start - entry.start:end - entry.start]
        return self._file.flat(ref[_TENSOR], start - entry.start, end - entry.start)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _skeleton_problem(skeleton, stored: set[str]) -> str | None:
    """What is wrong with a rank file's state skeleton, or None: the small fields of their types,
    every tensor it names stored in the file (its entries check themselves: :class:`Entry`)."""
    if not isinstance(skeleton, dict):
        return f"its state is {type(skeleton).__name__}, not an object"
    optimizer = skeleton.get("optimizer")
    wrong = [k for k in ("iteration", "consumed_samples") if not _is_int(skeleton.get(k))]
    wrong += [] if isinstance(skeleton.get("model"), dict) else ["model"]
    if not (isinstance(optimizer, dict) and isinstance(optimizer.get("params"), dict)
            and _is_int(optimizer.get("step"))):
        wrong.append("optimizer")
    if wrong:
        return f"its state's {', '.join(wrong)} missing or of the wrong type"
    missing = sorted(ref for ref in _refs(skeleton) if ref not in stored)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"its state names tensor '{missing[0]}'{more}, which the file does not hold"
    return None


def _refs(node):
    """Every tensor key a state skeleton refers to."""
    if _is_ref(node):
        yield node[_TENSOR]
    elif isinstance(node, dict):
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_ref(node) -> bool:
    return isinstance(node, dict) and set(node) == {_TENSOR}


def _read_v1(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is "
                              "incomplete") from None
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(exc).__name__}: "
                              f"{exc}); load an older checkpoint with --checkpoint.load") from None


def read_rank_state(directory: str, rank: int, version: int | None = None) -> dict:
    """Rank ``rank``'s whole state from checkpoint ``directory`` (``version``: read from its
    metadata when not given)."""
    if version is None:
        version = read_metadata(directory).get("format_version", 1)
    f = RankFile(directory, rank, version)
    try:
        return f.load()
    finally:
        f.close()


# -- metadata --------------------------------------------------------------------------------------


def metadata(*, iteration: int, world_size: int, layout: dict, vocab_size: int | None,
             padded_vocab: int, files: dict | None = None, tensors: dict | None = None,
             **extra) -> dict:
    """The metadata of a checkpoint saved under ``layout`` ({tp, pp, dp[, cp, vpp, placement,
    pipeline_layers]}: ``Layout.meta``) at ``world_size``;
    ``files`` maps each rank file's name to ``{"bytes", "crc32"}``, ``tensors`` each parameter's
    global name to its global shape (vocabulary unpadded); ``extra`` adds facts (where it was
    converted or resharded from, the time)."""
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "iteration": int(iteration),
            "world_size": int(world_size),
            "layout": {**{k: int(layout[k]) for k in _LAYOUT_KEYS}, "cp": int(layout.get("cp", 1)),
                       **{k: layout[k] for k in _PLACEMENT_KEYS if k in layout}},
            "vocab_size": vocab_size, "padded_vocab": int(padded_vocab)}
    if files is not None:
        meta["files"] = {k: {"bytes": int(v[0]), "crc32": int(v[1])} if isinstance(v, tuple) else v
                         for k, v in files.items()}
    if tensors is not None:
        meta["tensors"] = {k: [int(s) for s in v] for k, v in tensors.items()}
    meta.update(extra)
    return meta


def write_metadata(directory: str, meta: dict) -> None:
    """Write ``metadata.json`` (its presence marks the checkpoint complete), fsynced."""
    write_text(os.path.join(directory, METADATA), json.dumps(meta, indent=1))


def read_metadata(directory: str) -> dict:
    """The checked metadata of checkpoint ``directory``: every failure names the file and the
    fix."""
    path = os.path.join(directory, METADATA)
    meta = read_json_file(path, CheckpointError, "load another checkpoint with --checkpoint.load",
                          missing=f"not found: {directory} is not a complete checkpoint")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} holds {type(meta).__name__}, not a JSON object; load "
                              "another checkpoint")
    name = meta.get("format")
    named = name[len(_FAMILY):] if isinstance(name, str) and name.startswith(_FAMILY) else ""
    if not named.isdigit():
        raise CheckpointError(f"{path}: format {name!r} is not {FORMAT!r}; it was not written by "
                              "megapretrain (or by an incompatible version)")
    version = meta.get("format_version", 1)  # checkpoints before the version field are version 1
    newer = [v for v in (version, int(named)) if _is_int(v) and v > FORMAT_VERSION]
    if newer:
        raise CheckpointError(f"{path}: format version {newer[0]!r} is newer than this "
                              f"megapretrain reads ({FORMAT_VERSION}); upgrade megapretrain to "
                              "load it")
    if _is_int(version) and name not in (LEGACY_FORMAT, f"{_FAMILY}{version}"):
        raise CheckpointError(f"{path}: format {name!r} does not match its format_version "
                              f"{version}; the file is damaged: load another checkpoint with "
                              "--checkpoint.load")
    problems = _metadata_problems(meta, version)
    if problems:
        raise CheckpointError(f"{path}: {', '.join(problems)} missing or of the wrong type; the "
                              "file is damaged: load another checkpoint with --checkpoint.load")
    meta["layout"].setdefault("cp", 1)  # saved before cp existed: 1
    return meta


def _metadata_problems(meta: dict, version) -> list[str]:
    """The fields of a checkpoint's metadata that are missing or of the wrong type (or range)."""
    def counts(value, low: int) -> bool:
        return _is_int(value) and value >= low

    problems = [] if _is_int(version) and version >= 1 else ["format_version"]
    problems += [k for k, low in (("iteration", 0), ("world_size", 1))
                 if not counts(meta.get(k), low)]
    layout = meta.get("layout")
    if not (isinstance(layout, dict) and all(counts(layout.get(k), 1) for k in _LAYOUT_KEYS)
            and counts(layout.get("cp", 1), 1)):
        problems.append("layout")
    elif counts(meta.get("world_size"), 1) \
            and math.prod(layout.get(k, 1) for k in (*_LAYOUT_KEYS, "cp")) \
            != meta["world_size"]:
        problems.append("layout (its sizes do not multiply out to world_size)")
    files = meta.get("files")
    if (_is_int(version) and version >= 2 or files is not None) \
            and not (isinstance(files, dict) and all(
            isinstance(v, dict) and counts(v.get("bytes"), 0) and counts(v.get("crc32"), 0)
            for v in files.values())):
        problems.append("files")
    if meta.get("vocab_size") is not None and not counts(meta["vocab_size"], 1):
        problems.append("vocab_size")
    if "padded_vocab" in meta and not counts(meta["padded_vocab"], 1):
        problems.append("padded_vocab")
    tensors = meta.get("tensors")
    if tensors is not None and not (isinstance(tensors, dict) and all(
            isinstance(v, list) and all(counts(d, 0) for d in v) for v in tensors.values())):
        problems.append("tensors")
    if "sharding" in meta and not isinstance(meta["sharding"], dict):
        problems.append("sharding")
    return problems


# -- integrity -------------------------------------------------------------------------------------


def problem(directory: str, checksum_ranks: Iterable[int] | None = None) -> str | None:
    """What makes checkpoint ``directory`` unusable, or None: its metadata, every rank's file
    present at its recorded size, and the CRC-32 of the files of ``checksum_ranks`` (None: every
    rank's)."""
    try:
        meta = read_metadata(directory)
    except CheckpointError as exc:
        return str(exc)
    world, version = meta["world_size"], meta.get("format_version", 1)
    if version == 1:  # no sizes recorded: present and not empty
        for rank in range(world):
            file = rank_file(directory, rank, 1)
            if not os.path.isfile(file) or os.path.getsize(file) == 0:
                return f"{file} is missing or empty"
        return None
    files = meta["files"]
    for rank in range(world):
        name = os.path.basename(rank_file(directory, rank))
        if name not in files:
            return f"{directory}/{METADATA} lists no {name}: the checkpoint is incomplete"
    for name, info in files.items():
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        size = os.path.getsize(file)
        if size != info["bytes"]:
            return f"{file} has {size} bytes, {info['bytes']} were written: it is truncated or " \
                   "damaged"
    for rank in range(world) if checksum_ranks is None else checksum_ranks:
        file = rank_file(directory, rank)
        crc = tensorfile.file_crc32(file)
        if crc != files[os.path.basename(file)]["crc32"]:
            return f"{file} fails its checksum (CRC-32 {crc:08x}, " \
                   f"{files[os.path.basename(file)]['crc32']:08x} " \
                   "was written): it is damaged"
    return None


def _check_tied(directory: str, saved: dict, model: dict) -> None:
    """Name ``model.tie_embeddings`` when the only difference is the output layer: a tied model
    has no ``lm_head.weight`` (it reuses the embedding), an untied one has its own."""
    if ("lm_head.weight" in saved) == ("lm_head.weight" in model):
        return
    was = "lm_head.weight" not in saved  # the checkpoint's setting
    raise CheckpointError(f"checkpoint {directory} was saved with model.tie_embeddings "
                          f"{str(was).lower()} ({'no' if was else 'its own'} 'lm_head.weight'), "
                          f"the config says {str(not was).lower()}: set model.tie_embeddings: "
                          f"{str(was).lower()} in the config")


def check_shapes(directory: str, meta: dict, model: dict[str, tuple]) -> None:
    """Raise naming the first tensor where checkpoint ``directory`` (its ``meta``) and a model
    whose parameters have the global shapes ``model`` differ: one the model lacks, one the
    checkpoint lacks, or one of another shape. Every saved tensor must have a place in the model.
    Checkpoints that record no shapes (version 1) are checked tensor by tensor as they load."""
    saved = meta.get("tensors")
    if saved is None:
        return
    fix = "compare model.* with the config.yaml of the run that saved it"
    _check_tied(directory, saved, model)
    for name, shape in model.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint has no weight '{name}' (shape {tuple(shape)} in the "
                                  f"model): {directory} was saved from another model ({fix})")
        if tuple(saved[name]) != tuple(shape):
            raise CheckpointError(f"checkpoint {directory}: '{name}' has shape "
                                  f"{tuple(saved[name])}, the model expects {tuple(shape)}: it was "
                                  f"saved from another model ({fix})")
    for name, shape in saved.items():
        if name not in model:
            raise CheckpointError(f"checkpoint {directory} holds '{name}' of shape {tuple(shape)}, "
                                  "which this model has no place for: it was saved from another "
                                  f"model ({fix})")
