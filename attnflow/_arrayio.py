"""Reading and writing arrays for the command line: ``.npy``, ``.npz``, ``.safetensors``.

Nothing here ever unpickles: NumPy files are loaded with ``allow_pickle=False`` and
safetensors files are parsed from their JSON header. Outputs are written atomically (a
temporary file in the target folder, then a rename) and never replace an existing file
unless asked to.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np

__all__ = ["ArrayFileError", "read_array", "read_arrays", "write_atomically", "write_npz"]

_SAFETENSORS_DTYPES: dict[str, np.dtype[np.generic]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BOOL": np.dtype("?"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


class ArrayFileError(ValueError):
    """A file that cannot be read as the arrays asked for; its message is one line."""


def _pick(arrays: Mapping[str, np.ndarray], key: str | None, path: Path, default: str) -> str:
    names = sorted(arrays)
    if key is not None:
        if key not in arrays:
            msg = f"{path} has no array named {key!r}; it holds {names}"
            raise ArrayFileError(msg)
        return key
    if default in arrays:
        return default
    if len(names) == 1:
        return names[0]
    msg = f"{path} holds several arrays {names}; choose one with --key"
    raise ArrayFileError(msg)


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    with path.open("rb") as file:
        size_bytes = file.read(8)
        if len(size_bytes) != 8:
            msg = f"{path} is not a safetensors file (shorter than its header size)"
            raise ArrayFileError(msg)
        (header_size,) = struct.unpack("<Q", size_bytes)
        if header_size > _MAX_SAFETENSORS_HEADER:
            msg = f"{path} is not a safetensors file (header of {header_size} bytes)"
            raise ArrayFileError(msg)
        try:
            header = json.loads(file.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError):
            msg = f"{path} is not a safetensors file (its header is not JSON)"
            raise ArrayFileError(msg) from None
        data = file.read()
    arrays = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype_name = entry.get("dtype")
        if dtype_name == "BF16":
            start, end = entry["data_offsets"]
            raw = np.frombuffer(data, dtype="<u2", count=(end - start) // 2, offset=start)
            raw = raw.astype(np.uint32) << 16
            arrays[name] = raw.view(np.float32).reshape(entry["shape"])
            continue
        if dtype_name not in _SAFETENSORS_DTYPES:
            msg = f"{path}: tensor {name!r} has dtype {dtype_name}, which attnflow cannot read"
            raise ArrayFileError(msg)
        start, end = entry["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[dtype_name]
        shape = tuple(entry["shape"])
        if end - start != dtype.itemsize * int(np.prod(shape)) or end > len(data):
            msg = f"{path}: tensor {name!r} does not match its declared shape {list(shape)}"
            raise ArrayFileError(msg)
        arrays[name] = np.frombuffer(data[start:end], dtype=dtype).reshape(shape)
    return arrays


def read_arrays(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Read every array of a ``.npz`` or ``.safetensors`` file (``.npy``: one, "array").

    Parameters
    ----------
    path : path
        The file.

    Returns
    -------
    dict of str to ndarray

    Raises
    ------
    ArrayFileError
        On a missing, unreadable or pickled file.
    """
    file = Path(path)
    if not file.is_file():
        msg = f"{file} does not exist or is not a file"
        raise ArrayFileError(msg)
    suffix = file.suffix.lower()
    try:
        if suffix == ".safetensors":
            return _read_safetensors(file)
        if suffix in {".npy", ".npz"}:
            loaded = np.load(file, allow_pickle=False)
            if isinstance(loaded, np.ndarray):
                return {"array": loaded}
            with loaded:
                return {name: np.asarray(loaded[name]) for name in loaded.files}
    except ValueError as error:
        if isinstance(error, ArrayFileError):
            raise
        text = str(error)
        if "pickle" in text.lower():
            msg = (
                f"{file} is not a plain NumPy array file: it holds pickled data or is no "
                "NumPy file at all; attnflow never unpickles (it can run code)"
            )
            raise ArrayFileError(msg) from None
        msg = f"{file} is not a readable {suffix} file ({text})"
        raise ArrayFileError(msg) from None
    except (OSError, EOFError) as error:
        msg = f"{file} is not a readable {suffix} file ({error})"
        raise ArrayFileError(msg) from None
    msg = f"{file}: unknown format {suffix!r}; use .npy, .npz or .safetensors"
    raise ArrayFileError(msg)


def read_array(path: str | os.PathLike[str], *, key: str | None, default: str) -> np.ndarray:
    """Read one array from a ``.npy``, ``.npz`` or ``.safetensors`` file, never unpickling.

    Parameters
    ----------
    path : path
        The file.
    key : str or None
        The array's name in an ``.npz`` or ``.safetensors`` file; by default `default`
        if present, else the only array.
    default : str
        The name looked for when `key` is None.

    Returns
    -------
    ndarray

    Raises
    ------
    ArrayFileError
        On a missing, unreadable, pickled or ambiguous file.
    """
    file = Path(path)
    arrays = read_arrays(file)
    if file.suffix.lower() == ".npy":
        if key is not None:
            msg = f"{file} holds one array: --key applies to .npz and .safetensors"
            raise ArrayFileError(msg)
        return arrays["array"]
    return arrays[_pick(arrays, key, file, default)]


def write_atomically(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, force: bool
) -> Path:
    """Write a file through `write` atomically; refuse to replace a file unless `force`.

    The bytes go to a temporary file in the target's folder, which is then renamed onto
    the target, so the target never holds a partial file.

    Returns
    -------
    Path
        The file written.

    Raises
    ------
    ArrayFileError
        If the file exists and `force` is False, or its folder does not exist.
    """
    target = Path(path)
    if target.exists() and not force:
        msg = f"{target} exists; pass --force to replace it"
        raise ArrayFileError(msg)
    if not target.parent.is_dir():
        msg = f"folder {target.parent} does not exist"
        raise ArrayFileError(msg)
    descriptor, temporary = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=".tmp", dir=target.parent
    )
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
        Path(temporary).chmod(0o644)
        Path(temporary).replace(target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def write_npz(
    path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], *, force: bool
) -> Path:
    """Write `arrays` to an ``.npz`` file atomically; refuse to replace a file unless `force`.

    Returns
    -------
    Path
        The file written.

    Raises
    ------
    ArrayFileError
        If the name does not end in ``.npz``, the file exists and `force` is False, or
        its folder does not exist.
    """
    target = Path(path)
    if target.suffix.lower() != ".npz":
        msg = f"output {target} must end in .npz"
        raise ArrayFileError(msg)
    return write_atomically(
        target,
        lambda file: np.savez(file, **arrays),  # type: ignore[arg-type]
        force=force,
    )
