"""A target engine in a child process, driven over a pipe (see :class:`TargetProcess`)."""

from __future__ import annotations

import functools
import os
import pickle
import signal
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .._tools.child import ChildProcess, serve_commands

__all__ = ["TargetProcess"]


def _serve(conn: Connection) -> None:
    from .. import Engine, empty  # imported in the child only

    address, options, sizes, transport_paths, shared = conn.recv()
    transports = [load_transport(path)() for path in transport_paths or []]
    engine = Engine(address, options, transports=transports or None)
    buffers = [empty(size, shared=shared) for size in sizes]
    handles = [engine.register_mem(buf) for buf in buffers]
    conn.send((engine.local_engine, [int(b.ctypes.data) for b in buffers], os.getpid()))
    commands: dict[str, Callable[..., Any]] = {**_COMMANDS, "transport_call": functools.partial(_transport_call, transports)}
    try:
        serve_commands(conn, lambda command, args: commands[command](engine, buffers, handles, *args), _picklable)
    finally:
        engine.finalize()


def load_transport(path: str) -> Any:
    """The transport class named ``"package.module:Class"``."""
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _picklable(error: Exception) -> Exception:
    """``error`` itself if it can travel to the parent, else a RuntimeError with its text."""
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001  (any unpicklable error still reaches the parent as text)
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _fill(engine: Any, buffers: list[np.ndarray], handles: list[Any], index: int, seed: int) -> None:
    buffers[index][:] = np.random.default_rng(seed).integers(0, 256, buffers[index].size, dtype=np.uint8)


def _read(engine: Any, buffers: list[np.ndarray], handles: list[Any], index: int, start: int, nbytes: int) -> bytes:
    return buffers[index][start : start + nbytes].tobytes()


def _write(engine: Any, buffers: list[np.ndarray], handles: list[Any], index: int, start: int, data: bytes) -> None:
    buffers[index][start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)


def _add_buffer(
    engine: Any, buffers: list[np.ndarray], handles: list[Any], size: int, access: str, shared: bool
) -> int:
    from .. import MemType, empty

    buffers.append(empty(size, shared=shared))
    handles.append(engine.register_mem(buffers[-1], MemType.HOST, access))
    return int(buffers[-1].ctypes.data)


def _limit_fds(engine: Any, buffers: list[np.ndarray], handles: list[Any], extra: int) -> int:
    """Lower the soft RLIMIT_NOFILE to the descriptors open now plus ``extra``; returns it."""
    import resource

    limit = len(os.listdir("/proc/self/fd")) + extra
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return limit


def _memory(engine: Any, buffers: list[np.ndarray], handles: list[Any]) -> tuple[int, int]:
    """Resident set size in bytes and the number of live threads."""
    import threading

    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return rss_pages * os.sysconf("SC_PAGE_SIZE"), threading.active_count()


def _deregister(engine: Any, buffers: list[np.ndarray], handles: list[Any], index: int) -> None:
    engine.deregister_mem(handles[index])


def _notifies(engine: Any, buffers: list[np.ndarray], handles: list[Any]) -> list[tuple[str, str]]:
    return [(n.name, n.msg) for n in engine.get_notifies()]


def _wait_notifies(
    engine: Any, buffers: list[np.ndarray], handles: list[Any], timeout: float, index: int, start: int, nbytes: int
) -> tuple[list[tuple[str, str]], bytes]:
    # Copy the range the moment the first notification is seen, so the caller
    # learns what the target's memory held *when* it was notified.
    got = engine.wait_notifies(timeout)
    if not got:
        return [], b""
    snapshot = buffers[index][start : start + nbytes].tobytes()
    return [(n.name, n.msg) for n in got], snapshot


def _call(engine: Any, buffers: list[np.ndarray], handles: list[Any], method: str, args: tuple) -> Any:
    return getattr(engine, method)(*args)


def _transport_call(
    transports: list[Any], engine: Any, buffers: list[np.ndarray], handles: list[Any], name: str, method: str, args: tuple
) -> Any:
    (transport,) = [t for t in transports if t.capabilities.name == name]
    return getattr(transport, method)(*args)


_COMMANDS: dict[str, Callable[..., Any]] = {
    "fill": _fill,
    "read": _read,
    "write": _write,
    "add_buffer": _add_buffer,
    "limit_fds": _limit_fds,
    "memory": _memory,
    "deregister": _deregister,
    "notifies": _notifies,
    "wait_notifies": _wait_notifies,
    "call": _call,
}


def _all_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is in the stopped state (Linux /proc)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # gone: it won't answer either
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]  # the name may contain spaces
        except (FileNotFoundError, ProcessLookupError):
            continue  # that thread ended
        if state not in ("T", "t"):
            return False
    return True


