"""Streaming readers for raw corpora, used by tools/preprocess_data.py.

Formats: JSON lines (plain, ``.gz``, ``.zst``), parquet (one text column per key), plain text (one
document per file, or per blank-line-separated block), and Hugging Face ``datasets`` (a directory
saved with ``save_to_disk``, or a builder such as ``json`` with ``data_files``; optionally
streamed).

Every reader yields ``Chunk``s of a bounded number of records and bytes, lazily, so memory does not
grow with the corpus. A chunk's items are left as raw as possible so that the expensive part (JSON
parsing) happens in the worker processes: a JSON line stays ``bytes``; other formats give a tuple
with one text per key; a record that cannot be read is a ``Bad`` problem description.
"""

from __future__ import annotations

import glob
import gzip
import io
import os
import sys
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..errors import DataError, MissingFileError
from ..user_files import check_kind

FORMATS = ("jsonl", "parquet", "text")
CHUNK_BYTES = 1 << 18  # cap on the raw bytes in one chunk: long documents make smaller chunks


class Bad(str):
    """A record that could not be read, as a one-phrase description of what is wrong with it."""


@dataclass(frozen=True)
class Source:
    """One input file, or the byte range ``[start, end)`` of one (a partition of a plain file)."""

    path: str
    format: str
    start: int = 0
    end: int | None = None


@dataclass
class Chunk:
    """Records of one source: ``numbers[i]`` is item i's 1-based line (or row) within the source's
    range."""

    source: Source
    numbers: Sequence[int]
    items: list = field(default_factory=list)
    nbytes: int = 0
    unit: str = "line"


