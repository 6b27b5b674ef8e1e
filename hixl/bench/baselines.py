"""The raw measurements hixl is judged against, built from nothing but the kernel and numpy.

Each function returns a zero-argument *copier*: a closure that moves the
bytes once, with every argument (iovec arrays, pointers, views) prepared in
advance so that timing it measures the syscalls, not the set-up. They bind
their own ctypes functions instead of reusing hixl's, so a change to hixl
can never make its own yardstick slower. Each is the fastest plain loop we
found (docs/tools.md, "How the baselines are built", says why; docs/measurements.md has the figures):

* :func:`cma_copier` / :func:`cma_batch_copier` — bare ``process_vm_readv`` /
  ``process_vm_writev``, one call per transfer (the batch one: per IOV_MAX
  iovecs, split over threads as hixl's copy lanes split a batch; :func:`cma_lanes_copier`
  one range split so), its arguments converted to C
  once, not at every call; below
  :data:`GIL_HELD_BELOW` bytes without releasing the GIL around the call.
* :func:`proc_mem_copier` — one bare ``pread`` / ``pwrite`` on the target's
  ``/proc/<pid>/mem``: the call hixl's cma makes for one descriptor of up to
  :data:`hixl._accel.PROC_MEM_MAX` bytes, and faster there than ``process_vm_*``
  (its arguments, too, converted once; the GIL held).
* :class:`RawStream` — a plain TCP stream to the bench target's raw server:
  ``sendall`` / :func:`~hixl.bench.target.recv_exact` of the same byte count at a
  raised low-water mark; and its round trip: blocking 8-byte request/response
  with TCP_NODELAY, the plainest loop Python can write (the latency baseline).
* :func:`memcpy_copier` — a memoryview slice assignment (one ``memcpy``) in one
  process: the ceiling (and shm's baseline: it copies in one process too,
  through mapped memory; from 16 MiB, the faster of it and the same copy with
  streaming stores, :mod:`hixl.bench.streaming_memcpy`).
* :func:`gather_copier` — ``numpy.take`` of the same blocks between the same
  kinds of buffers in one process: shm's baseline for a scattered batch.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .._types import Op
from .target import ECHO, ECHO_SIZE, RAW_HEADER, STREAM, await_bytes, readable, recv_exact, tune_stream

__all__ = [
    "GIL_HELD_BELOW",
    "IOV_MAX",
    "Copier",
    "RawStream",
    "cma_batch_copier",
    "cma_copier",
    "cma_lanes_copier",
    "gather_copier",
    "memcpy_copier",
    "proc_mem_copier",
    "proc_mem_opens",
]

Copier = Callable[[], None]

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
GIL_HELD_BELOW = 64 << 10
"""Copies smaller than this call the kernel without releasing the GIL (``ctypes.PyDLL``): that
hand-off costs about as much as an 8-byte copy, and hixl's own small copies skip it too."""


def _bind(library: ctypes.CDLL, name: str) -> Any:
    fn = getattr(library, name)
    fn.restype = ctypes.c_ssize_t  # no argtypes: the copiers pass ctypes objects made once
    return fn


# (releases the GIL, holds it) for each op
_CALLS = {
    op: (_bind(ctypes.CDLL(None, use_errno=True), name), _bind(ctypes.PyDLL(None, use_errno=True), name))
    for op, name in ((Op.READ, "process_vm_readv"), (Op.WRITE, "process_vm_writev"))
}


def _cma_call(op: Op, nbytes: int) -> Any:
    releasing, holding = _CALLS[op]
    return holding if nbytes < GIL_HELD_BELOW else releasing


def _cma_args(pid: int, local_ptr: int, remote_ptr: int, count: int) -> tuple[Any, ...]:
    """``process_vm_*v``'s six arguments as C values, converted here once rather than at every call
    (converting Python ints through ``argtypes`` costs as much as a small copy)."""
    n = ctypes.c_ulong(count)
    return ctypes.c_int(pid), ctypes.c_void_p(local_ptr), n, ctypes.c_void_p(remote_ptr), n, ctypes.c_ulong(0)


