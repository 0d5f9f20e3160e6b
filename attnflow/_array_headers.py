"""What an array file declares, read before any of its data.

Each array in a ``.npy``, ``.npz`` or ``.safetensors`` file is described by an
:class:`ArrayEntry`: its header (name, shape, dtype, stored dtype, size) and a function
that loads its data. Headers are parsed without reading data (inside an ``.npz`` only the
first bytes of each member are inflated), so that a caller can refuse a shape, a dtype or
a size, a decompression bomb included, before a byte of it is held in memory. Nothing here
ever unpickles.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

__all__ = ["ArrayEntry", "ArrayFileError", "ArrayHeader", "open_entries"]

_SAFETENSORS_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # stored bits; handed out widened to float32 (exactly)
    "BOOL": np.dtype("?"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}
_STORED_NAMES = {"BF16": "bfloat16"}
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
_MAX_NPY_HEADER = 10_000  # NumPy's own default limit for untrusted headers
BOMB_SIZE = 256 * 2**20
"""A compressed ``.npz`` member inflating to more than this (256 MiB)..."""
BOMB_RATIO = 100
"""...at more than this many times its compressed size is refused as a decompression bomb.

Attention weights, scores and gradients are floats that compress a few times at most (a
causal mask's zeros: about 2x); a ratio of 100 is nearly all one value. A genuine array of
the kind is accepted from an uncompressed ``.npz`` (``np.savez``), whose size is its own.
"""


class ArrayFileError(ValueError):
    """A file that cannot be read as the arrays asked for; its message is one line."""


@dataclass(frozen=True)
class ArrayHeader:
    """One array as its file declares it, known before its data is read.

    Attributes
    ----------
    name : str
        Its name in the file ("array" for a ``.npy`` file).
    shape : tuple of int
        Its shape.
    dtype : numpy.dtype
        The dtype it is handed out in (bfloat16 is widened to float32, exactly).
    stored : str
        The dtype it is stored in ("bfloat16", "float16", ...): the precision of its values.
    compressed : int or None
        The bytes its data takes compressed in the file (an ``.npz`` member written by
        ``savez_compressed``), None where it is stored as it is.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    stored: str
    compressed: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of memory the array takes once loaded."""
        return math.prod(self.shape) * self.dtype.itemsize

    def check_inflation(self, path: Path) -> None:
        """Refuse a compressed array that inflates like a decompression bomb.

        More than :data:`BOMB_SIZE` bytes at more than :data:`BOMB_RATIO` times its
        compressed size: nearly all one value, never real attention or scores.
        """
        if (
            self.compressed is not None
            and self.nbytes > BOMB_SIZE
            and self.nbytes > BOMB_RATIO * self.compressed
        ):
            msg = (
                f"{path}: array {self.name!r} declares shape {self.shape} and dtype "
                f"{self.dtype}, {self.nbytes / 2**20:,.0f} MiB inflated from "
                f"{self.compressed / 2**20:,.2g} MiB compressed "
                f"({self.nbytes // max(self.compressed, 1):,} times): refused as a likely "
                "decompression bomb. If the array is genuine, save it uncompressed "
                "(numpy.savez, not savez_compressed)"
            )
            raise ArrayFileError(msg)


@dataclass(frozen=True)
class ArrayEntry:
    """An array's header and the function that reads its data."""

    header: ArrayHeader
    load: Callable[[], np.ndarray]


def _refuse_objects(path: Path, name: str, dtype: np.dtype[Any]) -> None:
    if dtype.hasobject:
        msg = (
            f"{path}: array {name!r} holds Python objects (pickled data); attnflow never "
            "unpickles (it can run code). Save plain numeric arrays."
        )
        raise ArrayFileError(msg)


def _npy_header(stream: IO[bytes], path: Path, name: str) -> tuple[tuple[int, ...], bool, Any]:
    """Parse a ``.npy`` header from `stream`: shape, Fortran order and dtype."""
    try:
        version = np.lib.format.read_magic(stream)
    except (ValueError, EOFError) as error:
        where = str(path) if name == "array" else f"{path}: {name!r}"
        msg = (
            f"{where} is not a plain NumPy array file: it holds pickled data or is no NumPy "
            f"file at all ({error}); attnflow never unpickles (it can run code)"
        )
        raise ArrayFileError(msg) from None
    try:
        if version == (1, 0):
            header = np.lib.format.read_array_header_1_0(stream, max_header_size=_MAX_NPY_HEADER)
        elif version == (2, 0):
            header = np.lib.format.read_array_header_2_0(stream, max_header_size=_MAX_NPY_HEADER)
        else:
            msg = f"{path}: array {name!r} uses .npy format {version}; attnflow reads 1.0 and 2.0"
            raise ArrayFileError(msg)
    except ArrayFileError:
        raise
    except (ValueError, EOFError, OSError, zipfile.BadZipFile) as error:
        msg = f"{path}: {name!r} is not a NumPy array (its .npy header is unreadable: {error})"
        raise ArrayFileError(msg) from None
    shape, fortran, dtype = header
    _refuse_objects(path, name, dtype)
    return tuple(int(d) for d in shape), bool(fortran), dtype


def _npy_entries(path: Path) -> dict[str, ArrayEntry]:
    with path.open("rb") as file:
        shape, fortran, dtype = _npy_header(file, path, "array")
        offset = file.tell()
    header = ArrayHeader("array", shape, dtype, dtype.name)
    available = path.stat().st_size - offset
    if available < header.nbytes:
        msg = (
            f"{path} is truncated: its header declares shape {shape} and dtype {dtype} "
            f"({header.nbytes} bytes) but it holds {available} bytes of data"
        )
        raise ArrayFileError(msg)

    def load() -> np.ndarray:
        if header.nbytes == 0:
            return np.empty(shape, dtype=dtype)  # an empty map is an error
        # A read-only map, then one copy: exactly the declared bytes are read.
        mapped = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape,
                           order="F" if fortran else "C")  # fmt: skip
        return np.array(mapped)

    return {"array": ArrayEntry(header, load)}


