"""The ``ps`` scenario's servers, each a child process: a hixl :class:`~hixl.weights.Table` and a two-sided RPC server.

Both hold the same table: ``rows`` rows of 32 uint64 words (256 bytes), word
``j`` of row ``i`` being ``32 * i + j`` (:func:`expected_rows`), so a worker can
check any row it got, byte for byte, without asking (a row from the wrong index
or offset reads differently).

* ``role="table"``: a listening engine and a :class:`~hixl.weights.Table` filled
  with those rows (one update per 64 Ki rows). Then it only waits: workers read
  it one-sidedly (:meth:`~hixl.weights.Subscriber.pull_rows`).
* ``role="rpc"``: the baseline, written the way one would write it in Python and
  numpy: a TCP server on 127.0.0.1 that reads a request — a little-endian u32
  count, then that many int64 row indices — gathers the rows with numpy
  (``table[indices]``) and sends them back (:func:`rpc_gather` is the client's
  side). One thread per connection (the accept loop of the bench target's raw server).
"""

from __future__ import annotations

import os
import socket
import struct
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .._tools.child import ChildProcess, CommandChild, child_connection, serve_commands
from .target import _RawServer, recv_exact, tune_stream

__all__ = [
    "ROW_WORDS",
    "TABLE_NAME",
    "RpcClient",
    "ServerProcess",
    "expected_rows",
    "main",
]

ROW_WORDS = 32  # 256-byte rows
TABLE_NAME = "ps"
_COUNT = struct.Struct("<I")
_FILL_ROWS = 1 << 16  # rows per table update while filling: bounds the temporary arrays
TIMEOUT = 120.0


def expected_rows(indices: np.ndarray) -> np.ndarray:
    """The rows ``indices`` of the scenario's table: ``(len(indices), 32)`` uint64, word j of row i = 32 i + j."""
    rows = np.asarray(indices, dtype=np.uint64)[:, None] * np.uint64(ROW_WORDS)
    return rows + np.arange(ROW_WORDS, dtype=np.uint64)  # type: ignore[no-any-return]


# -- the children ------------------------------------------------------------------------------
def _table(rows: int) -> tuple[Any, str]:
    from .. import Engine
    from ..weights import Table

    engine = Engine("127.0.0.1:0")
    table = Table(engine, TABLE_NAME, (rows, ROW_WORDS), np.uint64)
    for start in range(0, rows, _FILL_ROWS):
        indices = np.arange(start, min(start + _FILL_ROWS, rows))
        table.update(indices, expected_rows(indices))
    return (table, engine), engine.local_engine


class _RpcServer(_RawServer):
    """The two-sided baseline (see the module docstring): the bench target's raw server, another protocol."""

    def __init__(self, rows: int) -> None:
        self.table = expected_rows(np.arange(rows))
        super().__init__({}, "127.0.0.1")

    @property
    def address(self) -> str:
        """``"ip:port"`` it listens on."""
        return f"127.0.0.1:{self.port}"

    def _serve(self, sock: socket.socket) -> None:
        header = bytearray(_COUNT.size)
        with sock:
            try:
                while recv_exact(sock, memoryview(header)):
                    (count,) = _COUNT.unpack(header)
                    indices = np.empty(count, dtype=np.int64)
                    if not recv_exact(sock, indices.data.cast("B")):
                        return
                    sock.sendall(self.table[indices].data)
            except (OSError, ValueError, IndexError):
                pass  # the worker went away, or asked for nonsense: drop the connection


def _serve(conn: Connection) -> None:
    """The child's main loop: ``(role, rows)`` in, ``(pid, address)`` out, then wait for ``exit``."""
    role, rows = conn.recv()
    if role == "table":
        (table, engine), address = _table(rows)
    else:
        server = _RpcServer(rows)
        address = server.address
    conn.send((os.getpid(), address))
    try:
        serve_commands(conn, lambda command, args: None)
    finally:
        if role == "table":
            table.close()
            engine.finalize()
        else:
            server.listener.close()


def main() -> None:
    """The child's entry point (``python -m hixl.bench._ps_server_main FD``)."""
    _serve(child_connection())


# -- the parent's side ----------------------------------------------------------------------------
class ServerProcess(CommandChild):
    """A ``ps`` server child (``role``: ``"table"`` or ``"rpc"``); ``pid`` and ``address`` (``"ip:port"``)."""

    def __init__(self, role: str, rows: int) -> None:
        self.who = f"ps {role} server"
        self._child = ChildProcess("hixl.bench._ps_server_main", TIMEOUT)
        try:
            self.pid, self.address = self._child.request((role, rows))
        except BaseException:
            self._child.kill()
            raise


class RpcClient:
    """The worker's side of the RPC baseline: one connection, one request at a time."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        tune_stream(self.sock)

    def gather(self, indices: np.ndarray, out: np.ndarray) -> None:
        """Rows ``indices`` (int64) into ``out`` (``(len(indices), 32)`` uint64, C-contiguous)."""
        self.sock.sendall(_COUNT.pack(len(indices)) + indices.tobytes())
        if not recv_exact(self.sock, out.data.cast("B")):
            raise ConnectionError("the RPC server closed the connection")

    def close(self) -> None:
        self.sock.close()
