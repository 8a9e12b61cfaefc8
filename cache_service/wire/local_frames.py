"""Messages of a local session on its socket: each one's bytes after their length.

A local session (see `local_sessions`, and LocalSessionHello in the proto) carries
Session messages over a Unix domain socket, a byte stream: each message is preceded by
its length as a 4-byte little-endian unsigned integer. Pure logic; no I/O.
"""

from __future__ import annotations

import struct

__all__ = ["FrameBuffer", "FrameError", "frame"]

_LENGTH = struct.Struct("<I")
HEADER_BYTES = _LENGTH.size


class FrameError(ValueError):
    """The byte stream announced a message longer than the limit (it cannot be read on)."""


def frame(payload: bytes) -> bytes:
    """``payload`` as it goes on the socket: its length, then its bytes.

    Raises:
        FrameError: a payload of 4 GiB or more (the length field cannot hold it).
    """
    if len(payload) > 0xFFFFFFFF:
        raise FrameError(f"a message of {len(payload)} bytes does not fit a 4-byte length")
    return _LENGTH.pack(len(payload)) + payload


class FrameBuffer:
    """Collects a socket's bytes as they arrive and hands out whole messages.

    Args:
        max_bytes: the longest message accepted, bytes (the server's max_message_bytes).
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self._max = max_bytes
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data``; return the messages completed by it, in order (often none or one).

        Raises:
            FrameError: a length above max_bytes (the stream is unusable from there on).
        """
        if not self._buf and len(data) >= HEADER_BYTES:
            # The common case, one whole message per read: no copy into the buffer.
            (n,) = _LENGTH.unpack_from(data)
            if len(data) == HEADER_BYTES + n and n <= self._max:
                return [bytes(data[HEADER_BYTES:])]
        self._buf += data
        out = []
        while len(self._buf) >= HEADER_BYTES:
            (n,) = _LENGTH.unpack_from(self._buf)
            if n > self._max:
                raise FrameError(
                    f"a message of {n} bytes is longer than the limit of {self._max} bytes "
                    "(server.max_message_bytes)"
                )
            end = HEADER_BYTES + n
            if len(self._buf) < end:
                break
            out.append(bytes(self._buf[HEADER_BYTES:end]))
            del self._buf[:end]
        return out

    @property
    def pending_bytes(self) -> int:
        """Bytes received that do not yet make a whole message."""
        return len(self._buf)
