"""The raw measurements hixl is judged against, built from nothing but the kernel and numpy.

Each function returns a zero-argument *copier*: a closure that moves the
bytes once, with every argument (iovec arrays, pointers, views) prepared in
advance so that timing it measures the syscalls, not the set-up. They bind
their own ctypes functions instead of reusing hixl's, so a change to hixl
can never make its own yardstick slower.

* :func:`cma_copier` / :func:`cma_batch_copier` — bare ``process_vm_readv`` /
  ``process_vm_writev``; the batch one passes IOV_MAX iovecs per call.
* :class:`RawStream` — a plain TCP stream to the bench target's raw server,
  ``sendall`` / one ``recv_into(..., MSG_WAITALL)`` of the same byte count; and
  its round trip: blocking 8-byte request/response with TCP_NODELAY, the
  plainest loop Python can write (the latency baseline).
* :func:`memcpy_copier` — ``numpy.copyto`` in one process: the ceiling (and
  shm's baseline: it copies in one process too, through mapped memory).
* :func:`gather_copier` — ``numpy.take`` of the same blocks between the same
  kinds of buffers in one process: shm's baseline for a scattered batch.
"""

from __future__ import annotations

import ctypes
import os
import socket
from collections.abc import Callable

import numpy as np

from .._types import Op
from .target import ECHO, ECHO_SIZE, RAW_HEADER, STREAM

__all__ = ["IOV_MAX", "Copier", "RawStream", "cma_batch_copier", "cma_copier", "gather_copier", "memcpy_copier"]

Copier = Callable[[], None]

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

_libc = ctypes.CDLL(None, use_errno=True)
_process_vm_readv = _libc.process_vm_readv
_process_vm_writev = _libc.process_vm_writev
for _fn in (_process_vm_readv, _process_vm_writev):
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _fn.restype = ctypes.c_ssize_t


def _cma_call(op: Op) -> Callable[..., int]:
    return _process_vm_readv if op is Op.READ else _process_vm_writev


def _raise_errno(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def cma_copier(pid: int, op: Op, local_addr: int, remote_addr: int, nbytes: int) -> Copier:
    """One contiguous range between this process and ``pid``, one syscall when it completes at once."""
    call = _cma_call(op)
    iov = np.array([[local_addr, nbytes], [remote_addr, nbytes]], dtype=np.uint64)
    local_ptr = int(iov.ctypes.data)
    remote_ptr = local_ptr + 16

    def copy() -> None:
        moved = call(pid, local_ptr, 1, remote_ptr, 1, 0)
        if moved != nbytes:  # partial (a page boundary the kernel stopped at) or an error: finish it
            _finish(call, pid, local_addr, remote_addr, nbytes, moved)

    copy.keepalive = iov  # type: ignore[attr-defined]
    return copy


def _finish(call: Callable[..., int], pid: int, local: int, remote: int, nbytes: int, moved: int) -> None:
    done = 0
    rest = np.zeros((2, 2), dtype=np.uint64)
    while True:
        if moved < 0:
            _raise_errno("process_vm copy failed")
        if moved == 0:
            raise OSError("process_vm copy made no progress")
        done += moved
        if done >= nbytes:
            return
        rest[:] = [[local + done, nbytes - done], [remote + done, nbytes - done]]
        moved = call(pid, rest.ctypes.data, 1, rest.ctypes.data + 16, 1, 0)


def cma_batch_copier(pid: int, op: Op, local: np.ndarray, remote: np.ndarray) -> Copier:
    """Scattered blocks: ``local``/``remote`` are ``(N, 2)`` uint64 iovec arrays of equal lengths.

    One syscall per IOV_MAX iovecs — the best a batched caller can do.
    """
    call = _cma_call(op)
    local = np.ascontiguousarray(local, dtype=np.uint64)
    remote = np.ascontiguousarray(remote, dtype=np.uint64)
    windows = []
    for start in range(0, len(local), IOV_MAX):
        count = min(IOV_MAX, len(local) - start)
        expect = int(local[start : start + count, 1].sum())
        windows.append((int(local.ctypes.data) + 16 * start, int(remote.ctypes.data) + 16 * start, count, expect))

    def copy() -> None:
        for local_ptr, remote_ptr, count, expect in windows:
            moved = call(pid, local_ptr, count, remote_ptr, count, 0)
            if moved != expect:
                if moved < 0:
                    _raise_errno("batched process_vm copy failed")
                raise OSError(f"batched process_vm copy moved {moved} of {expect} bytes")

    copy.keepalive = (local, remote)  # type: ignore[attr-defined]
    return copy


def memcpy_copier(dst: np.ndarray, src: np.ndarray) -> Copier:
    """``numpy.copyto(dst, src)``: a plain in-process copy."""

    def copy() -> None:
        np.copyto(dst, src)

    return copy


def gather_copier(dst_blocks: np.ndarray, src_blocks: np.ndarray, order: np.ndarray) -> Copier:
    """``dst_blocks[i] = src_blocks[order[i]]`` for every row ``i``, in one ``numpy.take``.

    ``mode="clip"`` (the indices are valid anyway) lets numpy write straight into
    ``out``; with the default ``"raise"`` it gathers into a temporary first and runs
    at about a third of the speed, which would flatter whatever is compared with it.
    """
    index = np.ascontiguousarray(order, dtype=np.intp)

    def copy() -> None:
        np.take(src_blocks, index, axis=0, out=dst_blocks, mode="clip")

    return copy


class RawStream:
    """A plain socket to the bench target's raw server (see :mod:`hixl.bench.target`)."""

    def __init__(self, address: tuple[str, int], timeout: float = 30.0, echo: bool = False) -> None:
        self.sock = socket.create_connection(address, timeout=timeout)
        # Blocking from here on: a socket with a timeout polls before every call, and the
        # baseline should be the plainest stream there is.
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(ECHO if echo else STREAM)

    def round_trip(self) -> Copier:
        """One 8-byte request and its 8-byte answer (a stream made with ``echo=True``)."""
        sock = self.sock
        message = bytearray(ECHO_SIZE)

        def copy() -> None:
            sock.send(message)
            if sock.recv_into(message, ECHO_SIZE, socket.MSG_WAITALL) != ECHO_SIZE:
                raise ConnectionError("raw server closed the stream")

        return copy

    def copier(self, op: Op, local: memoryview, remote_addr: int) -> Copier:
        """READ: ask for ``len(local)`` bytes and ``recv_into`` them; WRITE: send them, await one byte."""
        sock = self.sock
        nbytes = len(local)
        header = RAW_HEADER.pack(b"R" if op is Op.READ else b"W", remote_addr, nbytes)
        ack = bytearray(1)

        if op is Op.READ:

            def copy() -> None:
                sock.sendall(header)
                got = sock.recv_into(local, nbytes, socket.MSG_WAITALL)  # one call, unless a signal cut it
                while got < nbytes:
                    n = sock.recv_into(local[got:], nbytes - got, socket.MSG_WAITALL)
                    if n == 0:
                        raise ConnectionError("raw server closed the stream")
                    got += n

        else:

            def copy() -> None:
                sent = sock.sendmsg([header, local])  # header and data in one syscall when they fit
                if sent < len(header) + nbytes:
                    if sent < len(header):
                        sock.sendall(header[sent:])
                        sent = len(header)
                    sock.sendall(local[sent - len(header) :])
                if sock.recv_into(ack) != 1:
                    raise ConnectionError("raw server closed the stream")

        return copy

    def close(self) -> None:
        """Close the socket (the server's thread for it then ends)."""
        self.sock.close()