def _npz_entries(path: Path) -> dict[str, ArrayEntry]:
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        msg = f"{path} is not a readable .npz file: it is truncated or not a zip archive ({error})"
        raise ArrayFileError(msg) from None
    entries: dict[str, ArrayEntry] = {}
    with archive:
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                continue
            name = info.filename[: -len(".npy")]
            try:
                with archive.open(info) as member:
                    shape, _, dtype = _npy_header(member, path, name)
            except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError) as error:
                msg = f"{path}: member {info.filename!r} is unreadable ({error})"
                raise ArrayFileError(msg) from None
            compressed = None if info.compress_type == zipfile.ZIP_STORED else info.compress_size
            header = ArrayHeader(name, shape, dtype, dtype.name, compressed)
            if info.file_size < header.nbytes:
                msg = (
                    f"{path}: array {name!r} declares shape {shape} and dtype {dtype} "
                    f"({header.nbytes} bytes) but its member holds {info.file_size} bytes"
                )
                raise ArrayFileError(msg)
            entries[name] = ArrayEntry(header, _npz_loader(path, info.filename, name))
    return entries


def _npz_loader(path: Path, member: str, name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        try:
            with zipfile.ZipFile(path) as archive, archive.open(member) as stream:
                array = np.lib.format.read_array(
                    stream, allow_pickle=False, max_header_size=_MAX_NPY_HEADER
                )
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
            msg = f"{path}: array {name!r} is corrupt or truncated ({error})"
            raise ArrayFileError(msg) from None
        return np.asarray(array)

    return load


def _safetensors_entries(path: Path) -> dict[str, ArrayEntry]:
    size = path.stat().st_size
    with path.open("rb") as file:
        size_bytes = file.read(8)
        if len(size_bytes) != 8:
            msg = f"{path} is not a safetensors file (shorter than its header size)"
            raise ArrayFileError(msg)
        (header_size,) = struct.unpack("<Q", size_bytes)
        if header_size > min(_MAX_SAFETENSORS_HEADER, size - 8):
            msg = f"{path} is not a safetensors file (header of {header_size} bytes)"
            raise ArrayFileError(msg)
        try:
            header = json.loads(file.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError):
            msg = f"{path} is not a safetensors file (its header is not JSON)"
            raise ArrayFileError(msg) from None
    data_start = 8 + header_size
    if not isinstance(header, dict):
        msg = (
            f"{path} is not a valid safetensors file: its header must be a JSON object of "
            f"tensors; got a JSON {type(header).__name__}"
        )
        raise ArrayFileError(msg)
    entries: dict[str, ArrayEntry] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype_name, shape, start, end = _safetensors_entry(path, name, entry, size - data_start)
        stored = _SAFETENSORS_DTYPES[dtype_name]
        handed = np.dtype("<f4") if dtype_name == "BF16" else stored
        stored_name = _STORED_NAMES.get(dtype_name, stored.name)
        description = ArrayHeader(name, shape, handed, stored_name)
        entries[name] = ArrayEntry(
            description,
            _safetensors_loader(path, data_start + start, end - start, stored, description),
        )
    return entries


def _safetensors_entry(
    path: Path, name: str, entry: object, data_size: int
) -> tuple[str, tuple[int, ...], int, int]:
    """Check one tensor's header entry: dtype, shape and data offsets within the file."""

    def bad(what: str) -> ArrayFileError:
        return ArrayFileError(f"{path} is not a valid safetensors file: tensor {name!r} {what}")

    if not isinstance(entry, dict):
        msg = f"must be a JSON object with dtype, shape and data_offsets; got {entry!r:.60}"
        raise bad(msg)
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in entry]
    if missing:
        msg = f"has no {', '.join(repr(key) for key in missing)} in its header entry"
        raise bad(msg)
    dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype_name not in _SAFETENSORS_DTYPES:
        msg = (
            f"has dtype {dtype_name!r}, which attnflow cannot read (it reads "
            f"{', '.join(_SAFETENSORS_DTYPES)})"
        )
        raise bad(msg)
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        msg = f"has shape {shape!r:.60}; expected a list of non-negative integers"
        raise bad(msg)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        msg = (
            f"has data_offsets {offsets!r:.60}; expected [start, end] within the "
            f"{data_size} bytes of data"
        )
        raise bad(msg)
    start, end = offsets
    nbytes = _SAFETENSORS_DTYPES[dtype_name].itemsize * math.prod(shape)
    if end - start != nbytes:
        msg = f"does not match its declared shape {shape}: it spans {end - start} bytes"
        raise bad(msg)
    return dtype_name, tuple(shape), start, end


