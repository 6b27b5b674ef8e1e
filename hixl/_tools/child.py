"""A Python child process driven over a pipe, for test peers and the demo's workers.

The child is a fresh interpreter started as ``python -m MODULE FD`` — not a
fork, since the parent may be running engine threads, and not
``multiprocessing``'s spawn, which re-imports the caller's ``__main__``. It
receives one end of a socket pair as ``FD`` and talks pickled messages over it
(see :func:`child_connection`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, TypeVar

__all__ = ["ChildProcess", "CommandChild", "child_connection", "serve_commands"]


def _package_root() -> str:
    """The folder that holds the ``hixl`` package (this file is ``hixl/_tools/child.py``)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_connection() -> Connection:
    """In the child: the connection to the parent (from ``sys.argv[1]``)."""
    return Connection(int(sys.argv[1]))


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def serve_commands(
    conn: Connection,
    handler: Callable[[str, Any], Any],
    error_reply: Callable[[Exception], Any] = _describe,
) -> None:
    """In the child: answer ``(command, args)`` messages until ``("exit", ...)`` or the parent hangs up.

    Each reply is ``("ok", handler(command, args))`` or, if that raised,
    ``("error", error_reply(exc))``: a failing command is reported to the
    parent, which decides what to raise, and the child keeps serving.
    """
    try:
        while True:
            command, args = conn.recv()
            if command == "exit":
                return
            try:
                reply = ("ok", handler(command, args))
            except Exception as exc:  # reported to the parent; the child keeps serving
                reply = ("error", error_reply(exc))
            conn.send(reply)
    except (EOFError, KeyboardInterrupt):
        return


class ChildProcess:
    """Start ``python -m module``; :meth:`request` sends a message and waits for the reply.

    ``prefix`` is a command that execs the rest (``["ip", "netns", "exec", "ns1"]``: the child
    runs in another network namespace, with the same pid). ``env`` adds to the environment it inherits.
    """

    def __init__(
        self, module: str, timeout: float = 30.0, prefix: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> None:
        self.timeout = timeout
        ours, theirs = socket.socketpair()
        # The child must import the same hixl as the parent, installed or not.
        path = os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH")]))
        with ours, theirs:
            self.process = subprocess.Popen(
                [*prefix, sys.executable, "-m", module, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env={**os.environ, **(env or {}), "PYTHONPATH": path},
            )
            self.conn = Connection(ours.detach())

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.process.pid

    def send(self, message: Any) -> None:
        """Send without waiting for a reply."""
        self.conn.send(message)

    def receive(self, timeout: float | None = None) -> Any:
        """The next message from the child; ``TimeoutError`` (and the child killed) if none comes."""
        limit = self.timeout if timeout is None else timeout
        if not self.conn.poll(limit):
            self.kill()
            raise TimeoutError(f"child {self.process.args!r} did not answer within {limit} s")
        try:
            return self.conn.recv()
        except EOFError:
            code = self.process.wait(10)
            raise ChildProcessError(f"child {self.process.args!r} exited (code {code}) without answering") from None

    def request(self, message: Any, timeout: float | None = None) -> Any:
        """Send ``message`` and return the reply."""
        self.send(message)
        return self.receive(timeout)

    def command(self, command: str, *args: Any, who: str) -> Any:
        """Ask a child that runs :func:`serve_commands` for ``command(*args)``; see :meth:`answer`."""
        self.send((command, args))
        return self.answer(command, who)

    def answer(self, command: str, who: str, timeout: float | None = None) -> Any:
        """The reply to ``command``, sent to a child that runs :func:`serve_commands`: its value, or
        ``RuntimeError("{who} could not {command}: ...")`` with what the child reported."""
        status, value = self.receive(timeout)
        if status == "error":
            raise RuntimeError(f"{who} could not {command}: {value}")
        return value

    def signal(self, signum: int) -> None:
        """Send a signal (e.g. SIGSTOP / SIGCONT to simulate a hung process)."""
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL the child, as a crash would, and reap it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait(10)

    def close(self, goodbye: Any = None) -> None:
        """Send ``goodbye`` (if any), wait for a clean exit, kill if it doesn't come."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            try:
                if goodbye is not None:
                    self.conn.send(goodbye)
                self.process.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.process.poll() is None:
            self.kill()
        self.conn.close()


_Handle = TypeVar("_Handle", bound="CommandChild")


class CommandChild:
    """The parent's handle on a child that runs :func:`serve_commands` and leaves on ``("exit", ())``:
    ``_do(command, *args)`` asks it, :meth:`close` ends it; a context manager. A subclass starts
    ``_child`` and names itself in ``who`` (its errors read "{who} could not {command}: ...").
    Handles that expose the child's commands as they are use :meth:`do`, or :meth:`start` and
    :meth:`answer` to run several children's commands at once."""

    who = "child process"
    answer_timeout = 60.0
    """How long :meth:`answer` waits unless told."""
    _child: ChildProcess

    def _do(self, command: str, *args: Any) -> Any:
        return self._child.command(command, *args, who=self.who)

    def do(self, command: str, *args: Any) -> Any:
        """Run ``command(*args)`` in the child and return its result (a RuntimeError naming what it raised)."""
        return self._do(command, *args)

    def start(self, command: str, *args: Any) -> None:
        """Send ``command`` without waiting for its answer (see :meth:`answer`)."""
        self._child.send((command, args))

    def answer(self, command: str, timeout: float | None = None) -> Any:
        """The answer to the command :meth:`start` sent (within ``timeout``, else :attr:`answer_timeout`)."""
        return self._child.answer(command, self.who, self.answer_timeout if timeout is None else timeout)

    def close(self) -> None:
        """Ask the child to finish and exit; kill it if it does not."""
        self._child.close(goodbye=("exit", ()))

    def __enter__(self: _Handle) -> _Handle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