class TargetProcess:
    """Start ``Engine(address, options)`` in a child process with registered buffers.

    ``sizes`` are the byte sizes of page-aligned buffers the child allocates and
    registers before it reports back. Attributes once started: ``engine``
    (the child's ``"ip:port"``), ``addrs`` (buffer addresses in the child),
    ``pid``. Methods run in the child: :meth:`fill`, :meth:`read`,
    :meth:`write`, :meth:`add_buffer`, :meth:`deregister`, :meth:`notifies`,
    :meth:`wait_notifies`, :meth:`call` (any Engine method), :meth:`transport_call`; an exception raised
    in the child is raised again by the method. :meth:`kill` simulates a crash.
    ``transports`` names the transport classes the child's engine uses
    (``"package.module:Class"``, most preferred first; default: the built-in ones).
    ``prefix`` runs the child under a command that execs it (e.g. ``ip netns exec NS``).
    ``shared``: the buffers come from hixl's shared-memory pool (``hixl.empty(..., shared=True)``),
    which the shm transport can move; :meth:`add_buffer` follows it unless told otherwise.
    """

    def __init__(
        self,
        sizes: list[int],
        options: dict[str, Any] | None = None,
        address: str = "127.0.0.1:0",
        timeout: float = 30.0,
        transports: list[str] | None = None,
        prefix: Sequence[str] = (),
        shared: bool = False,
    ) -> None:
        self.shared = shared
        self._child = ChildProcess("hixl.testing._target_main", timeout, prefix)
        self.engine, self.addrs, self.pid = self._child.request((address, options or {}, sizes, transports, shared))

    def _do(self, command: str, *args: Any) -> Any:
        status, value = self._child.request((command, args))
        if status == "error":
            raise value
        return value

    def fill(self, index: int, seed: int) -> None:
        """Fill buffer ``index`` with seeded random bytes (``expected(...)`` recreates them)."""
        self._do("fill", index, seed)

    def read(self, index: int, start: int, nbytes: int) -> bytes:
        """Bytes ``[start, start+nbytes)`` of buffer ``index``, as the child sees them."""
        return self._do("read", index, start, nbytes)  # type: ignore[no-any-return]

    def write(self, index: int, start: int, data: bytes) -> None:
        """Set bytes of buffer ``index`` from the child's side."""
        self._do("write", index, start, data)

    def add_buffer(self, size: int, access: str = "rw", shared: bool | None = None) -> int:
        """Allocate and register another buffer (``access`` as in ``register_mem``; from the pool if
        ``shared``, default: as the first buffers); returns its address."""
        addr = self._do("add_buffer", size, access, self.shared if shared is None else shared)
        self.addrs.append(addr)
        return addr  # type: ignore[no-any-return]

    def limit_fds(self, extra: int) -> int:
        """Let the child open only ``extra`` more file descriptors (fault injection: EMFILE)."""
        return self._do("limit_fds", extra)  # type: ignore[no-any-return]

    def memory(self) -> tuple[int, int]:
        """The child's resident set size in bytes and its number of threads."""
        return self._do("memory")  # type: ignore[no-any-return]

    def deregister(self, index: int) -> None:
        """Deregister buffer ``index`` in the child."""
        self._do("deregister", index)

    def notifies(self) -> list[tuple[str, str]]:
        """Drain the child's notifications as ``(name, msg)`` pairs."""
        return self._do("notifies")  # type: ignore[no-any-return]

    def wait_notifies(
        self, timeout: float, index: int = 0, start: int = 0, nbytes: int = 0
    ) -> tuple[list[tuple[str, str]], bytes]:
        """Wait up to ``timeout`` s for notifications, then at once copy bytes of buffer ``index``.

        Returns the drained ``(name, msg)`` pairs and the copy, taken in the
        child right after it first saw a notification (``([], b"")`` on
        timeout): what the target's memory held when it was notified.
        """
        return self._do("wait_notifies", timeout, index, start, nbytes)  # type: ignore[no-any-return]

    def call(self, method: str, *args: Any) -> Any:
        """Call ``Engine.method(*args)`` in the child and return its (picklable) result."""
        return self._do("call", method, args)

    def transport_call(self, name: str, method: str, *args: Any) -> Any:
        """Call ``method(*args)`` of the child's transport called ``name`` (one of those named in
        ``transports``, e.g. a test's own that counts what it serves) and return its result."""
        return self._do("transport_call", name, method, args)

    @staticmethod
    def expected(size: int, seed: int) -> np.ndarray:
        """The bytes :meth:`fill` writes for ``size`` and ``seed``."""
        return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)

    def kill(self) -> None:
        """SIGKILL the child, as a crash would."""
        self._child.kill()

    def stop(self, signum: int = signal.SIGSTOP) -> None:
        """Freeze (SIGSTOP) or resume (SIGCONT) the child, to simulate a hung peer.

        SIGSTOP returns only once every thread of the child has stopped: the signal
        takes effect asynchronously, and a thread still running could serve a
        request that the caller expects to hang.
        """
        self._child.signal(signum)
        if signum == signal.SIGSTOP:
            deadline = time.monotonic() + self._child.timeout
            while not _all_stopped(self.pid):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"target process {self.pid} did not stop")
                time.sleep(0.001)

    def close(self) -> None:
        """Ask the child to finalize and exit; kill it if it doesn't."""
        self._child.close(goodbye=("exit", ()))

    @property
    def exitcode(self) -> int | None:
        """The child's exit code once it ended."""
        return self._child.process.poll()

    def __enter__(self) -> TargetProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
