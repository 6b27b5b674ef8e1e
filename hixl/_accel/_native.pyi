"""Types of the C extension (hixl/_accel/_native.c); the contract is hixl._accel's docstring."""

import socket

import numpy as np

GIL_FREE_FROM: int
ORDERED_ROW_READS: int
SMALL_MAX: int
PROC_MEM_MAX: int
LANE_FROM: int
MAX_LANES: int
CMA_INELIGIBLE: int
CMA_STALE: int
CMA_GONE: int
CMA_REVOKING: int
CMA_CANCELLED: int
CMA_STUCK: int
TCP_WAIT: int
TCP_EOF: int
TCP_LOWAT: int
TCP_LOWAT_FROM: int
TCP_RANGES: int
TCP_SERVE_MAX: int

def check_small(
    descs: object, local_starts: list[int], local_ends: list[int], remote_starts: list[int], remote_ends: list[int]
) -> int | None: ...
def mapped_copy(
    descs: object, write: bool, starts: list[int], ends: list[int], heres: list[int], writable: list[bool], lanes: int = 1
) -> int: ...
def copy_pieces(pieces: np.ndarray, heres: np.ndarray, write: bool, lanes: int = 1, stream: bool = False) -> None: ...
def cma_copy(pid: int, pidfd: int, write: bool, descs: object, generation_page: object, generation: int) -> int: ...
def cma_window(pid: int, write: bool, local_iovs: int, remote_iovs: int, count: int, lanes: int) -> int: ...
def cma_windows(
    pid: int, write: bool, local_iovs: int, remote_iovs: int, count: int, lanes: int, pidfd: int, start: int,
    limit: int, generation_page: object, regions: object, table: object, req: object,
) -> tuple[int, int]: ...

class CmaSmall:
    def __init__(
        self, pid: int, pidfd: int, generation_page: object, registry: object, link: object, connected: object,
        read: object, write: object, chunk: int, lanes: int = 1, proc_mem: int = -1,
    ) -> None: ...
    def run(self, op: object, descs: object) -> bool: ...
class TcpSmall:
    def __init__(
        self, link: object, wire: object, scratch: object, connected: object, open: object, guard: float,
        landing_rate: float, landing_spin_max: float,
    ) -> None: ...
    def run(
        self, write: bool, descs: list[tuple[int, int, int]], deadline: float
    ) -> bool | None | tuple[str, int, bytes | None, int, int, bytes, bool, BaseException | None]: ...
def tcp_send(
    sock: socket.socket, frame: bytes, ranges: list[tuple[int, int]], offset: int, until: float, spin: float = 0.0
) -> int: ...
def tcp_reply(
    sock: socket.socket, scratch: bytearray, have: int, req_id: int, until: float, spin: float = 0.0
) -> tuple[int, int, int]: ...
def tcp_land(
    sock: socket.socket, scratch: bytearray, start: int, have: int, ranges: list[tuple[int, int]],
    until: float, spin: float = 0.0,
) -> tuple[int, int]: ...
def tcp_land_words(
    sock: socket.socket, iovs: np.ndarray, first: int, want: int, done: int, left: int,
    until: float, piece: int, spin: float = 0.0,
) -> int: ...
def tcp_request(
    sock: socket.socket, scratch: bytearray, registry: object = None
) -> tuple[int, int, int, int, int, list[tuple[int, int]] | None, int, bytes | None]: ...
def weights_hash(buffer: object) -> int: ...
def copy_hash(dst: object, src: object) -> int: ...
def row_hashes(rows: object, width: int, out: object) -> None: ...
def gather_rows(dst: int, src: int, stride: int, rows: object) -> None: ...
def gather_checked_rows(
    src: int, stride: int, rows: object, limit: int, row_bytes: int, out: object, versions: object, torn: object,
    check: bool,
) -> int: ...
def accept_rows(words: object, width: int, row_bytes: int, out: object, versions: object, torn: object) -> int: ...
