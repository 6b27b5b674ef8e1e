"""A parameter server's table: rows that workers gather one-sidedly while the server updates them.

The server owns the rows: :meth:`Table.update` writes them, and a worker's
:meth:`Subscriber.pull_rows <hixl.weights.Subscriber.pull_rows>` READs the ones it
needs straight from the server's registered memory — on cma and shm the server's
CPU takes no part. Each row is stored with a sequence word and a hash
(:mod:`hixl.weights._rows`), so a worker that copied a row while it was being
written sees that, and reads it again: every row it returns is a consistent copy
of one of that row's versions. Rows are not consistent *with each other*: a gather
may return row 3 before update 7 and row 4 after it.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from .._exceptions import HixlError, ParamInvalid
from .._memory import empty
from .._types import MemDesc
from ..engine import Engine
from . import _wire
from ._rows import HEAD_WORDS, TableInfo, check_name, row_hashes, stride_of
from ._tensors import DTYPES, byte_array, view_of

__all__ = ["Table"]

_INIT_BATCH = 1 << 16  # rows hashed at once when the table is made (bounds the temporary arrays)


class Table:
    """A table of ``shape[0]`` rows of shape ``shape[1:]`` and ``dtype``, served from ``engine`` as ``name``.

    ``engine`` must listen. The rows start as zeros (version 0). Create it before workers connect
    if they are to use the ``shm`` transport.
    """

    def __init__(self, engine: Engine, name: str, shape: tuple[int, ...], dtype: Any = np.float32) -> None:
        if ":" not in engine.local_engine:
            raise ParamInvalid("a table's engine must listen (\"ip:port\"): workers read its memory")
        dims = tuple(int(n) for n in shape)
        if not dims or any(n < 1 for n in dims):
            raise ParamInvalid(f"shape must be (rows, *row_shape) of positive sizes, not {shape!r}")
        dtype_name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
        if dtype_name not in DTYPES:
            raise ParamInvalid(f"dtype {dtype_name} is not one of {sorted(DTYPES)}")
        self.engine = engine
        self.name = check_name(name)
        stride = stride_of(math.prod(dims[1:]) * DTYPES[dtype_name])
        self._bytes = empty((dims[0], stride), shared=True)
        self._words = self._bytes.view(np.uint64)
        for start in range(0, dims[0], _INIT_BATCH):  # every row: version 0, zeros, and their hash
            rows = self._words[start : start + _INIT_BATCH]
            rows[:, 1] = row_hashes(rows)
        self._handle = engine.register_mem(self._bytes.reshape(-1), access="r")
        region = MemDesc(int(self._bytes.ctypes.data), self._bytes.nbytes)
        self.info = TableInfo(name, dims[0], dims[1:], dtype_name, region)
        """What workers are told about the table."""
        engine.set_metadata(_wire.table_key(name), self.info.encode())
        self._lock = threading.Lock()
        self._updates = 0
        self._closed = False

    @property
    def updates(self) -> int:
        """How many updates it has had: the version the next one gives its rows, less one."""
        return self._updates

    def update(self, indices: Any, values: Any) -> int:
        """Write ``values[i]`` into row ``indices[i]`` for every i (distinct rows); return the update's version.

        ``values``: a numpy array or torch CPU tensor of shape ``(len(indices), *row_shape)`` and the
        table's dtype. Readers see each row either before or after this update, never a mix.
        """
        rows = self._rows(indices)
        if len(np.unique(rows)) != len(rows):
            raise ParamInvalid("an update writes each row once: indices must be distinct")
        view = view_of(values)
        if view.dtype != self.info.dtype or view.shape != (len(rows), *self.info.row_shape):
            raise ParamInvalid(
                f"values must be {self.info.dtype} of shape {(len(rows), *self.info.row_shape)}, not {view.dtype} {view.shape}"
            )
        payload = byte_array(values).reshape(len(rows), self.info.row_bytes)
        with self._lock:
            self._check_open()
            version = self._updates + 1
            # The rows as they will be, hashed before the table is touched: they stay odd (refused)
            # only while their words are stored.
            written = np.zeros((len(rows), self._words.shape[1]), dtype=np.uint64)
            written[:, 0] = 2 * version
            written.view(np.uint8)[:, 8 * HEAD_WORDS : 8 * HEAD_WORDS + self.info.row_bytes] = payload
            written[:, 1] = row_hashes(written)
            # Odd first, then hash and payload, then even: a reader's copy that mixes two updates
            # (in any order: copies have none) fails the hash; one made mid-way is odd; and a copy
            # made in order between two loads of the word (shm) sees them differ (x86-64 keeps
            # these stores, each a numpy call of its own, in order).
            self._words[rows, 0] = 2 * version - 1
            self._words[rows, 1:] = written[:, 1:]
            self._words[rows, 0] = 2 * version
            self._updates = version
        return version

    def read(self, indices: Any) -> np.ndarray:
        """A copy of rows ``indices``, read here (for the server's own use)."""
        rows = self._rows(indices)
        with self._lock:
            payload = self._bytes[rows, 8 * HEAD_WORDS : 8 * HEAD_WORDS + self.info.row_bytes].copy()
        dtype = np.uint16 if self.info.dtype == "bfloat16" else np.dtype(self.info.dtype)
        return payload.view(dtype).reshape(len(rows), *self.info.row_shape)

    def _rows(self, indices: Any) -> np.ndarray:
        rows = np.asarray(indices)
        if rows.ndim != 1 or (len(rows) and rows.dtype.kind not in "iu"):
            raise ParamInvalid("indices must be a 1-D sequence of row numbers")
        rows = rows.astype(np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.info.rows):
            raise ParamInvalid(f"row numbers must be in [0, {self.info.rows})")
        return rows

    def _check_open(self) -> None:
        if self._closed:
            raise HixlError(f"table {self.name!r} is closed")

    def close(self) -> None:
        """Stop serving the table; when this returns no worker reads it any more."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.engine.deregister_mem(self._handle)
            except HixlError:
                pass  # the engine was finalized first

    def __enter__(self) -> Table:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        info = self.info
        return f"<Table {info.name!r} {info.rows} x {info.row_shape} {info.dtype} at {self.engine.local_engine}, {self._updates} update(s)>"
