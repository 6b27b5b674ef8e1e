"""What every fuzz target stands on: a real TCP connection on 127.0.0.1 fed exactly the bytes a
case names, memory the calls may touch (reset before each of the two twins runs on it), and a
call's outcome as a plain value two runs can be compared by.

The two twins of a call run on the same buffers at the same addresses, one after the other, with
the memory reset between them: a case's frames can then name real addresses, and an outcome is
comparable byte for byte. Memory is numpy's (malloc'd, so AddressSanitizer's red zones surround
each buffer); guard bytes inside a buffer around what a call may touch catch what lands inside
the buffer but outside its ranges.
"""

from __future__ import annotations

import array
import fcntl
import socket
import struct
import termios
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SETTLE_S = 5.0
"""The longest a connection may take to hand over bytes already sent (loopback: microseconds)."""
_CLOSE_WAIT = 8  # (struct tcp_info's first byte: the peer's FIN has come)


class Pair:
    """Two connected TCP sockets on 127.0.0.1: ``ours`` non-blocking, as hixl's are; the peer's
    blocking, with a timeout."""

    def __init__(self) -> None:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            self.peer = socket.create_connection(listener.getsockname(), timeout=SETTLE_S)
            self.ours, _ = listener.accept()
        for end in (self.ours, self.peer):  # (no small segment held back for an ACK: the bytes are in at once)
            end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ours.setblocking(False)
        self.closed_by_peer = False

    def feed(self, data: bytes, eof: bool) -> None:
        """Send ``data`` (then the peer's end of stream, if ``eof``) and return once ours holds all
        of it: a call then finds the same bytes whichever twin makes it."""
        self.peer.sendall(data)
        if eof:
            self.peer.shutdown(socket.SHUT_WR)
            self.closed_by_peer = True
        until = time.monotonic() + SETTLE_S
        while self.held() < len(data) or (eof and self._state() != _CLOSE_WAIT):
            if time.monotonic() > until:
                raise TimeoutError("loopback did not hand the bytes over")
            time.sleep(0)

    def held(self) -> int:
        """The bytes our end holds unread."""
        unread = array.array("i", [0])
        fcntl.ioctl(self.ours.fileno(), termios.FIONREAD, unread, True)
        return unread[0]

    def rest(self) -> bytes:
        """What a call left unread (all of it: every byte was in before the call)."""
        out = b""
        while True:
            try:
                chunk = self.ours.recv(1 << 16)
            except BlockingIOError:
                return out
            if not chunk:
                return out
            out += chunk

    def take(self, n: int) -> bytes:
        """Exactly the ``n`` bytes ours sent the peer."""
        out = b""
        while len(out) < n:
            chunk = self.peer.recv(n - len(out))
            if not chunk:
                raise ConnectionError(f"ours closed after {len(out)} of {n} bytes")
            out += chunk
        return out

    def _state(self) -> int:
        return self.ours.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]

    def close(self) -> None:
        self.ours.close()
        self.peer.close()


class Network:
    """One connection for a target's cases, until a case ends its stream: the next one gets a new one."""

    def __init__(self) -> None:
        self._pair: Pair | None = None

    def fed(self, data: bytes, eof: bool) -> Pair:
        """A connection whose unread bytes are ``data`` (and, if ``eof``, its end)."""
        if self._pair is None or self._pair.closed_by_peer:
            self.close()
            self._pair = Pair()
        self._pair.feed(data, eof)
        return self._pair

    def close(self) -> None:
        if self._pair is not None:
            self._pair.close()
            self._pair = None


class Memory:
    """Named buffers at fixed addresses, filled with a fixed pattern before each run."""

    def __init__(self, **sizes: int) -> None:
        self.buffers = {name: np.zeros(size, dtype=np.uint8) for name, size in sizes.items()}
        self._bases = {name: int(buf.ctypes.data) for name, buf in self.buffers.items()}
        self._initial = {name: (np.arange(size, dtype=np.uint64) * 131 + 7).astype(np.uint8) for name, size in sizes.items()}

    def addr(self, name: str, offset: int = 0) -> int:
        return self._bases[name] + offset

    def size(self, name: str) -> int:
        return int(self.buffers[name].nbytes)

    def reset(self) -> None:
        for name, buf in self.buffers.items():
            buf[:] = self._initial[name]

    def snapshot(self) -> dict[str, bytes]:
        return {name: buf.tobytes() for name, buf in self.buffers.items()}


def outcome(call: Callable[..., Any], *args: Any) -> Any:
    """What ``call(*args)`` answered, or the name of the exception it raised (the twins word their
    messages differently; the kind is the contract)."""
    try:
        return call(*args)
    except (OSError, ValueError, TypeError, OverflowError) as exc:
        return ("raised", type(exc).__name__)


def clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def laid_out(lengths: list[int], capacity: int, gap: int = 8) -> list[tuple[int, int]]:
    """``(offset, length)`` of each length placed one after another with ``gap`` guard bytes
    between, from ``gap`` on; as many as fit in ``capacity`` bytes."""
    rows, at = [], gap
    for length in lengths:
        if at + length + gap > capacity:
            break
        rows.append((at, length))
        at += length + gap
    return rows


def u64(value: int) -> int:
    """``value`` as the 64-bit field a frame carries."""
    return value % (1 << 64)


HEADER = struct.Struct("<4sBBHQIQ")
"""A frame's header as hixl._protocol.frames lays it out."""
