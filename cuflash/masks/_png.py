"""PNG (greyscale, 8 bit): a minimal writer, no imaging library needed."""

from __future__ import annotations

import struct
import zlib

import numpy as np

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def _png_bytes(pixels: np.ndarray) -> bytes:
    """Encode a uint8 (height, width) greyscale image as PNG bytes."""
    height, width = pixels.shape
    if height == 0 or width == 0:
        raise ValueError(f"a PNG image needs at least one pixel, got {height} x {width}")
    # IHDR: width, height, bit depth 8, colour type 0 (greyscale), deflate,
    # adaptive filtering (method 0), no interlace.
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    # Every scanline starts with its filter type; 0 = None (raw bytes).
    raw = np.concatenate([np.zeros((height, 1), np.uint8), pixels.astype(np.uint8)], axis=1)
    return (
        PNG_SIGNATURE
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
        + _png_chunk(b"IEND", b"")
    )
