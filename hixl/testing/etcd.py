"""A real etcd server for tests: on 127.0.0.1, free ports, a temporary data directory.

::

    with EtcdServer() as etcd:
        config = LLMConfig(listen_ip_info="127.0.0.1:0", metadata_server=etcd.url)

Needs the ``etcd`` binary (Debian's ``etcd-server`` package). :meth:`EtcdServer.stop`
(or leaving the ``with``) stops it and removes its data; :meth:`kill` and
:meth:`start` again simulate an outage.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["EtcdServer", "etcd_binary"]


def etcd_binary() -> str | None:
    """The path of the ``etcd`` server binary, or ``None`` if it is not installed."""
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/sbin/etcd") if Path(p).exists()), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd member listening on 127.0.0.1 (see the module docstring)."""

    def __init__(self, startup_timeout: float = 20.0) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("no etcd binary: install Debian's etcd-server package")
        self._binary = binary
        self._startup_timeout = startup_timeout
        self._dir = Path(tempfile.mkdtemp(prefix="hixl-etcd-"))
        self.client_port, self._peer_port = _free_port(), _free_port()
        self.url = f"etcd://127.0.0.1:{self.client_port}"
        """What ``metadata_server`` takes to reach this server."""
        self._process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Start (or restart) the server on the same ports and data; return once it answers."""
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self._peer_port}"
        log = open(self._dir / "etcd.log", "ab")  # noqa: SIM115  (the child keeps it open)
        with log:
            self._process = subprocess.Popen(
                [
                    self._binary, "--name", "hixl-test", "--data-dir", str(self._dir / "data"),
                    "--listen-client-urls", client, "--advertise-client-urls", client,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"hixl-test={peer}",
                ],
                stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + self._startup_timeout
        while not self._healthy():
            if self._process.poll() is not None or time.monotonic() > deadline:
                tail = (self._dir / "etcd.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"etcd did not start on port {self.client_port}:\n{tail}")
            time.sleep(0.05)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_port}/health", timeout=1) as reply:
                return b"true" in reply.read()
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        """SIGKILL the server (its data stays, for :meth:`start`)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(10)

    def stop(self) -> None:
        """Stop the server and remove its data; idempotent."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(10)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
