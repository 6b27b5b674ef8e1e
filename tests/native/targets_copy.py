"""Fuzz targets for the copies in hixl._accel whose lengths or tables a peer's word decides: the
small-transfer check (check_small, against the peer's region table), shm's copies through the
peer's mapped memory (mapped_copy, copy_pieces), and cma's (cma_copy, cma_window, cma_windows,
CmaSmall: with this process as its own peer, its generation page's bytes the peer's).

What a caller checked before such a call (the ranges of a copy that checks nothing itself) is
made to hold inside the target's buffers; what the call checks itself — descriptors against
tables and mappings, the generation, the pinned process — is left as the case says.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

from hixl._memory import RegionTable, Registry
from hixl._request import TransferReq
from hixl._session.initiator import LinkState
from hixl._session.peer_regions import PeerRegions
from hixl._types import Op

from .harness import Memory, clamp, outcome

_GENERATION = struct.Struct("<Q")
_GUARD = 64  # (bytes of a buffer around what a call may touch)


def _inside(memory: Memory, name: str, offset: int, length: int) -> tuple[int, int]:
    """``(address, length)`` of a range of buffer ``name`` moved and cut to lie inside its guards."""
    room = memory.size(name) - 2 * _GUARD
    offset = offset % room
    return memory.addr(name, _GUARD + offset), length % (room - offset + 1)


def _descs(case: dict[str, Any], rows: list[tuple[int, int, int]]) -> list[Any]:
    """Descriptor rows as the case's container type: tuples, or lists (both are taken)."""
    return [tuple(row) for row in rows] if case.get("tuples") else [list(row) for row in rows]


class _Gone:
    """A pidfd of a process that has exited and been reaped (cma's "the peer is gone"), and one of
    this process."""

    def __init__(self) -> None:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        self.gone = os.pidfd_open(child.pid)
        child.wait()
        self.alive = os.pidfd_open(os.getpid())

    def pidfd(self, gone: bool) -> int:
        return self.gone if gone else self.alive

    def close(self) -> None:
        os.close(self.gone)
        os.close(self.alive)


class CheckSmall:
    """``check_small``: the total of small descriptors only if every range lies inside one local
    and one remote interval; the remote table as a peer's advertisement made it."""

    name = "check_small"

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        local, remote = (RegionTable([(a % (1 << 62), n % (1 << 40)) for a, n in case[side]]) for side in ("local", "remote"))
        descs = _descs(case, [tuple(d) for d in case["descs"]])
        return outcome(impl.check_small, descs, *local.intervals, *remote.intervals)

    def close(self) -> None:
        pass


class MappedCopy:
    """``mapped_copy``: small descriptors copied through a peer's memory mapped here, only if every
    remote range lies inside one mapping (writable, for a write)."""

    name = "mapped_copy"

    def __init__(self) -> None:
        self.memory = Memory(local=1 << 14, map0=4096, map1=4096, map2=4096, map3=4096)

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        maps, end = [], -1
        for i, (start, length, writable) in enumerate(sorted(case["maps"][:4])):
            start, length = start % (1 << 62), clamp(length, 1, 4096 - 2 * _GUARD)
            if start > end:  # (a mapping index is sorted and disjoint)
                maps.append((start, start + length, self.memory.addr(f"map{i}", _GUARD), writable))
                end = start + length
        rows = []
        for local, remote, length in case["descs"]:
            here, length = _inside(self.memory, "local", local, length)
            rows.append((here, remote, length))
        starts, ends, heres, writable = (list(column) for column in zip(*maps)) if maps else ([], [], [], [])
        self.memory.reset()
        lanes = clamp(case["lanes"], 1, 4)
        answer = outcome(impl.mapped_copy, _descs(case, rows), case["write"], starts, ends, heres, writable, lanes)
        return answer, self.memory.snapshot()

    def close(self) -> None:
        pass


class CopyPieces:
    """``copy_pieces``: a batch's rows copied between local and mapped memory (ranges the caller
    checked), in row order, with or without streaming stores."""

    name = "copy_pieces"

    def __init__(self) -> None:
        self.memory = Memory(local=1 << 16, mapped=1 << 16)

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        pieces, heres = [], []
        for local, there, length in case["rows"]:
            here, length = _inside(self.memory, "local", local, max(1, length))
            mapped, length = _inside(self.memory, "mapped", there, length)
            if length:
                pieces.append((here, there % (1 << 63), length))
                heres.append(mapped)
        if not pieces:
            return "nothing to copy"
        rows, at = np.array(pieces, dtype=np.uint64), np.array(heres, dtype=np.uint64)
        self.memory.reset()
        answer = outcome(impl.copy_pieces, rows, at, case["write"], clamp(case["lanes"], 1, 4), case["stream"])
        return answer, self.memory.snapshot()

    def close(self) -> None:
        pass


class CmaCopy:
    """``cma_copy``: one process_vm_* call of small descriptors, only if the peer's generation page
    says the expected generation and the pinned process is still there."""

    name = "cma_copy"

    def __init__(self) -> None:
        self.memory = Memory(local=1 << 14, remote=1 << 14)
        self.processes = _Gone()

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        rows = []
        for local, remote, length in case["descs"]:
            here, length = _inside(self.memory, "local", local, length)
            there, length = _inside(self.memory, "remote", remote, length)
            rows.append((here, there, length))
        page = bytearray(bytes.fromhex(case["page"]).ljust(8, b"\0"))  # (a mapped page: 8 bytes at least)
        pidfd = self.processes.pidfd(case["gone"])
        self.memory.reset()
        generation = case["generation"] % (1 << 64)
        answer = outcome(impl.cma_copy, os.getpid(), pidfd, case["write"], _descs(case, rows), page, generation)
        return answer, self.memory.snapshot()

    def close(self) -> None:
        self.processes.close()