def detect_format(path: str) -> str:
    """jsonl, parquet or text, from the file name (compression suffixes ignored)."""
    name = path.lower()
    for suffix in (".gz", ".zst"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def discover(inputs: Sequence[str], input_format: str = "auto") -> list[Source]:
    """Expand files, directories (recursively, sorted, hidden entries skipped) and glob patterns."""
    sources, seen = [], {}
    for item in inputs:
        matches = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
        if not matches:
            raise MissingFileError(f"--input {item}: no file matches")
        for path in matches:
            check_kind("--input", path, "a corpus", "give JSON lines, text or parquet files (or "
                       "a directory of them)", also=("a JSON lines file", "a JSON file",
                                                     "a YAML file", "an empty file"))
            if os.path.isdir(path):
                paths = _files_under(path)
                if not paths:
                    raise MissingFileError(f"--input {path}: the directory holds no files")
            elif os.path.isfile(path):
                paths = [path]
            else:
                raise MissingFileError(f"--input {path}: no such file or directory")
            for p in paths:
                first = seen.setdefault(os.path.realpath(p), p)
                if first != p or any(s.path == p for s in sources):
                    also = f" (also as {first})" if first != p else ""
                    raise DataError(f"--input: {p} is given twice{also}; every document in it "
                                    "would be tokenized twice: name each file once")
            sources += [Source(p, detect_format(p) if input_format == "auto" else input_format)
                        for p in paths]
    return sources


def _files_under(directory: str) -> list[str]:
    """Files under a directory in a fixed order (sorted names, depth first), hidden ones skipped."""
    files = []
    for parent, subdirs, names in os.walk(directory):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        files += [os.path.join(parent, n) for n in sorted(names) if not n.startswith(".")]
    return files


def split_for_partitions(sources: list[Source], partitions: int) -> list[list[Source]]:
    """Cut the sources into ``partitions`` groups of about equal bytes, keeping input order.

    With fewer files than partitions, uncompressed JSON-lines files are cut into byte ranges (each
    partition owns the lines that start inside its range); other files stay whole.
    """
    if partitions <= 1:
        return [sources]
    pieces: list[Source] = []
    for source in sources:
        size = os.path.getsize(source.path)
        splittable = source.format == "jsonl" and not source.path.endswith((".gz", ".zst"))
        if len(sources) >= partitions or not splittable or size < partitions:
            pieces.append(source)
            continue
        bounds = [size * k // partitions for k in range(partitions + 1)]
        pieces += [Source(source.path, source.format, bounds[k], bounds[k + 1])
                   for k in range(partitions)]
    sizes = [(p.end if p.end is not None else os.path.getsize(p.path)) - p.start for p in pieces]
    total, groups, current, filled = sum(sizes) or 1, [], [], 0
    for piece, size in zip(pieces, sizes):
        current.append(piece)
        filled += size
        if filled * partitions >= total * (len(groups) + 1) and len(groups) < partitions - 1:
            groups.append(current)
            current = []
    groups.append(current)
    return [g for g in groups if g]


def lines_before(path: str, offset: int) -> int:
    """Newlines in the first ``offset`` bytes of a file (turns a partition's line numbers into the
    file's)."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(offset, 1 << 24))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


def open_binary(path: str) -> io.BufferedIOBase:
    """Open a plain, .gz or .zst file for reading bytes."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard  # optional; preprocess_data checks it is installed before reading

        # read_across_frames: files from parallel compressors (pzstd, zstd -T) hold many frames.
        reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"),
                                                            read_across_frames=True, closefd=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)
    return open(path, "rb", buffering=1 << 20)


def read_chunks(source: Source, keys: Sequence[str], chunk_size: int, text_mode: str = "file",
                chunk_bytes: int = CHUNK_BYTES) -> Iterator[Chunk]:
    """The records of one source, ``chunk_size`` at most (and about ``chunk_bytes``) per chunk. A
    file that cannot be read through (a truncated or fake .gz/.zst, a damaged parquet file) is one
    DataError naming it and how far it was read."""
    last, unit = 0, "line"
    try:
        for chunk in _read_chunks(source, keys, chunk_size, text_mode, chunk_bytes):
            last, unit = (chunk.numbers[-1] if len(chunk.numbers) else last), chunk.unit
            yield chunk
    except _read_errors() as exc:
        where = f"after {unit} {last}" if last else "at its start"
        raise DataError(f"{source.path}: cannot be read {where} ({type(exc).__name__}: {exc}); the "
                        "file is truncated, damaged or not what its name says: re-download or "
                        "re-create it") from None


def _read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged file raises: the standard library's, and the optional readers' when
    loaded."""
    errors: list = [EOFError, OSError, zlib.error]
    zstd, arrow = sys.modules.get("zstandard"), sys.modules.get("pyarrow")
    if zstd is not None:
        errors.append(zstd.ZstdError)
    if arrow is not None:
        errors.append(arrow.ArrowException)
    return tuple(errors)


def _read_chunks(source: Source, keys: Sequence[str], chunk_size: int, text_mode: str,
                 chunk_bytes: int) -> Iterator[Chunk]:
    if source.format == "jsonl":
        yield from _batched(source, _json_lines(source), chunk_size, chunk_bytes)
    elif source.format == "parquet":
        yield from _parquet_chunks(source, keys, chunk_size)
    elif source.format == "text":
        records = _whole_file(source, len(keys)) if text_mode == "file" \
            else _text_blocks(source, len(keys))
        yield from _batched(source, records, chunk_size, chunk_bytes)
    else:
        raise DataError(f"{source.path}: unknown input format {source.format!r}; valid: "
                        f"{', '.join(FORMATS)}")


def _batched(source: Source, records: Iterator[tuple[int, object, int]], chunk_size: int,
             chunk_bytes: int, unit: str = "line") -> Iterator[Chunk]:
    """Group (number, item, bytes) records into chunks; a chunk also ends once it holds chunk_bytes
    (with very long documents, equal record counts would make some tasks far longer than others)."""
    chunk = Chunk(source, [], unit=unit)
    for number, item, size in records:
        chunk.numbers.append(number)
        chunk.items.append(item)
        chunk.nbytes += size
        if len(chunk.items) >= chunk_size or chunk.nbytes >= chunk_bytes:
            yield chunk
            chunk = Chunk(source, [], unit=unit)
    if chunk.items:
        yield chunk


def _lines(source: Source) -> Iterator[tuple[int, bytes]]:
    """(1-based line number within the range, line) for the lines that start in the source's
    range."""
    with open_binary(source.path) as f:
        position = source.start
        if source.start > 0:
            f.seek(source.start - 1)
            # the range starts inside a line: it belongs to the previous range
            if f.read(1) != b"\n":
                position += len(f.readline())
        for number, line in enumerate(f, 1):
            if source.end is not None and position >= source.end:
                return
            position += len(line)
            yield number, line


def _json_lines(source: Source) -> Iterator[tuple[int, object, int]]:
    for number, line in _lines(source):
        if line.strip():  # blank lines (a trailing newline, say) are not records
            yield number, line, len(line)


def _text_blocks(source: Source, num_keys: int) -> Iterator[tuple[int, object, int]]:
    """Documents separated by blank lines; a block with invalid UTF-8 is one Bad record."""
    block: list[str] = []
    first, size, problem = 0, 0, None
    for number, raw in _lines(source):
        if not raw.strip():
            if block or problem:
                yield first, problem or ("".join(block).rstrip("\r\n"),) * num_keys, size
            block, size, problem = [], 0, None
            continue
        if not block and problem is None:
            first = number
        size += len(raw)
        try:
            block.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            problem = Bad(f"not valid UTF-8 (byte {e.start} of line {number})")
    if block or problem:
        yield first, problem or ("".join(block).rstrip("\r\n"),) * num_keys, size


def _whole_file(source: Source, num_keys: int) -> Iterator[tuple[int, object, int]]:
    with open_binary(source.path) as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        yield line, Bad(f"not valid UTF-8 (byte {e.start}, line {line})"), len(data)
        return
    yield 1, (text,) * num_keys, len(data)


def _texts(row: Sequence, keys: Sequence[str]) -> object:
    """One record's texts, or Bad when a value is missing or not a string."""
    for key, value in zip(keys, row):
        if not isinstance(value, str):
            return Bad(f"key {key!r} holds {type(value).__name__}, expected a string")
    return tuple(row)


def _parquet_chunks(source: Source, keys: Sequence[str], chunk_size: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(source.path)
    missing = [k for k in keys if k not in table.schema_arrow.names]
    if missing:
        raise DataError(f"{source.path}: no column {missing[0]!r} (columns: "
                        f"{', '.join(table.schema_arrow.names)}); choose the text column with "
                        "--json-keys")
    row = 0
    for batch in table.iter_batches(batch_size=chunk_size, columns=list(keys)):
        columns = [batch.column(k).to_pylist() for k in keys]
        items = [_texts(values, keys) for values in zip(*columns)]
        nbytes = sum(len(t) for item in items if isinstance(item, tuple) for t in item)
        yield Chunk(source, range(row + 1, row + 1 + len(items)), items, nbytes, unit="row")
        row += len(items)


def read_hf_chunks(name: str, split: str, keys: Sequence[str], chunk_size: int,
                   streaming: bool = False,
                   data_files: Sequence[str] | None = None) -> Iterator[Chunk]:
    """Records of a Hugging Face dataset: a ``save_to_disk`` directory, or a builder (``json``,
    ``parquet``, ``text``, a local script or dataset directory) loaded with ``load_dataset``."""
    import datasets

    if os.path.isdir(name) and any(os.path.exists(os.path.join(name, f)) for f in
                                   ("state.json", "dataset_dict.json", "dataset_info.json")):
        dataset = datasets.load_from_disk(name)
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise DataError(f"--hf-dataset {name}: no split {split!r} (splits: "
                                f"{', '.join(dataset)})")
            dataset = dataset[split]
        if streaming:
            dataset = dataset.to_iterable_dataset()
    else:
        dataset = datasets.load_dataset(name, split=split, streaming=streaming,
                                        data_files=list(data_files) if data_files else None)
    columns = dataset.column_names
    if columns is not None:
        missing = [k for k in keys if k not in columns]
        if missing:
            raise DataError(f"--hf-dataset {name}: no column {missing[0]!r} (columns: "
                            f"{', '.join(columns)}); choose the text column with --json-keys")
    source = Source(f"{name}[{split}]", "hf")
    row = 0
    for batch in dataset.iter(batch_size=chunk_size):
        values = [batch.get(k, [None] * len(next(iter(batch.values())))) for k in keys]
        items = [_texts(record, keys) for record in zip(*values)]
        nbytes = sum(len(t) for item in items if isinstance(item, tuple) for t in item)
        yield Chunk(source, range(row + 1, row + 1 + len(items)), items, nbytes, unit="row")
        row += len(items)