def _raise_errno(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def cma_copier(pid: int, op: Op, local_addr: int, remote_addr: int, nbytes: int) -> Copier:
    """One contiguous range between this process and ``pid``, one syscall when it completes at once."""
    call = _cma_call(op, nbytes)
    iov = np.array([[local_addr, nbytes], [remote_addr, nbytes]], dtype=np.uint64)
    args = _cma_args(pid, int(iov.ctypes.data), int(iov.ctypes.data) + 16, 1)

    def copy() -> None:
        moved = call(*args)
        if moved != nbytes:  # partial (a page boundary the kernel stopped at) or an error: finish it
            _finish(call, pid, local_addr, remote_addr, nbytes, moved)

    copy.keepalive = iov  # type: ignore[attr-defined]
    return copy


_PROC_MEM_CALLS = {
    op: _bind(ctypes.PyDLL(None, use_errno=True), name) for op, name in ((Op.READ, "pread"), (Op.WRITE, "pwrite"))
}


def proc_mem_opens(pid: int) -> bool:
    """Whether ``/proc/<pid>/mem`` opens for reading and writing here (where it does not, hixl's cma
    copies every size with ``process_vm_*``, and so do the baselines)."""
    try:
        os.close(os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC))
    except OSError:
        return False
    return True


def proc_mem_copier(pid: int, op: Op, local_addr: int, remote_addr: int, nbytes: int) -> Copier:
    """One contiguous range between this process and ``pid`` in one ``pread`` (READ) or ``pwrite``
    on ``/proc/<pid>/mem``, opened once (and closed with the copier). For small ranges only: the
    kernel copies through a bounce page, a page at a time. Raises :class:`OSError` if the file
    cannot be opened (no ptrace permission, say)."""
    call = _PROC_MEM_CALLS[op]
    fd = os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)
    args = ctypes.c_int(fd), ctypes.c_void_p(local_addr), ctypes.c_size_t(nbytes), ctypes.c_int64(remote_addr)

    def copy() -> None:
        moved = call(*args)
        if moved != nbytes:
            if moved < 0:
                _raise_errno("/proc/<pid>/mem copy failed")
            raise OSError(f"/proc/<pid>/mem copy moved {moved} of {nbytes} bytes")

    weakref.finalize(copy, os.close, fd)
    return copy


def _finish(call: Callable[..., int], pid: int, local: int, remote: int, nbytes: int, moved: int) -> None:
    done = 0
    rest = np.zeros((2, 2), dtype=np.uint64)
    args = _cma_args(pid, int(rest.ctypes.data), int(rest.ctypes.data) + 16, 1)
    while True:
        if moved < 0:
            _raise_errno("process_vm copy failed")
        if moved == 0:
            raise OSError("process_vm copy made no progress")
        done += moved
        if done >= nbytes:
            return
        rest[:] = [[local + done, nbytes - done], [remote + done, nbytes - done]]
        moved = call(*args)


