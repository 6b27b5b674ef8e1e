"""A man in the middle in its own process: it relays a hixl connection byte for byte — the
handshake included, so the two engines authenticate each other through it — records everything
it relays, and on command alters what passes.

``python mitm_main.py LISTEN_IP UPSTREAM_IP:PORT RECORDING [--sealed]`` prints the port it listens
on, relays every connection it accepts to ``UPSTREAM``, and appends the bytes of each direction
to ``RECORDING.i2t`` (initiator to target) and ``RECORDING.t2i``. It follows the stream's units
as a wire tap would: hixl frames (header, body, data), or with ``--sealed`` — the link encrypts —
the first frame each way (HELLO, CHALLENGE) and then sealed records, whose lengths are in clear.
It reads one JSON command per line from stdin, answers each with a line once done, and exits
when stdin closes:

- ``{"flip": "t2i"}`` (or ``"i2t"``): flip one bit in the middle of the next unit of that direction
  carrying 4 KiB or more — a frame's data, or a sealed record;
- ``{"flips": N}``: answered with how many bits it flipped, once that is N (or after 10 s);
- ``{"inject_write": [ADDR, SIZE, BYTE]}``: at the next unit boundary, slip into the initiator's
  direction a WRITE frame of its own: ``SIZE`` bytes of ``BYTE`` to the target's address ``ADDR``.
"""

from __future__ import annotations

import json
import socket
import sys
import threading

import numpy as np

from hixl import _protocol as proto

_BIG = 4096
_FRAME_HEADER = proto.HEADER_SIZE
_RECORD_HEADER = 4


class Direction:
    """One direction of one connection: its bytes recorded and passed on, its units followed."""

    def __init__(self, name: str, relay: Relay, out: socket.socket) -> None:
        self.name, self.relay, self.out = name, relay, out
        self.lock = threading.Lock()  # (the initiator's direction: relayed bytes and an injection never interleave)
        self.pos = 0  # bytes relayed so far
        self.head = bytearray()  # the unit header being read
        self.skip = 0  # bytes of the current unit's body still to pass
        self.units = 0
        self.flip_at: int | None = None

    def relay_from(self, src: socket.socket) -> None:
        """Relay what ``src`` sends until it closes: recorded as it came, then (maybe) altered, then passed on."""
        with open(f"{self.relay.recording}.{self.name}", "ab") as record:
            try:
                while chunk := src.recv(1 << 16):
                    data = bytearray(chunk)
                    with self.lock:
                        record.write(data)  # (as it came: what a tap on this wire reads)
                        record.flush()
                        self._follow(data)
                        self.out.sendall(data)
                    self.relay.went_by()
                self.out.shutdown(socket.SHUT_WR)
            except OSError:  # (one end hung up on the other: the relay of this connection ends)
                pass

    def _follow(self, data: bytearray) -> None:
        i = 0
        while i < len(data):
            if self.skip:
                n = min(self.skip, len(data) - i)
                if self.flip_at is not None and self.pos + i <= self.flip_at < self.pos + i + n:
                    data[self.flip_at - self.pos] ^= 0x10
                    self.flip_at = None
                    self.relay.flipped(self)
                i += n
                self.skip -= n
                continue
            size = _RECORD_HEADER if self.relay.sealed and self.units else _FRAME_HEADER
            take = min(size - len(self.head), len(data) - i)
            self.head += data[i : i + take]
            i += take
            if len(self.head) == size:
                self._unit(self.pos + i)
        self.pos += len(data)

    def _unit(self, body_at: int) -> None:
        """A unit's header was read; its body begins at stream offset ``body_at``."""
        if len(self.head) == _RECORD_HEADER:
            length = int.from_bytes(self.head, "little")
            self.skip, payload, offset = length + 16, length, length // 2
        else:
            header = proto.parse_header(bytes(self.head))
            self.skip, payload = header.body_len + header.data_len, header.data_len
            offset = header.body_len + header.data_len // 2
        if self.relay.flip_wanted == self.name and payload >= _BIG and self.flip_at is None:
            self.relay.flip_wanted = ""
            self.flip_at = body_at + offset
        self.head.clear()
        self.units += 1

    @property
    def between_units(self) -> bool:
        """Whether the last unit relayed ended (a unit of our own can go next)."""
        return not self.skip and not self.head

    def inject(self, frame: bytes) -> None:
        """Send ``frame`` on, between two units of this direction."""
        with self.lock:
            assert self.between_units, "an injection goes between units"
            self.out.sendall(frame)


class Relay:
    """Every connection accepted on ``listener`` relayed to ``upstream`` (see the module docstring)."""

    def __init__(self, listener: socket.socket, upstream: tuple[str, int], recording: str, sealed: bool) -> None:
        self.listener, self.upstream, self.recording, self.sealed = listener, upstream, recording, sealed
        self.flip_wanted = ""
        self.to_target: Direction | None = None
        self._done = threading.Condition()
        self._flips = 0

    def serve(self) -> None:
        """Accept connections for ever, relaying each on two threads of its own."""
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(self.upstream)
            i2t, t2i = Direction("i2t", self, server), Direction("t2i", self, client)
            self.to_target = i2t
            threading.Thread(target=i2t.relay_from, args=(client,), daemon=True).start()
            threading.Thread(target=t2i.relay_from, args=(server,), daemon=True).start()

    def went_by(self) -> None:
        """Some bytes were relayed (an injection may be waiting for a unit to end)."""
        with self._done:
            self._done.notify_all()

    def flipped(self, direction: Direction) -> None:
        """``direction`` flipped the bit it was asked to."""
        with self._done:
            self._flips += 1
            self._done.notify_all()

    def flips(self, count: int) -> int:
        """How many bits were flipped, once ``count`` were (or after 10 s)."""
        with self._done:
            self._done.wait_for(lambda: self._flips >= count, timeout=10)
            return self._flips

    def inject_write(self, addr: int, size: int, byte: int) -> None:
        """Slip a WRITE of ``size`` bytes of ``byte`` to ``addr`` into the initiator's direction."""
        descs = np.array([[addr, size]], dtype=np.uint64)
        frame = proto.encode(proto.WriteRequest(1 << 40, descs, size)) + bytes([byte]) * size
        with self._done:
            self._done.wait_for(lambda: self.to_target is not None and self.to_target.between_units, timeout=30)
        assert self.to_target is not None
        self.to_target.inject(frame)


def main(listen_ip: str, upstream: str, recording: str, sealed: bool) -> None:
    host, port = upstream.rsplit(":", 1)
    listener = socket.create_server((listen_ip, 0))
    relay = Relay(listener, (host, int(port)), recording, sealed)
    threading.Thread(target=relay.serve, daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        answer: object = "done"
        if "flip" in command:
            relay.flip_wanted = command["flip"]
        elif "flips" in command:
            answer = relay.flips(command["flips"])
        else:
            relay.inject_write(*command["inject_write"])
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], "--sealed" in sys.argv[4:])
