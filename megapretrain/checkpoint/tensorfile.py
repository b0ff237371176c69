"""Safetensors files, written as a stream and read by byte range: no pickle, no whole-file copies.

The format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian header length N,
N bytes of JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, space-padded so the data starts 8-byte aligned) and the tensors' bytes back to back.
Files written here are ordinary safetensors (``safetensors.safe_open`` and ``transformers`` read
them), and this reader reads any safetensors file, Hugging Face shards included.

Why not the ``safetensors`` package: writing it needs every tensor in memory at once (a rank's
whole state, or a whole output shard), and its reader memory-maps files, so every byte read stays
resident in the process until the file is closed. Here a writer takes the tensors one at a time
(the header is computed from shapes and dtypes first) and computes a CRC-32 of the bytes as they
go out, and a reader copies just the byte range of the slice it is asked for into a fresh tensor
(``os.pread``): a process holds one tensor at a time, and a rank reads only the rows it owns.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterable

import numpy as np
import torch

from ..errors import CheckpointError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # as the safetensors package: a larger header is a damaged file
# bytes per write/read call (bounds the staging copy of a non-contiguous tensor)
_CHUNK = 64 * 2**20
# bytes per read of a checksum pass: its buffer is the pass's only memory (a 64 MiB one was the
# largest allocation of a to-hf of a model whose largest tensor is 31 MiB); crc32 runs as fast
_CRC_CHUNK = 4 * 2**20


def weight_dtype_problem(name: str, dtype: torch.dtype) -> str | None:
    """Why a stored weight cannot be read as one, or None: weights are floating point. An integer
    tensor (a quantized export's int8/uint8/int32 codes) has the right size but not the meaning of
    a weight, so reading it as floats would give a model of garbage without an error."""
    if dtype.is_floating_point:
        return None
    return (f"tensor '{name}' is {str(dtype).removeprefix('torch.')}, but weights must be floating "
            "point (a quantized export? use the unquantized float16/bfloat16/float32 weights)")


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (no copy for a contiguous CPU tensor)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def _head(entries: list, metadata: dict[str, str] | None) -> tuple[bytes, int]:
    """The file's first bytes (length and JSON header) for ``entries``, and their data's bytes."""
    header, offset = {}, 0
    for name, dtype, shape, _ in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, offset


def file_size(entries: Iterable[tuple[str, torch.dtype, tuple, object]],
              metadata: dict[str, str] | None = None) -> int:
    """The bytes :func:`write` would write for ``entries`` and ``metadata``, reading no tensor."""
    head, data = _head(list(entries), metadata)
    return len(head) + data


def write(path: str, entries: Iterable[tuple[str, torch.dtype, tuple,
                                             Callable[[], torch.Tensor] | torch.Tensor]],
          metadata: dict[str, str] | None = None) -> tuple[int, int]:
    """Write a safetensors file at ``path`` from ``entries``: (name, dtype, shape, tensor or a
    function returning it), produced and written one at a time in the given order. The file is
    flushed and fsynced before this returns. Returns (size in bytes, CRC-32 of the whole file)."""
    entries = list(entries)
    head, _ = _head(entries, metadata)
    crc, size = zlib.crc32(head), len(head)
    with open(path, "wb") as fh:
        fh.write(head)
        for name, dtype, shape, get in entries:
            tensor = get() if callable(get) else get
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{path}: '{name}' was declared {dtype} {tuple(shape)} but is "
                                 f"{tensor.dtype} {tuple(tensor.shape)}")
            data = _bytes_of(tensor)
            for start in range(0, data.size, _CHUNK):
                chunk = memoryview(data[start:start + _CHUNK])
                fh.write(chunk)
                crc = zlib.crc32(chunk, crc)
            size += data.size
        fh.flush()
        os.fsync(fh.fileno())
    return size, crc


def file_crc32(path: str) -> int:
    """CRC-32 of a whole file, read in chunks (page cache, not process memory)."""
    crc = 0
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(_CRC_CHUNK)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


class TensorFile:
    """A safetensors file opened for reading by byte range; tensors are copied out on request."""

    def __init__(self, path: str):
        self.path, self._fd = path, -1
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing") from None
        except OSError as exc:
            raise CheckpointError(f"{path} cannot be opened ({exc.strerror})") from None
        size = os.fstat(self._fd).st_size
        try:
            (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
            if not 0 < n <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {n}")
            header = json.loads(os.pread(self._fd, n, 8))
            self.metadata = header.pop("__metadata__", {}) or {}
            self._data = 8 + n
            end = 0
            for name, info in header.items():
                begin, stop = info["data_offsets"]
                nbytes = math.prod(info["shape"]) * torch.empty(
                    (), dtype=DTYPES[info["dtype"]]).element_size()
                if stop - begin != nbytes or stop + self._data > size:
                    raise ValueError(f"'{name}' spans bytes [{begin}, {stop}) of a "
                                     f"{size - self._data}-byte body")
                end = max(end, stop)
        except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            self.close()
            raise CheckpointError(f"{path} is not a readable safetensors file ({exc}); it is "
                                  "truncated or damaged") from None
        self.header = header

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.header[name]["dtype"]]

    def nbytes(self, name: str) -> int:
        begin, end = self.header[name]["data_offsets"]
        return end - begin

    def _read_into(self, out: torch.Tensor, offset: int) -> None:
        view = _bytes_of(out)  # out is a fresh contiguous tensor: this views its memory
        done = 0
        while done < view.size:
            got = os.preadv(self._fd, [memoryview(view[done:done + _CHUNK])],
                            self._data + offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path} ends early: it is truncated")
            done += got

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (a fresh, writable CPU tensor)."""
        shape = self.shape(name)
        return self.flat(name, 0, math.prod(shape)).view(shape)

    def flat(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``name`` flattened, reading only their bytes."""
        if name not in self.header:
            raise CheckpointError(f"{self.path} has no tensor '{name}'")
        numel, dtype = math.prod(self.shape(name)), self.dtype(name)
        if not 0 <= start <= end <= numel:
            raise CheckpointError(f"{self.path}: elements [{start}, {end}) of '{name}' ({numel}) "
                                  "are out of range")
        out = torch.empty(end - start, dtype=dtype)
        self._read_into(out, self.header[name]["data_offsets"][0] + start * out.element_size())
        return out

    def narrow(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        """``tensor.narrow(dim, start, length)`` of tensor ``name``: along dimension 0 only those
        rows' bytes are read; along another dimension the whole tensor (one input tensor at
        most)."""
        shape = self.shape(name)
        if dim == 0:
            row = math.prod(shape[1:])
            return self.flat(name, start * row, (start + length) * row).view(length, *shape[1:])
        return self.get(name).narrow(dim, start, length).contiguous()