def _safetensors_loader(
    path: Path, offset: int, nbytes: int, stored: np.dtype[Any], header: ArrayHeader
) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        with path.open("rb") as file:
            file.seek(offset)
            data = file.read(nbytes)
        if len(data) != nbytes:
            msg = f"{path}: tensor {header.name!r} is truncated ({len(data)} of {nbytes} bytes)"
            raise ArrayFileError(msg)
        raw = np.frombuffer(data, dtype=stored)
        if header.stored == "bfloat16":
            # bfloat16 is the top half of a float32: widening is exact.
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.reshape(header.shape).copy()

    return load


def open_entries(path: str | os.PathLike[str]) -> dict[str, ArrayEntry]:
    """Parse the headers of every array in a ``.npy``, ``.npz`` or ``.safetensors`` file.

    Parameters
    ----------
    path : path
        The file.

    Returns
    -------
    dict of str to ArrayEntry
        By array name ("array" for ``.npy``), each with its header and a loader.

    Raises
    ------
    ArrayFileError
        On a missing, unreadable, truncated, malformed or pickled file, naming the file.
    """
    file = Path(path)
    if not file.is_file():
        msg = f"{file} does not exist or is not a file"
        raise ArrayFileError(msg)
    suffix = file.suffix.lower()
    try:
        if suffix == ".safetensors":
            return _safetensors_entries(file)
        if suffix == ".npz":
            return _npz_entries(file)
        if suffix == ".npy":
            return _npy_entries(file)
    except OSError as error:
        msg = f"{file} is not a readable {suffix} file ({error})"
        raise ArrayFileError(msg) from None
    msg = f"{file}: unknown format {suffix!r}; use .npy, .npz or .safetensors"
    raise ArrayFileError(msg)
