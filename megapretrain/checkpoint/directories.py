"""Where checkpoints are and where new ones go: a run's checkpoints newest first, a path a user
names resolved to a complete checkpoint (an ``iter_*`` directory, or a run directory's newest
usable one), and the new directory a tool writes (through a temporary one renamed when whole,
never over anything, refused at once when the disk has not the room).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile

import yaml

from .. import errors
from ..errors import CheckpointError, DiskFullError, full_disk_guard, size_text
from ..user_files import check_kind
from .format import METADATA, fsync_dir, problem


def iter_dir_name(iteration: int) -> str:
    """The name of the checkpoint directory of ``iteration``: ``iter_0000100``."""
    return f"iter_{iteration:07d}"


def iteration_of(name: str) -> int | None:
    """The iteration of a checkpoint directory's name, or None for any other name."""
    return int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None


def _outside(root: str, name: str) -> str | None:
    """Why ``root/name`` is not one of this run's checkpoints (an ``iter_*`` directory directly
    inside ``root`` once every symlink is followed), or None when it is. ``latest`` is trusted to
    name only such a directory: anything else could make a run resume another run's state."""
    target = os.path.realpath(os.path.join(root, name))
    if iteration_of(os.path.normpath(name)) is None:
        return f"'{name}' ({target}) is not an iter_* directory"
    if os.path.dirname(target) != os.path.realpath(root) or iteration_of(
            os.path.basename(target)) is None:
        return f"'{name}' leads to {target}, outside this run's {root}"
    return None


def candidates(root: str) -> tuple[list[str], str | None]:
    """This run's checkpoints to try, newest first (``latest``'s, then every complete ``iter_*``
    directory inside ``root``), and a note when ``latest`` could not be followed: it names a
    missing or incomplete checkpoint, or anything but an ``iter_*`` directory of ``root`` itself
    (an absolute path elsewhere, ``../other_run/...``, a symlink leading out), which is never
    followed, so a run never resumes another run's checkpoint."""
    out, note = [], None
    pointer = os.path.join(root, "latest")
    if os.path.lexists(pointer):
        name = ""
        if os.path.islink(pointer) and os.path.dirname(os.path.realpath(pointer)) \
                != os.path.realpath(root):
            note = f"{pointer} is a symlink to {os.path.realpath(pointer)}, outside {root}; ignored"
        else:
            try:
                with open(pointer) as fh:
                    name = fh.read().strip()
            except (OSError, UnicodeDecodeError) as exc:
                note = f"{pointer} cannot be read ({exc})"
        away = _outside(root, name) if name else None
        if away:
            note = f"{pointer} names {away}; ignored (only this run's own checkpoints are resumed)"
        elif name and os.path.exists(os.path.join(root, name, METADATA)):
            out.append(os.path.join(root, os.path.normpath(name)))
        elif note is None:
            note = f"{pointer} names '{name}', which is missing or incomplete"
    done = sorted((i, d) for d in os.listdir(root) if (i := iteration_of(d)) is not None
                  and os.path.exists(os.path.join(root, d, METADATA)) and not _outside(root, d))
    out += [p for p in (os.path.join(root, d) for _, d in reversed(done)) if p not in out]
    return out, note


def latest_checkpoint(root: str) -> str | None:
    """The checkpoint ``root/latest`` names, or (when it is missing or names an incomplete one)
    the newest complete ``iter_*`` directory; None when there is none. Unchecked beyond that."""
    found = candidates(root)[0] if os.path.isdir(root) else []
    return found[0] if found else None


def resolve_checkpoint(path: str, *, check: bool = True) -> str:
    """A complete checkpoint directory from ``path``: itself, or the newest usable one under a run
    directory or its ``checkpoints/`` folder (passing over unusable ones with a warning on stderr).
    ``check``: verify sizes and checksums."""
    if os.path.exists(os.path.join(path, METADATA)):
        found = problem(path) if check else None
        if found:
            raise CheckpointError(f"{path} cannot be used: {found}")
        return path
    notes = []
    for root in (os.path.join(path, "checkpoints"), path):
        if not os.path.isdir(root):
            continue
        found_paths, note = candidates(root)
        notes += [note] if note else []
        for candidate in found_paths:
            found = problem(candidate) if check else None
            if found is None:
                for n in notes:
                    print(f"warning: {n}; using {candidate}", file=sys.stderr)
                return candidate
            notes.append(f"skipped {candidate}: {found}")
    check_checkpoint_kind("", path)  # a dataset, a Hugging Face directory, ...: say what it is
    raise CheckpointError(f"{path} is not a complete checkpoint (no metadata.json) nor a run "
                          "directory with a usable one; pass an iter_* directory"
                          + (f" ({'; '.join(notes)})" if notes else ""))


