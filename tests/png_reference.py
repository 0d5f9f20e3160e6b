"""A PNG reader written from the specification (ISO/IEC 15948), for checks in the tests.

Independent of attnflow's encoder: it reads any 8-bit, non-interlaced greyscale, RGB or
RGBA file with all five filter types (none, sub, up, average, Paeth), such as Chromium's
screenshots, and checks every chunk's CRC.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}


def read_png(data: bytes) -> np.ndarray:
    """Return the pixels of a PNG file as uint8 ``(H, W, channels)``."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    at, chunks = 8, []
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        at += 12 + length
    assert chunks[0][0] == b"IHDR"
    assert chunks[-1][0] == b"IEND"
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, interlace) == (8, 0)
    assert colour in CHANNELS
    channels = CHANNELS[colour]
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = width * channels
    out = np.zeros((height, stride), dtype=np.int64)
    for y in range(height):
        line = raw[y * (stride + 1) : (y + 1) * (stride + 1)]
        kind, row = line[0], np.frombuffer(line[1:], dtype=np.uint8).astype(np.int64)
        above = out[y - 1] if y else np.zeros(stride, dtype=np.int64)
        if kind in (0, 2):
            out[y] = (row + (above if kind == 2 else 0)) % 256
            continue
        for x in range(stride):  # sub, average, Paeth depend on the decoded left byte
            left = out[y, x - channels] if x >= channels else 0
            corner = above[x - channels] if x >= channels else 0
            if kind == 1:
                predicted = left
            elif kind == 3:
                predicted = (left + above[x]) // 2
            else:
                p = left + above[x] - corner
                pa, pb, pc = abs(p - left), abs(p - above[x]), abs(p - corner)
                predicted = left if pa <= pb and pa <= pc else above[x] if pb <= pc else corner
            out[y, x] = (row[x] + predicted) % 256
    return out.astype(np.uint8).reshape(height, width, channels)
