"""Fuzz targets for TCP's latency path in hixl._accel: every call that reads a peer's bytes off a
socket (tcp_reply, tcp_land, tcp_land_words, tcp_request) or sends memory a peer's request named
(tcp_send). Each runs one case on a real loopback connection holding exactly the case's bytes and
answers what the call returned, what memory holds after it and what it left in the socket.

A case names memory by buffer and offset; what the caller checks before the call (our own ranges,
inside our buffers) is made to hold here, and everything a peer controls is left as the case says.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

import numpy as np

from hixl._accel import pure
from hixl._memory import Registry
from hixl._protocol.frames import HEADER_SIZE, FrameType, encode_header

from .harness import HEADER, Memory, Network, clamp, laid_out, outcome, u64

PAST = -1.0
"""An ``until`` already passed: a call reads what its socket holds and waits for nothing more."""
AHEAD = 30.0
"""An ``until`` no case reaches: given only where the call cannot be left waiting (all it needs is
in the socket, or the stream's end), so that no outcome depends on how fast a call runs."""
MAX_STREAM = 1 << 16
_READ, _WRITE, _DATA, _ACK = FrameType.READ, FrameType.WRITE, FrameType.DATA, FrameType.ACK
_FAR = 1 << 62  # (a deadline in microseconds no run reaches)


def _until(case: dict[str, Any], enough: bool) -> float:
    """PAST, or AHEAD where the case asks for time and ``enough`` bytes (or the stream's end) came."""
    return time.monotonic() + (AHEAD if case["wait"] and (enough or case["eof"]) else PAST)


def _stream(case: dict[str, Any]) -> bytes:
    return bytes.fromhex(case["stream"])[:MAX_STREAM]


class _OnSocket:
    """A target whose cases run on one connection (a new one after a case that ends its stream)."""

    name = ""

    def __init__(self) -> None:
        self.net = Network()

    def close(self) -> None:
        self.net.close()


class TcpReply(_OnSocket):
    """``tcp_reply``: a reply header read into scratch and recognised, from whatever the peer sent."""

    name = "tcp_reply"

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        scratch = bytearray(HEADER_SIZE + case["scratch"] % 4096)
        held = bytes.fromhex(case["held"])[: len(scratch)]
        scratch[: len(held)] = held
        have = case["have"] % (len(scratch) + 1)
        pair = self.net.fed(_stream(case), case["eof"])
        # (Timing never decides here: every byte there is read before the first wait.)
        answer = outcome(impl.tcp_reply, pair.ours, scratch, have, u64(case["req_id"]), time.monotonic() + PAST)
        return answer, bytes(scratch), pair.rest()


class TcpLand(_OnSocket):
    """``tcp_land``: a DATA's bytes landed from scratch, then from the socket, into our ranges."""

    name = "tcp_land"

    def __init__(self) -> None:
        super().__init__()
        self.memory = Memory(dst=1 << 16)

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        rows = laid_out([max(1, n % 4097) for n in case["rows"]], self.memory.size("dst"))[: impl.TCP_RANGES + 1]
        scratch = bytearray.fromhex(case["held"])
        start = case["start"] % (len(scratch) + 1)
        have = start + case["have"] % (len(scratch) - start + 1)  # (what came with the header)
        ranges = [(self.memory.addr("dst", offset), length) for offset, length in rows]
        total = sum(length for _, length in ranges)
        enough = have - start + len(_stream(case)) >= total
        self.memory.reset()
        pair = self.net.fed(_stream(case), case["eof"])
        answer = outcome(impl.tcp_land, pair.ours, scratch, start, have, ranges, _until(case, enough))
        return answer, self.memory.snapshot(), pair.rest()


class TcpLandWords(_OnSocket):
    """``tcp_land_words``: a WRITE's data landed from the socket in whole words of the data, with
    ``done`` (how much landed before), ``want`` and ``left`` as the peer's frame made them."""

    name = "tcp_land_words"

    def __init__(self) -> None:
        super().__init__()
        self.memory = Memory(dst=1 << 16)

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        rows = laid_out([max(1, n % 4097) for n in case["rows"]], self.memory.size("dst"))
        iovs = np.array([(self.memory.addr("dst", o), n) for o, n in rows], dtype=np.uint64).reshape(-1, 2)
        first = case["first"] % (len(rows) + 1)
        left, done = u64(case["left"]), u64(case["done"])  # (the peer's data_len decides both)
        want = case["want"] % (left + 1)
        piece = 8 + case["piece"] % (1 << 20)
        self.memory.reset()
        pair = self.net.fed(_stream(case), case["eof"])
        # (With spin 0 it never waits: a dry socket ends the call.)
        answer = outcome(impl.tcp_land_words, pair.ours, iovs, first, want, done, left, _until(case, True), piece)
        return answer, self.memory.snapshot(), pair.rest()


class TcpSend(_OnSocket):
    """``tcp_send``: a frame, then the memory of ranges a peer's READ named (checked by the caller:
    inside our buffer), from an offset on."""

    name = "tcp_send"

    def __init__(self) -> None:
        super().__init__()
        self.memory = Memory(src=1 << 15)

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        size = self.memory.size("src")
        ranges = []
        for offset, length in case["ranges"]:
            offset %= size
            ranges.append((self.memory.addr("src", offset), length % (size - offset + 1)))
        frame = bytes.fromhex(case["frame"])
        whole = len(frame) + sum(n for _, n in ranges)
        offset = case["offset"] % (whole + 1)
        self.memory.reset()
        pair = self.net.fed(b"", False)
        sent = outcome(impl.tcp_send, pair.ours, frame, ranges, offset, time.monotonic() + 5)
        received = pair.take(sent - offset) if isinstance(sent, int) else b""
        return sent, received


class TcpRequest(_OnSocket):
    """``tcp_request``: one recv, and a small READ or WRITE recognised — by the C twin, given the
    registry, also served where every rule lets it through. The pure twin serves nothing, so the
    twins agree where a case is not served; where it is, the C twin's reply, and what it wrote,
    must be what the rules say, to the byte."""

    name = "tcp_request"

    def __init__(self) -> None:
        super().__init__()
        # A registration read-only and one read-write, each inside a larger buffer (its guards),
        # and a buffer nobody registered.
        self.memory = Memory(readable=8192, writable=8192, unregistered=4096)
        self.registry = Registry()
        self.registry.register(self.memory.buffers["readable"][64:-64], access="r")
        self.registry.register(self.memory.buffers["writable"][64:-64], access="rw")
        self.regions = ("readable", "writable", "unregistered")

    def frame(self, case: dict[str, Any]) -> bytes:
        """The bytes of a case's frame: a READ or WRITE as the case builds it, then its patches."""
        pairs = b"".join(
            u64(self._addr(region, offset)).to_bytes(8, "little") + u64(length).to_bytes(8, "little")
            for region, offset, length in case["pairs"]
        )
        deadline = {0: 0, 1: 1, 2: _FAR}.get(case["deadline"], case["deadline"])
        body = u64(deadline).to_bytes(8, "little") + pairs
        data = bytes.fromhex(case["data"])
        data_len = u64(len(data) + case["data_len_delta"]) if case["kind"] != _READ else u64(case["data_len_delta"])
        body_len = (len(body) + case["body_extra"]) % (1 << 32)
        header = HEADER.pack(b"HXL1", case["kind"] % 256, case["flags"] % 256, 0, u64(case["req_id"]), body_len, data_len)
        raw = bytearray(header + body + data + bytes.fromhex(case["tail"]))
        for at, byte in case["patches"]:
            if raw:
                raw[at % len(raw)] = byte % 256
        return bytes(raw[: case["cut"]] if case["cut"] > 0 else raw)

    def _addr(self, region: int, offset: int) -> int:
        if 0 <= region < len(self.regions):
            return self.memory.addr(self.regions[region], offset)
        return offset

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        scratch = bytearray(clamp(case["scratch"], 100, 1 << 14))
        self.memory.reset()
        pair = self.net.fed(self.frame(case)[:MAX_STREAM], case["eof"])
        answer = outcome(impl.tcp_request, pair.ours, scratch, self.registry if case["registry"] else None)
        sent = b""
        if isinstance(answer, tuple) and len(answer) == 8 and answer[7] is not None:
            sent = pair.take(max(0, self._reply_length(answer, scratch) - len(answer[7])))
        return answer, bytes(scratch), self.memory.snapshot(), sent, pair.rest()

    def agree(self, case: dict[str, Any], native: Any, twin: Any) -> bool:
        """Whether the C twin's outcome is the pure one's, or, where it served the request, that
        of serving it by the rules (the pure twin's parse, its data copied in or read out)."""
        answer, scratch, memory, sent, rest = native
        pure_answer, pure_scratch, pure_memory, pure_sent, pure_rest = twin
        if (scratch, rest) != (pure_scratch, pure_rest) or pure_sent or pure_memory != self._unchanged():
            return False
        served = self._served(pure_answer, scratch) if case["registry"] else None
        if served is None:
            return native == twin
        reply, memory_after = served
        if not (isinstance(answer, tuple) and answer[5] is None and answer[7] is not None):
            return False
        kind, have, end, req_id, deadline, _, data_len, unsent = answer
        return (
            (kind, have, end, req_id, deadline, data_len) == tuple(pure_answer[i] for i in (0, 1, 2, 3, 4, 6))
            and sent + unsent == reply
            and memory == memory_after
        )

    def _unchanged(self) -> dict[str, bytes]:
        self.memory.reset()
        return self.memory.snapshot()

    def _served(self, parsed: Any, scratch: bytes) -> tuple[bytes, dict[str, bytes]] | None:
        """The reply, and the memory after, of a request every rule lets the C twin serve; None if
        a rule refuses it (no id, too large, past its deadline, a range outside the registrations it
        may touch, a WRITE's data not all in)."""
        if not (isinstance(parsed, tuple) and parsed[0] in (_READ, _WRITE)):
            return None
        kind, have, end, req_id, deadline, pairs, _, _ = parsed
        total = sum(n for _, n in pairs)
        if not req_id or total > pure.TCP_SERVE_MAX or (deadline and time.monotonic() * 1e6 >= deadline):
            return None
        if kind == _WRITE and have - end < total:
            return None
        table = self.registry.table
        side = table.writable if kind == _WRITE else table.readable
        if not all(side.contains(addr, n) for addr, n in pairs):
            return None
        self.memory.reset()
        if kind == _READ:
            data = b"".join(self._bytes_at(addr, n) for addr, n in pairs)
            return encode_header(_DATA, req_id, 0, total) + data, self.memory.snapshot()
        at = end
        buf = self.memory.buffers["writable"]
        for addr, n in pairs:
            offset = addr - self.memory.addr("writable")
            buf[offset : offset + n] = np.frombuffer(scratch[at : at + n], dtype=np.uint8)
            at += n
        return encode_header(_ACK, req_id, 0, 0), self.memory.snapshot()

    def _bytes_at(self, addr: int, n: int) -> bytes:
        for name in ("readable", "writable"):
            offset = addr - self.memory.addr(name)
            if 0 <= offset and offset + n <= self.memory.size(name):
                return self.memory.buffers[name][offset : offset + n].tobytes()
        raise AssertionError("a served range outside every registration")

    @staticmethod
    def _reply_length(answer: Any, scratch: bytearray) -> int:
        """How long the reply to a request the C twin served is: a DATA header and the READ's
        bytes, or a bare ACK."""
        kind, _, end = answer[:3]
        lens = np.frombuffer(bytes(scratch[HEADER_SIZE + 8 : end]), dtype="<u8")[1::2]
        return HEADER_SIZE + (int(lens.sum(dtype=np.uint64)) if kind == _READ else 0)


TARGETS = (TcpReply, TcpLand, TcpLandWords, TcpSend, TcpRequest)
