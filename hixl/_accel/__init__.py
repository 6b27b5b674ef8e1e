"""hixl's hot path: the per-request steps between the Python that decides and the copy.

A small request is mostly interpreter: for an 8-byte or a 1 MiB transfer
through shared memory, checking a few descriptors against two tables and
finding where each lies costs as much as (or, with the caches cold after a
large copy, more than) the copy itself. These few steps exist twice, with one
contract:

- :mod:`hixl._accel._native`, a C extension that ``pip install .`` builds
  (``setup.py``; a machine without a compiler installs without it);
- :mod:`hixl._accel.pure`, the same in Python.

The native one is used unless it cannot be loaded or ``HIXL_PURE_PYTHON=1``
is set; :data:`IMPLEMENTATION` says which (``hixl --version`` prints it). The
protocol, the locks and every rule about what may be copied stay in Python:
these functions are handed the tables their callers checked and hold current.

- :func:`check_small` — a small list of descriptors, each range inside the
  given local and remote tables: its total length, else None.
- :func:`mapped_copy` — copy a small list through a peer's memory mapped here.
- :func:`copy_pieces` — copy a batch's rows between local and mapped addresses.
- :func:`cma_copy` — the generation and liveness checks and one ``process_vm_*`` call of a
  small request.
- :func:`cma_window` — one window of iovecs through ``process_vm_*``, split over *copy lanes*
  (threads of its own: C threads in the extension, which never wait for the GIL) from
  :data:`LANE_FROM` bytes; :func:`copy_pieces` takes lanes too (shm).
- :func:`cma_windows` — a large cma copy window after window, each window's checks (the REVOKE
  lease, the request's lock and cancellation, the peer's table and generation, its liveness)
  before its copy; back to the caller only where one of them stops it (see
  :meth:`hixl.transports.cma.CmaChannel._copy`).
- :class:`CmaSmall` — cma's whole latency path to one peer in one call: both sides' region
  checks, the lease, :func:`cma_copy`'s checks and its syscall (``transfer_sync`` of a few
  descriptors calls nothing else below the engine); one descriptor of up to
  :data:`PROC_MEM_MAX` bytes goes through the peer's ``/proc/<pid>/mem`` instead, where the
  channel has it open (one syscall, no liveness check: see :mod:`hixl.transports.cma`).
- :func:`tcp_send`, :func:`tcp_reply`, :func:`tcp_land` — TCP's latency path on the initiator:
  a small request's frame (and a WRITE's data, from registered memory) out in one ``sendmsg``, its
  reply's header read and recognised (a DATA or ACK for that request, else "not mine"), and once
  the connection has accounted for it, the DATA's bytes landed in local memory; each wait a
  ``poll`` bounded by the caller's time, with the GIL released (see :mod:`hixl._session.wire`).
- :class:`TcpSmall` — the same three steps as one call, driven by the link's state as
  :class:`CmaSmall` is: a small READ or WRITE sent, answered and landed without the connection
  hearing of it, or handed back to the link where it stopped short. Only in the C extension
  (None in the pure one, whose latency path is :meth:`hixl._session.initiator.PeerLink.exchange`
  itself: a Python twin of it would be the same steps again).
- :func:`tcp_request` — the target's side: one ``recv``, and a small READ or WRITE that arrived
  whole recognised and its fields handed back (anything else: "not mine", for the connection's
  parser); given the registry, the C twin also serves a small READ or WRITE every rule lets
  through (a READ's DATA and bytes, a WRITE's ACK, sent in the same call, the GIL held from the
  check to the send), else :func:`tcp_send` then sends its DATA from registered memory, never
  waiting;
  :func:`tcp_land_words` lands a WRITE's data from the socket as it streams in, in whole words,
  trying again while more is coming rather than going back to the loop between pieces.
- :func:`weights_hash` — hixl.weights' 64-bit checksum of a buffer's bytes; :func:`copy_hash` —
  a copy and the checksum of what landed, in one pass (the GIL released for large buffers; the
  choice of hash and its speeds: :mod:`hixl.weights._checks`); :func:`row_hashes` — the hash
  each row of a hixl.weights table carries, for a batch of rows (:mod:`hixl.weights._rows`).
- :func:`gather_rows` — a batch of a table's rows, by row number, copied from memory mapped here
  (shm's :meth:`~hixl.transports.shm.ShmChannel.read_rows`) into consecutive slots, a few rows
  ahead asked of memory while one is copied; :func:`accept_rows` — such a gather of hixl.weights
  rows checked (sequence word and hash, in one pass) and, if every row is whole, its payloads and
  versions handed over, or else which rows are torn; :func:`gather_checked_rows` — a gather from memory
  mapped here straight into the caller's array, each row checked by loading its sequence word before
  and after its copy (no hash: valid where :data:`ORDERED_ROW_READS`, a machine that keeps loads in
  order).
- :func:`batch_order` — an order for a batch that makes :func:`copy_pieces`
  cheaper (only the pure one has a use for it: numpy's calls want one side back
  to back; C copies in any order at the same speed).
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np

from . import pure

__all__ = [
    "CMA_CANCELLED",
    "CMA_GONE",
    "CMA_REVOKING",
    "CMA_STALE",
    "CMA_STUCK",
    "CmaSmall",
    "GIL_FREE_FROM",
    "IMPLEMENTATION",
    "LANE_FROM",
    "MAX_LANES",
    "NATIVE",
    "ORDERED_ROW_READS",
    "PROC_MEM_MAX",
    "PURE_ENV",
    "STREAM_FROM",
    "TCP_EOF",
    "TCP_LOWAT",
    "TCP_LOWAT_FROM",
    "TCP_RANGES",
    "TCP_SERVE_MAX",
    "TCP_WAIT",
    "TcpSmall",
    "accept_rows",
    "batch_order",
    "check_small",
    "cma_copy",
    "cma_window",
    "cma_windows",
    "copy_hash",
    "copy_pieces",
    "gather_checked_rows",
    "gather_rows",
    "mapped_copy",
    "row_hashes",
    "tcp_land",
    "tcp_land_words",
    "tcp_reply",
    "tcp_request",
    "tcp_send",
    "weights_hash",
]

PURE_ENV = "HIXL_PURE_PYTHON"
"""Set to 1 to use the pure-Python hot path even where the extension loads."""


def _choose() -> tuple[ModuleType, str]:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return pure, f"pure Python ({PURE_ENV}=1)"
    try:
        from . import _native
    except ImportError as exc:  # not built here (no compiler at install), or built for another Python
        return pure, f"pure Python (the C extension is not available: {exc})"
    return _native, "native (C extension)"


GIL_FREE_FROM = pure.GIL_FREE_FROM
"""Copies of at least this many bytes (in all, per call) release the GIL, in both implementations."""
LANE_FROM = pure.LANE_FROM
"""Copies of fewer bytes (per call) stay in one lane, in both implementations."""
MAX_LANES = pure.MAX_LANES
"""The most lanes one copy is split over."""
STREAM_FROM = pure.STREAM_FROM
"""Memory copies (shm) of transfers of at least this many bytes write past the caches in the C extension."""
PROC_MEM_MAX = pure.PROC_MEM_MAX
"""A copy of one descriptor of at most this many bytes goes through the peer's ``/proc/<pid>/mem``
(:class:`CmaSmall`'s ``proc_mem``), in both implementations."""

_impl, IMPLEMENTATION = _choose()
NATIVE = _impl is not pure
"""Whether the C extension is in use."""

check_small = _impl.check_small
mapped_copy = _impl.mapped_copy
copy_pieces = _impl.copy_pieces
cma_copy = _impl.cma_copy
cma_window = _impl.cma_window
cma_windows = _impl.cma_windows
CMA_STALE: int = _impl.CMA_STALE
CMA_GONE: int = _impl.CMA_GONE
CMA_REVOKING: int = _impl.CMA_REVOKING
CMA_CANCELLED: int = _impl.CMA_CANCELLED
CMA_STUCK: int = _impl.CMA_STUCK
CmaSmall = _impl.CmaSmall
TcpSmall: type | None = getattr(_impl, "TcpSmall", None)
tcp_send = _impl.tcp_send
tcp_reply = _impl.tcp_reply
tcp_land = _impl.tcp_land
tcp_land_words = _impl.tcp_land_words
tcp_request = _impl.tcp_request
weights_hash = _impl.weights_hash
copy_hash = _impl.copy_hash
row_hashes = _impl.row_hashes
gather_rows = _impl.gather_rows
gather_checked_rows = _impl.gather_checked_rows
ORDERED_ROW_READS: bool = bool(_impl.ORDERED_ROW_READS)
accept_rows = _impl.accept_rows
TCP_WAIT: int = _impl.TCP_WAIT
TCP_EOF: int = _impl.TCP_EOF
TCP_LOWAT: int = _impl.TCP_LOWAT
TCP_LOWAT_FROM: int = _impl.TCP_LOWAT_FROM
TCP_RANGES: int = _impl.TCP_RANGES
TCP_SERVE_MAX: int = _impl.TCP_SERVE_MAX


def _any_order(dsts: np.ndarray, srcs: np.ndarray, lens: np.ndarray) -> None:
    """C copies a batch as fast in the order given: keep it."""
    return None


batch_order = pure.batch_order if not NATIVE else _any_order