def _iov_pairs(memory: Memory, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Local and remote iovec arrays of equal lengths pairwise, inside the buffers (as callers build them)."""
    local, remote = [], []
    for here, there, length in rows:
        a, length = _inside(memory, "local", here, length)
        b, length = _inside(memory, "remote", there, length)
        local.append((a, length))
        remote.append((b, length))
    return np.array(local, dtype=np.uint64).reshape(-1, 2), np.array(remote, dtype=np.uint64).reshape(-1, 2)


class CmaWindow:
    """``cma_window``: one window of iovec pairs through process_vm_*."""

    name = "cma_window"

    def __init__(self) -> None:
        self.memory = Memory(local=1 << 14, remote=1 << 14)

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        local, remote = _iov_pairs(self.memory, case["rows"])
        self.memory.reset()
        answer = outcome(
            impl.cma_window, os.getpid(), case["write"], int(local.ctypes.data), int(remote.ctypes.data), len(local),
            clamp(case["lanes"], 1, 4),
        )
        return answer, self.memory.snapshot()

    def close(self) -> None:
        pass


class CmaWindows:
    """``cma_windows``: a large copy window after window from byte ``start`` on, each window's
    checks (REVOKE, cancellation, the table, the generation page, the process) before it; a case's
    ``refuse`` (mod 8) makes one of them refuse: 1 cancelled, 2 revoking, 3 the table replaced,
    4 the process gone."""

    name = "cma_windows"

    def __init__(self) -> None:
        self.memory = Memory(local=1 << 14, remote=1 << 14)
        self.processes = _Gone()

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        local, remote = _iov_pairs(self.memory, case["rows"])
        total = int(local[:, 1].sum()) if len(local) else 0
        refuse = case["refuse"] % 8
        regions = PeerRegions([[self.memory.addr("remote"), self.memory.size("remote"), 1]], 5)
        regions.lease.revoking = refuse == 2
        page = bytearray(_GENERATION.pack(case["page_generation"] % (1 << 64)))
        req = TransferReq("self", Op.READ, max(1, len(local)), max(1, total), timeout=None)
        req.cancelled = refuse == 1
        table = regions.table if refuse != 3 else PeerRegions([], 5).table
        self.memory.reset()
        answer = outcome(
            impl.cma_windows, os.getpid(), case["write"], int(local.ctypes.data), int(remote.ctypes.data), len(local),
            clamp(case["lanes"], 1, 4), self.processes.pidfd(refuse == 4), case["start"] % (total + 1),
            max(1 + case["limit"] % (1 << 20), total // 64), page, regions, table, req,  # (64 windows at most: time)
        )
        return answer, self.memory.snapshot(), req.io_lock.locked(), len(regions.lease._holders)

    def close(self) -> None:
        self.processes.close()


class CmaSmallRun:
    """``CmaSmall.run``: cma's whole latency path — both sides' region checks (the peer's table as
    its REGIONS said), the chunk, the lease, the generation, the process, and the copy (through
    process_vm_* or the peer's /proc/<pid>/mem)."""

    name = "CmaSmall.run"

    def __init__(self) -> None:
        self.memory = Memory(local=1 << 14, peer=1 << 14)
        self.registry = Registry()
        self.registry.register(self.memory.buffers["local"][4096:-4096])
        self.processes = _Gone()
        self.proc_mem = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)

    def run(self, impl: ModuleType, case: dict[str, Any]) -> Any:
        peer_rows = []
        for offset, length, writable in case["peer_rows"]:  # (what the peer says: its own memory)
            there, length = _inside(self.memory, "peer", offset, length)
            peer_rows.append([there, length, writable % 2])
        link = SimpleNamespace(state=LinkState.CONNECTED, regions=PeerRegions(peer_rows, 7))
        page = bytearray(_GENERATION.pack(case["page_generation"] % (1 << 64)))
        path = impl.CmaSmall(
            os.getpid(), self.processes.pidfd(case["gone"]), page, self.registry, link, LinkState.CONNECTED, Op.READ,
            Op.WRITE, clamp(case["chunk"], 0, 1 << 20), 1, self.proc_mem if case["proc_mem"] else -1,
        )
        # Descriptors as the application gave them: checked by the call itself, so anywhere near.
        base_local, base_peer = self.memory.addr("local"), self.memory.addr("peer")
        near = 1 << 16
        rows = [(base_local + clamp(a, -near, near), base_peer + clamp(b, -near, near), n) for a, b, n in case["descs"]]
        op = (Op.READ, Op.WRITE, "neither")[case["op"] % 3]
        self.memory.reset()
        answer = outcome(path.run, op, _descs(case, rows))
        return answer, self.memory.snapshot(), len(link.regions.lease._holders)

    def close(self) -> None:
        self.processes.close()
        os.close(self.proc_mem)


TARGETS = (CheckSmall, MappedCopy, CopyPieces, CmaCopy, CmaWindow, CmaWindows, CmaSmallRun)
