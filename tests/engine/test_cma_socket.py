"""The socket every engine that serves a connection listens on for cma (where an initiator learns
from the kernel which process the peer is): reached in a directory of any length a socket path
allows; and one left behind by an engine that died without ``finalize`` is removed by the next
engine to make its socket there, while live ones, and any made a moment ago, are left alone."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hixl import Engine
from hixl.transports import CmaTransport, TcpTransport

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A directory short enough for socket paths (pytest's tmp_path is not)."""
    path = Path(tempfile.mkdtemp(prefix="hx", dir="/tmp"))
    yield path
    shutil.rmtree(path)


def _left_behind(path: Path, age: float) -> None:
    """A socket file nobody listens on (its engine died), made ``age`` seconds ago."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.bind(str(path))
    then = time.time() - age
    os.utime(path, (then, then))


@contextmanager
def _serving(socket_dir: Path) -> Iterator[Engine]:
    """An engine whose cma socket goes in ``socket_dir``, once it served a connection."""
    with Engine("127.0.0.1:0", transports=[CmaTransport(socket_dir=socket_dir), TcpTransport()]) as target:
        with Engine("127.0.0.1") as initiator:
            initiator.connect(target.local_engine)
        yield target


def test_sockets_of_dead_engines_are_swept_and_live_ones_kept(socket_dir: Path) -> None:
    dead, starting = socket_dir / "hixl-cma-999999-000000000000.sock", socket_dir / "hixl-cma-999998-000000000000.sock"
    _left_behind(dead, 3600)
    _left_behind(starting, 0)
    with _serving(socket_dir):
        assert not dead.exists()
        (live,) = set(socket_dir.glob("hixl-cma-*.sock")) - {starting}
        os.utime(live, (time.time() - 3600,) * 2)  # an hour old, and listened on
        with _serving(socket_dir):
            assert {live, starting} < set(socket_dir.glob("hixl-cma-*.sock"))  # (and the new engine's own)


def test_a_socket_directory_as_long_as_a_socket_path_allows_still_gives_cma(tmp_path: Path) -> None:
    """The initiator reaches the socket through the target's root (``/proc/<pid>/root``, for a
    target in another mount namespace), which must not shorten the paths a target may use."""
    socket_dir = tmp_path / ("d" * max(0, 70 - len(str(tmp_path))))
    socket_dir.mkdir()
    with _serving(socket_dir) as target, Engine("127.0.0.1", {"transport": "cma"}) as initiator:
        (path,) = socket_dir.glob("hixl-cma-*.sock")
        assert len(os.fsencode(str(path)) + f"/proc/{os.getpid()}/root".encode()) >= 108  # too long, put together
        initiator.connect(target.local_engine)
        assert initiator.transport_of(target.local_engine) == "cma"