def cma_lanes_copier(pid: int, op: Op, local_addr: int, remote_addr: int, nbytes: int, lanes: int) -> Copier:
    """One contiguous range cut into ``lanes`` parts (4 KiB-aligned cuts), one syscall and one
    thread each (the caller's included): the kernel's ceiling for a laned copy of it on that many
    cores. Threads are started per call, so it pays ~0.1 ms a copy that hixl's lane threads do not.
    """
    cuts = [(nbytes * i // lanes) & ~4095 for i in range(lanes)] + [nbytes]  # (each under nbytes)
    parts = [(start, end - start) for start, end in zip(cuts, cuts[1:]) if end > start]
    local = np.array([[local_addr + start, length] for start, length in parts], dtype=np.uint64)
    remote = np.array([[remote_addr + start, length] for start, length in parts], dtype=np.uint64)
    return cma_batch_copier(pid, op, local, remote, lanes, per_call=1)


def cma_batch_copier(
    pid: int, op: Op, local: np.ndarray, remote: np.ndarray, lanes: int = 1, per_call: int = IOV_MAX
) -> Copier:
    """Scattered blocks: ``local``/``remote`` are ``(N, 2)`` uint64 iovec arrays of equal lengths.

    One syscall per ``per_call`` iovecs (IOV_MAX: the best a batched caller can do) and with
    ``lanes`` > 1 those calls split over that many threads (the caller's included) in even runs, as
    hixl's copy lanes split a batch: the kernel's ceiling for the layout on that many cores.
    """
    local = np.ascontiguousarray(local, dtype=np.uint64)
    remote = np.ascontiguousarray(remote, dtype=np.uint64)
    windows = []
    for start in range(0, len(local), per_call):
        count = min(per_call, len(local) - start)
        expect = int(local[start : start + count, 1].sum())
        args = _cma_args(pid, int(local.ctypes.data) + 16 * start, int(remote.ctypes.data) + 16 * start, count)
        windows.append((_cma_call(op, expect), args, expect))
    runs = [run for run in np.array_split(np.arange(len(windows)), max(1, lanes)) if len(run)]
    failures: list[OSError] = []

    def copy_run(run: np.ndarray) -> None:
        try:
            for call, args, expect in (windows[i] for i in run):
                moved = call(*args)
                if moved != expect:
                    if moved < 0:
                        _raise_errno("batched process_vm copy failed")
                    raise OSError(f"batched process_vm copy moved {moved} of {expect} bytes")
        except OSError as exc:
            failures.append(exc)

    def copy() -> None:
        # (A thread started per call: ~0.1 ms against the 100+ ms a batch worth splitting takes.)
        helpers = [threading.Thread(target=copy_run, args=(run,)) for run in runs[1:]]
        for helper in helpers:
            helper.start()
        copy_run(runs[0])
        for helper in helpers:
            helper.join()
        if failures:
            raise failures[0]

    copy.keepalive = (local, remote)  # type: ignore[attr-defined]
    return copy


def memcpy_copier(dst: np.ndarray, src: np.ndarray) -> Copier:
    """``dst[:] = src`` as a memoryview slice assignment: one ``memcpy``, and ~20x less call
    overhead than ``numpy.copyto`` (60 ns against 1.2 µs for 8 bytes), which matters for the
    latency baseline; at any size the same bytes move at the same speed."""
    to, source = dst.data.cast("B"), src.data.cast("B")
    if len(to) != len(source):
        raise ValueError(f"memcpy_copier: {len(to)}-byte destination, {len(source)}-byte source")

    def copy() -> None:
        to[:] = source

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
    """A plain socket to the bench target's raw server (see :mod:`hixl.bench.target`).

    Blocking, with no Python-level timeout: a socket with one polls before every call, and
    the baseline should be the plainest stream there is. The kernel keeps the time instead
    (``SO_RCVTIMEO``/``SO_SNDTIMEO``: no extra call): a call that waits ``timeout`` seconds
    fails, and a copier raises :class:`TimeoutError` rather than hanging the bench.
    """

    def __init__(self, address: tuple[str, int], timeout: float = 30.0, echo: bool = False) -> None:
        self.sock = socket.create_connection(address, timeout=timeout)
        self.sock.settimeout(None)
        limit = struct.pack("ll", int(timeout), int(timeout % 1 * 1e6))  # a struct timeval
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            self.sock.setsockopt(socket.SOL_SOCKET, option, limit)
        tune_stream(self.sock)
        self.timeout = timeout
        self.sock.sendall(ECHO if echo else STREAM)

    def round_trip(self) -> Copier:
        """One 8-byte request and its 8-byte answer (a stream made with ``echo=True``).

        ``send`` and ``recv_into(MSG_WAITALL)`` of one preallocated buffer, nothing allocated,
        the answer looked for a moment before the read blocks (:func:`~hixl.bench.target.await_bytes`);
        the far end is the same loop (``target._echo``)."""
        sock, timeout = self.sock, self.timeout
        message = bytearray(ECHO_SIZE)
        poller = readable(sock)

        def copy() -> None:
            try:
                sock.send(message)
                await_bytes(poller)
                got = sock.recv_into(message, ECHO_SIZE, socket.MSG_WAITALL)
            except BlockingIOError as exc:
                raise TimeoutError(f"raw server sent no echo within {timeout:g} s") from exc
            if got != ECHO_SIZE:
                raise ConnectionError("raw server closed the stream")

        return copy

    def copier(self, op: Op, local: memoryview, remote_addr: int) -> Copier:
        """READ: ask for ``len(local)`` bytes and :func:`~hixl.bench.target.recv_exact` them;
        WRITE: send them after the header in one ``sendmsg``, await one byte."""
        sock, timeout = self.sock, self.timeout
        nbytes = len(local)
        header = RAW_HEADER.pack(b"R" if op is Op.READ else b"W", remote_addr, nbytes)
        ack = bytearray(1)
        poller = readable(sock)

        if op is Op.READ:

            def copy() -> None:
                try:
                    sock.sendall(header)
                    await_bytes(poller)
                    complete = recv_exact(sock, local)
                except BlockingIOError as exc:
                    raise TimeoutError(f"raw server sent no data within {timeout:g} s") from exc
                if not complete:
                    raise ConnectionError("raw server closed the stream")

        else:

            def copy() -> None:
                try:
                    sent = sock.sendmsg([header, local])  # header and data in one syscall when they fit
                    if sent < len(header) + nbytes:
                        if sent < len(header):
                            sock.sendall(header[sent:])
                            sent = len(header)
                        sock.sendall(local[sent - len(header) :])
                    await_bytes(poller)
                    got = sock.recv_into(ack)
                except BlockingIOError as exc:
                    raise TimeoutError(f"raw server took no data or sent no ack within {timeout:g} s") from exc
                if got != 1:
                    raise ConnectionError("raw server closed the stream")

        return copy

    def close(self) -> None:
        """Close the socket (the server's thread for it then ends)."""
        self.sock.close()
