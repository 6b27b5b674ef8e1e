"""The generation page an initiator maps from its cma peer: only a memfd sealed against shrinking.

A page its owner could still truncate would kill the initiator with SIGBUS on its next read of the
mapping (the C hot path reads it before every copy): a hostile same-host peer could crash an honest
engine that way. So the file is mapped only if sealed with ``F_SEAL_SHRINK``, and an engine's own
generation memfd is sealed so from the start.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from hixl import Engine
from hixl.transports._peerproc import map_peer_file

pytestmark = pytest.mark.timeout(30)

NAME = "hixl-cma-generation"


def _memfd(seals: int) -> int:
    fd = os.memfd_create(NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 8)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_a_page_its_owner_could_still_shrink_is_not_mapped() -> None:
    fd = _memfd(0)
    try:
        with pytest.raises(ValueError, match="not sealed against shrinking"):
            map_peer_file(os.getpid(), fd, NAME, 8)
    finally:
        os.close(fd)


def test_a_sealed_page_is_mapped_and_reads() -> None:
    fd = _memfd(fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    try:
        os.pwrite(fd, (42).to_bytes(8, "little"), 0)
        page = map_peer_file(os.getpid(), fd, NAME, 8)
        assert int.from_bytes(page[:8], "little") == 42
        page.close()
    finally:
        os.close(fd)


def test_an_engine_s_own_generation_page_is_sealed() -> None:
    with Engine("127.0.0.1:0", {"transport": "cma"}):
        mine = [int(fd) for fd in os.listdir("/proc/self/fd") if NAME in _link(fd)]
        assert mine, "no cma generation memfd open"
        for fd in mine:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL, hex(seals)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)


def _link(fd: str) -> str:
    try:
        return os.readlink(Path("/proc/self/fd") / fd)
    except OSError:
        return ""
