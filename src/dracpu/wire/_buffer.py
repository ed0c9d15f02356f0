"""A byte FIFO for the sans-IO parsers (after h11 ``_receivebuffer.py``).

Bytes are appended at the end and consumed from the front; ``bytearray`` makes deleting a
prefix cheap, so parsing a stream chunk by chunk stays linear.
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["ReceiveBuffer"]


class ReceiveBuffer:
    """Bytes received but not parsed yet."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data = bytearray()

    def __len__(self) -> int:
        return len(self._data)

    def extend(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data`` at the end."""
        self._data += data

    def unpack_header(self, header: struct.Struct) -> tuple[Any, ...] | None:
        """Decode ``header`` from the front without consuming it; ``None`` if too short."""
        if len(self._data) < header.size:
            return None
        return header.unpack_from(self._data)

    def take(self, n: int) -> bytes:
        """Remove and return the first ``n`` bytes (the caller checked ``len(self) >= n``)."""
        out = bytes(self._data[:n])
        del self._data[:n]
        return out

    def discard(self, n: int) -> int:
        """Drop up to ``n`` bytes from the front; return how many were dropped."""
        dropped = min(n, len(self._data))
        del self._data[:dropped]
        return dropped