# what a megapretrain checkpoint may be given as
CHECKPOINT_KINDS = ("a megapretrain checkpoint (an iter_* directory)",
                    "a megapretrain run directory", "a megapretrain run's checkpoints/ folder")


def check_checkpoint_kind(where: str, path: str) -> None:
    """Refuse ``path`` (given as ``where``) in one line naming what it is when it is a file or
    directory of another kind the project knows: a dataset, a Hugging Face model, a config, ..."""
    fix = "pass a run directory or one of its iter_* directories"
    if os.path.isfile(os.path.join(path, "config.json")):
        fix += " (a Hugging Face model: convert it with convert_checkpoint.py from-hf first)"
    check_kind(where, path, "a megapretrain checkpoint", fix, also=CHECKPOINT_KINDS)


def owner(path: str) -> str:
    """Whose checkpoint ``path`` is, for a tool's output line: the run directory holding it and
    that run's ``run.dir`` and ``model.family`` from its ``config.yaml`` (or the config a
    conversion wrote beside it), so a checkpoint of the wrong run is visible at once. The run
    directory is shown as given unless a symlink leads elsewhere: then where it really is."""
    real = os.path.realpath(path)
    run_dir = os.path.dirname(os.path.dirname(real))
    given = os.path.dirname(os.path.dirname(os.path.normpath(path)))
    shown = given if given and os.path.realpath(given) == run_dir else run_dir
    for what, config in (("with its config beside it", os.path.join(real, "config.yaml")),
                         (f"saved by run {shown}", os.path.join(run_dir, "config.yaml"))):
        try:
            with open(config) as fh:
                tree = yaml.safe_load(fh)
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            continue
        if isinstance(tree, dict):
            run, model = tree.get("run") or {}, tree.get("model") or {}
            return (f"{what} (run.dir={run.get('dir')}, "
                    f"model.family={model.get('family', 'llama')})")
    return f"saved by run {shown} (no config.yaml found: which run is unknown)"


_ROOM_FIX = "free space or choose another --output (nothing was written)"


def check_room(path: str, needed: int) -> None:
    """Refuse, in one line, a new directory ``path`` of ``needed`` bytes that its disk has not the
    room for. A check made before anything is written (or read), and said to be one."""
    free = errors.free_bytes(path)  # of the disk it would be on
    if free is not None and needed > free:
        raise DiskFullError(f"--output {path} would need about {size_text(needed)}, its disk has "
                            f"{size_text(free)} free (checked before writing); {_ROOM_FIX}")


@contextlib.contextmanager
def new_directory(path: str, needed: int | None = None):
    """Write the new directory ``path`` through a temporary one beside it: yields the temporary
    path, which takes the final name (with the usual permissions, its files fsynced) when the block
    ends and is removed if it fails. ``path`` must not exist, or be empty: nothing is ever
    overwritten. ``needed``: the bytes it will hold, refused at once when the disk has less free; a
    disk that fills up anyway is one line naming ``path``, the bytes needed and free."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise CheckpointError(f"--output {path} exists and is not empty; choose a new directory "
                              "(nothing is ever overwritten)")
    parent = os.path.dirname(os.path.abspath(path))
    fix = _ROOM_FIX
    if needed is not None:
        check_room(path, needed)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.tmp-", dir=parent)
    try:
        with full_disk_guard(path, needed, fix):
            yield tmp
            _publish_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(parent)


def _publish_directory(tmp: str, path: str) -> None:
    """Give ``tmp``'s files (and folders: a Megatron-LM run nests ``iter_*/``) the usual
    permissions, make them durable, and rename it to ``path``."""
    umask = os.umask(0)
    os.umask(umask)
    for folder, _, files in os.walk(tmp, topdown=False):
        for name in files:
            file = os.path.join(folder, name)
            os.chmod(file, 0o666 & ~umask)
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(folder, 0o777 & ~umask)
        fsync_dir(folder)
    if os.path.isdir(path):
        os.rmdir(path)  # empty, checked above
    os.rename(tmp, path)
