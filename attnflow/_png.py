"""A small PNG encoder (zlib and struct only), for pictures embedded in HTML views.

``import attnflow`` must not import Pillow or matplotlib, yet an image explanation's page
draws its patch grid over the picture the model saw: :func:`png_data_url` writes that
picture as a ``data:image/png;base64,...`` URL. The format is the PNG specification's
(ISO/IEC 15948): the signature, an ``IHDR`` chunk (8-bit greyscale, RGB or RGBA), one
``IDAT`` chunk of zlib-compressed scanlines, each after a filter byte (0: none, 2: up,
whichever is smaller), and ``IEND``; every chunk ends with the CRC-32 of its type and data.
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import numpy as np

__all__ = ["encode_png", "png_data_url", "to_uint8"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: PNG colour types by number of channels: greyscale, RGB, RGBA.
_COLOUR_TYPES = {1: 0, 3: 2, 4: 6}
#: The longest side (px) kept in an embedded picture; larger ones are shrunk by an integer
#: factor (box average): a page shows the grid about 500 px wide.
_LONGEST = 1024


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (
        struct.pack(">I", len(data))
        + kind
        + data
        + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def encode_png(pixels: Any) -> bytes:
    r"""Encode uint8 pixels ``(H, W)``, ``(H, W, 3)`` or ``(H, W, 4)`` as a PNG file.

    Parameters
    ----------
    pixels : ndarray of uint8
        Greyscale, RGB or RGBA, rows top to bottom.

    Returns
    -------
    bytes
        The PNG file.

    Raises
    ------
    ValueError
        If `pixels` is not uint8 of one of those shapes, or is empty.

    Examples
    --------
    >>> import numpy as np
    >>> data = encode_png(np.zeros((2, 3, 3), dtype=np.uint8))
    >>> data[:8] == b"\x89PNG\r\n\x1a\n"
    True
    """
    array = np.asarray(pixels)
    if array.dtype != np.uint8:
        msg = f"`pixels` must be uint8; got dtype {array.dtype}."
        raise ValueError(msg)
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3 or array.shape[-1] not in _COLOUR_TYPES or 0 in array.shape:
        msg = f"`pixels` must have shape (H, W), (H, W, 3) or (H, W, 4); got {np.shape(pixels)}."
        raise ValueError(msg)
    height, width, channels = array.shape
    lines = np.ascontiguousarray(array).reshape(height, width * channels)
    # Filter 2 ("up"): each byte minus the one above it, modulo 256; smaller once deflated
    # for photographs, and as cheap to undo. The first line has nothing above it.
    up = lines.copy()
    up[1:] = lines[1:] - lines[:-1]  # uint8 arithmetic wraps modulo 256
    filters = np.full((height, 1), 2, dtype=np.uint8)
    filters[0] = 0
    raw = np.concatenate([filters, np.where(filters == 0, lines, up)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, _COLOUR_TYPES[channels], 0, 0, 0)
    return (
        _SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
        + _chunk(b"IEND", b"")
    )


def to_uint8(image: Any) -> np.ndarray:
    """Return a picture as uint8 ``(H, W[, C])``: 8-bit values kept, floats scaled.

    Floats in ``[0, 1]`` are multiplied by 255; floats outside it (a normalised input) are
    stretched from their own minimum to maximum, as :func:`attnflow.plot.image_overlay`
    reads them; integers must be 0 to 255. Pictures longer than 1024 px are shrunk by an
    integer factor (the average of each block of pixels).
    """
    pixels = np.asarray(image)
    if pixels.dtype.kind in "iu":
        if pixels.size and (pixels.min() < 0 or pixels.max() > 255):
            msg = "`image` of integers must hold 8-bit values, 0 to 255."
            raise ValueError(msg)
        scaled = pixels.astype(np.float64)
    elif pixels.dtype.kind in "fb":
        values = pixels.astype(np.float64)
        if values.size and not np.isfinite(values).all():
            msg = "`image` must be finite."
            raise ValueError(msg)
        low = float(values.min()) if values.size else 0.0
        high = float(values.max()) if values.size else 1.0
        if low >= 0.0 and high <= 1.0:
            scaled = values * 255.0
        elif low >= 0.0 and high <= 255.0:
            scaled = values
        else:
            scaled = (values - low) / max(high - low, 1e-300) * 255.0
    else:
        msg = f"`image` must hold numbers; got dtype {pixels.dtype}."
        raise ValueError(msg)
    factor = -(-max(scaled.shape[:2]) // _LONGEST)
    if factor > 1:
        height, width = (size // factor * factor for size in scaled.shape[:2])
        blocks = scaled[:height, :width].reshape(
            height // factor, factor, width // factor, factor, *scaled.shape[2:]
        )
        scaled = blocks.mean(axis=(1, 3))
    return np.clip(np.floor(scaled + 0.5), 0, 255).astype(np.uint8)


def png_data_url(image: Any) -> str:
    """Return `image` (see :func:`to_uint8`) as a ``data:image/png;base64,`` URL."""
    return "data:image/png;base64," + base64.b64encode(encode_png(to_uint8(image))).decode()
