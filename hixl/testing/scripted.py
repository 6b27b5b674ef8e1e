"""A scripted peer: one end of a real hixl connection whose every frame a test chooses.

It runs the same :class:`~hixl._protocol.connection.Connection` state machine
the engine does — so a script that follows the protocol is checked by it, and
a handshake works against real engines, secret included — and adds fault
injection on top: raw bytes that bypass the state machine, truncated frames,
stalls, dying in the middle of a reply. Use it to reach failures a real peer
only shows by chance::

    def script(peer: ScriptedPeer) -> None:
        peer.accept_handshake(regions=[(0x7000_0000_0000, 1 << 20, 1)])
        read = peer.recv()
        peer.send(proto.Data(read.req_id, 1 << 20))   # promise data ...
        peer.send_raw(b"\\x01" * 100)                  # ... deliver a little, then die

    with ScriptedTarget(script) as fake:
        engine.connect(fake.engine)
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from .. import _protocol as proto
from .._exceptions import ProtocolError
from .._protocol.auth import Secret
from .._protocol.connection import NEED_DATA, Connection, ConnectionClosed, Role

__all__ = ["ScriptedPeer", "ScriptedTarget"]


class ScriptedPeer:
    """A test's end of one connection (see the module docstring).

    ``role`` is the side this peer plays; ``secret`` the shared secret it knows.
    Every receive waits at most ``timeout`` seconds (``TimeoutError``).
    """

    def __init__(self, sock: socket.socket, role: Role, secret: str | bytes | None = None, timeout: float = 20.0) -> None:
        sock.settimeout(timeout)
        self.sock = sock
        self.conn = Connection(role, Secret.from_option(secret) if secret is not None else None)
        self.answer_pings = True
        """Answer PING with PONG while waiting for something else (a live peer); False plays dead."""

    @classmethod
    def connect(
        cls, address: str, secret: str | bytes | None = None, timeout: float = 20.0, source: str | None = None
    ) -> ScriptedPeer:
        """A scripted *initiator* connected to ``address`` (``"ip:port"``), handshake not yet run.

        ``source``: the local address to connect from (e.g. ``"127.0.0.7"``, to play another host).
        """
        host, port = address.rsplit(":", 1)
        bind = (source, 0) if source else None
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout, source_address=bind)
        return cls(sock, Role.INITIATOR, secret, timeout)

    # -- handshakes --------------------------------------------------------------------------------
    def handshake(self, info: dict[str, Any] | None = None) -> dict[str, Any]:
        """As initiator: run the whole handshake; returns what the target's WELCOME said."""
        self.send_raw(self.conn.initiate())
        self._expect(proto.Challenge)
        self.send_raw(self.conn.authenticate(info or {"engine": "127.0.0.1", "engine_id": "scripted"}))
        self._expect(proto.Welcome)
        return self.conn.peer_info

    def accept_handshake(self, regions: list[tuple[int, int, int]] = (), **info: Any) -> dict[str, Any]:  # type: ignore[assignment]
        """As target: answer HELLO and AUTH and send a WELCOME listing ``regions`` (addr, len, flags).

        Returns what the initiator said about itself. ``info`` adds WELCOME fields (the regions are
        of registration generation 1 unless it names another).
        """
        self._expect(proto.Hello)
        self.send_raw(self.conn.challenge())
        self._expect(proto.Auth)
        welcome = {"engine": "scripted", "engine_id": "scripted", "generation": 1, "regions": [list(r) for r in regions], **info}
        welcome.setdefault("transports", {"tcp": {}})
        self.send_raw(self.conn.welcome(welcome))
        return self.conn.peer_info

    def _expect(self, kind: type) -> Any:
        message = self.recv()
        if not isinstance(message, kind):
            raise AssertionError(f"expected {kind.__name__}, got {message!r}")
        return message

    # -- sending -----------------------------------------------------------------------------------
    def send(self, message: proto.Message, data: bytes = b"") -> None:
        """Send a frame the state machine allows, then ``data`` (its bulk payload, or part of it)."""
        self.sock.sendall(self.conn.send(message) + data)

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are: no state machine, no checks (fault injection)."""
        self.sock.sendall(data)

    # -- receiving ---------------------------------------------------------------------------------
    def recv(self) -> proto.Message:
        """The next frame that is not a heartbeat; ``EOFError`` if the other end closed."""
        while True:
            event = self.conn.next_event()
            if event is NEED_DATA:
                self._fill()
                continue
            if isinstance(event, ConnectionClosed):
                raise EOFError(self.conn.closed_reason)
            if isinstance(event, proto.Ping):
                if self.answer_pings:
                    self.send(proto.Pong(event.req_id))
                continue
            if isinstance(event, proto.Pong) and event.req_id == 0:
                continue
            return event  # type: ignore[return-value]

    def recv_data(self) -> bytes:
        """The bulk data that follows the last frame received (all of it)."""
        chunks = [self.conn.take_data(self.conn.data_left)]
        while self.conn.data_left:
            chunk = self.sock.recv(min(self.conn.data_left, 1 << 20))
            if not chunk:
                raise EOFError("closed in the middle of data")
            self.conn.data_moved(len(chunk))
            chunks.append(chunk)
        return b"".join(chunks)

    def _fill(self) -> None:
        self.conn.receive_data(self.sock.recv(1 << 16))

    def expect_closed(self, timeout: float = 5.0) -> list[proto.Message]:
        """Read until the other end closes the connection; return the frames it sent first."""
        self.sock.settimeout(timeout)
        frames: list[proto.Message] = []
        try:
            while True:
                frames.append(self.recv())
                if self.conn.data_left:
                    self.recv_data()
        except (EOFError, ConnectionResetError):
            return frames
        except ProtocolError:  # the other end closed mid-frame
            return frames

    def recv_raw(self) -> proto.Message:
        """The next frame, decoded by the codec alone: no state machine, no proofs checked.

        For looking at what a peer sends to someone who failed its checks (the
        state machine would refuse to go on). ``EOFError`` once the peer closed.
        """
        header = proto.parse_header(self._recv_exact(proto.HEADER_SIZE))
        message = proto.parse_body(header, self._recv_exact(header.body_len))
        self._recv_exact(header.data_len)
        return message

    def _recv_exact(self, nbytes: int) -> bytes:
        data = b""
        while len(data) < nbytes:
            chunk = self.sock.recv(nbytes - len(data))
            if not chunk:
                raise EOFError(f"closed after {len(data)} of {nbytes} bytes")
            data += chunk
        return data

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def __enter__(self) -> ScriptedPeer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ScriptedTarget:
    """Listens on 127.0.0.1; runs ``script(peer)`` for the first connection on a thread.

    Leaving the ``with`` block (or :meth:`close`) joins the script and re-raises
    what it raised (a failed assertion in the script fails the test); the
    initiator hanging up early is fine.
    """

    def __init__(self, script: Callable[[ScriptedPeer], None], secret: str | bytes | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.engine = f"127.0.0.1:{self.listener.getsockname()[1]}"
        """The address to ``connect`` to."""
        self.error: BaseException | None = None
        self._secret = secret
        self.thread = threading.Thread(target=self._run, args=(script,), daemon=True)
        self.thread.start()

    def _run(self, script: Callable[[ScriptedPeer], None]) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return  # closed before anyone connected
        try:
            script(ScriptedPeer(sock, Role.TARGET, self._secret))
        except (EOFError, ConnectionError, OSError):
            pass  # the initiator went away: fine for a fake
        except BaseException as exc:  # noqa: BLE001  (re-raised by close())
            self.error = exc
        finally:
            sock.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop listening, join the script, and re-raise its failure."""
        self.listener.close()
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError("the scripted target's script did not finish")
        if self.error is not None:
            raise self.error

    def __enter__(self) -> ScriptedTarget:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
