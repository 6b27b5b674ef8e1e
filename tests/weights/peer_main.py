"""A child process holding one side of hixl.weights: a publisher, a subscriber or a relay.

``python -m tests.weights.peer_main FD`` (see :class:`tests.weights.peers.Peer`): the first message
is ``(role, settings)``; the child answers ``(address, pid)`` and then serves commands
(:func:`hixl._tools.child.serve_commands`). Every tensor a test publishes through it is a *pattern*:
every uint64 word of version ``v`` is ``v`` (see :func:`pattern`), so a pull that mixed two
versions shows as words that differ.

``HIXL_WEIGHTS_TEST_UNCHECKED=1`` in its environment turns hixl.weights' consistency checks off
(:data:`hixl.weights._checks.ENABLED`): the test hook that shows the checks are what keeps pulls whole.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np

import hixl
from hixl import Engine
from hixl._tools.child import child_connection, serve_commands
from hixl._accel import copy_pieces
from hixl.weights import Publisher, Relay, Subscriber, Table, _checks
from hixl.weights._rows import row_hashes

UNCHECKED = "HIXL_WEIGHTS_TEST_UNCHECKED"


def pattern(version: int, words: int) -> np.ndarray:
    """Version ``version`` of a patterned tensor: ``words`` uint64 words, every one ``version``."""
    return np.full(words, version, dtype=np.uint64)


def row_pattern(rows: np.ndarray, version: int, words: int) -> np.ndarray:
    """What update ``version`` writes into ``rows`` of a patterned table: row i, every word ``i << 32 | version``."""
    return np.repeat(((rows.astype(np.uint64) << np.uint64(32)) | np.uint64(version))[:, None], words, axis=1)


def random_tensor(shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    """A tensor of random values, the same for the same arguments (``bfloat16``: a torch tensor)."""
    values = np.random.default_rng(seed).standard_normal(shape) * 100
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)
    return values.astype(dtype)


class StallingEngine(Engine):
    """An engine that, when armed, stops its own process (SIGSTOP) before the next transfer it is asked for:
    a pull frozen after it acquired its version and before it read a byte, for the test to act on."""

    armed = False

    def transfer_sync(self, remote_engine: str, op: hixl.Op, op_descs: Any, timeout: float | None = None) -> None:
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), signal.SIGSTOP)
        super().transfer_sync(remote_engine, op, op_descs, timeout)


class Side:
    """What one child holds, and the commands it answers."""

    def __init__(self, role: str, settings: dict[str, Any]) -> None:
        options = {"transport": settings.get("transport", "auto")}
        self.engine = StallingEngine("127.0.0.1:0", options)
        self.publisher: Publisher | None = None
        self.subscriber: Subscriber | None = None
        self.relay: Relay | None = None
        self.tables: dict[str, Table] = {}
        self.tensors: dict[str, np.ndarray] = {}  # zero-copy: the tensors published where they are
        self.last: dict[str, np.ndarray] = {}  # what the last pull filled
        self._kept: dict[str, np.ndarray] = {}  # what keep_and_pull kept aside
        self.stream: threading.Thread | None = None
        self.stream_result: dict[str, Any] = {}
        self.upstream: Engine | None = None  # a relay's second engine: the one its subscriber pulls with
        if role == "publisher":
            self.publisher = Publisher(
                self.engine,
                slots=settings.get("slots", 2),
                lease=settings.get("lease", 5.0),
                mode=settings.get("mode", "snapshot"),
                checksums=settings.get("checksums", True),
            )
        elif role == "subscriber":
            self.subscriber = Subscriber(self.engine, settings["upstream"], verify=settings.get("verify", True))
        elif role == "relay":
            self.upstream = Engine("127.0.0.1:0", options)
            self.subscriber = Subscriber(self.upstream, settings["upstream"])
            self.relay = Relay(self.subscriber, self.engine, lease=settings.get("lease", 5.0))

    # -- publisher ----------------------------------------------------------------------------
    def publish(self, arrays: dict[str, np.ndarray]) -> tuple[int, float]:
        """Publish ``arrays`` (zero-copy: kept here, as ``tensors``); the version and the seconds it took."""
        assert self.publisher is not None
        if self.publisher.mode == "zero-copy":
            self.tensors = {name: hixl.empty(a.shape, a.dtype) for name, a in arrays.items()}
            for name, a in arrays.items():
                self.tensors[name][...] = a
            arrays = self.tensors
        start = time.monotonic()
        version = self.publisher.publish(arrays)
        return version, time.monotonic() - start

    def publish_random(self, specs: dict[str, tuple[tuple[int, ...], str, int]]) -> tuple[int, float]:
        """Publish ``random_tensor(shape, dtype, seed)`` for each ``name: (shape, dtype, seed)``."""
        return self.publish({name: random_tensor(*spec) for name, spec in specs.items()})

    def publish_pattern(self, words: dict[str, int]) -> tuple[int, float]:
        """Publish the next version as patterned tensors of ``words`` words each."""
        assert self.publisher is not None
        version = (self.publisher.versions() or [0])[-1] + 1
        return self.publish({name: pattern(version, n) for name, n in words.items()})

    def republish(self) -> tuple[int, float]:
        """Zero-copy: publish the tensors published last, where they are, as the next version."""
        assert self.publisher is not None
        start = time.monotonic()
        version = self.publisher.publish(self.tensors)
        return version, time.monotonic() - start

    def write(self, name: str, value: int) -> None:
        """Zero-copy: write ``value`` into every word of the published tensor ``name``, where it is."""
        self.tensors[name][...] = value

    def wait_released(self, version: int, timeout: float) -> float:
        """Seconds ``wait_released(version)`` took."""
        assert self.publisher is not None
        start = time.monotonic()
        self.publisher.wait_released(version, timeout)
        return time.monotonic() - start

    def start_stream(self, count: int, words: dict[str, int], interval: float = 0.0) -> None:
        """Publish the next ``count`` patterned versions, one after another, ``interval`` seconds apart,
        in a thread (see :meth:`stream_done`)."""
        assert self.publisher is not None
        publisher = self.publisher
        sources = {name: np.zeros(n, dtype=np.uint64) for name, n in words.items()}
        first = (publisher.versions() or [0])[-1] + 1

        def run() -> None:
            start = time.monotonic()
            for version in range(first, first + count):
                for source in sources.values():
                    source.fill(version)
                assert publisher.publish(sources) == version
                if interval:
                    time.sleep(interval)
            self.stream_result = {"seconds": time.monotonic() - start, "versions": count}

        self.stream = threading.Thread(target=run, daemon=True)
        self.stream.start()

    def stream_done(self, timeout: float) -> dict[str, Any]:
        """Wait for the stream to end; what it did (an error if it failed)."""
        assert self.stream is not None
        self.stream.join(timeout)
        if self.stream.is_alive():
            raise TimeoutError(f"the stream did not end within {timeout} s")
        if not self.stream_result:
            raise RuntimeError("the stream failed (see the child's stderr)")
        return self.stream_result

    def table(self, name: str, rows: int, words: int) -> None:
        """A uint64 table of ``rows`` rows of ``words`` words, every row written once (version 1)."""
        table = self.tables[name] = Table(self.engine, name, (rows, words), np.uint64)
        everything = np.arange(rows)
        table.update(everything, row_pattern(everything, 1, words))

    def churn(self, name: str, seconds: float, batch: int) -> None:
        """Update ``batch`` random rows of table ``name`` at a time, as fast as it can, for ``seconds``."""
        table = self.tables[name]
        rng = np.random.default_rng(0)

        def run() -> None:
            end, updates = time.monotonic() + seconds, 0
            while time.monotonic() < end:
                rows = rng.choice(table.info.rows, size=batch, replace=False)
                version = table.updates + 1
                assert table.update(rows, row_pattern(rows, version, table.info.row_shape[0])) == version
                updates += 1
            self.stream_result = {"updates": updates}

        self.stream = threading.Thread(target=run, daemon=True)
        self.stream.start()

    def churn_tight(self, name: str, seconds: float) -> None:
        """Rewrite one random row of table ``name`` at a time, for ``seconds``, as :meth:`Table.update` does
        (its sequence word odd, the row, the word even) but in one C call, the three stores back to back:
        a gather's copy of a row then often overlaps a rewrite that began after the copy's first look at
        the word (shm's second look catches those; the word's oddness alone would not)."""
        table = self.tables[name]
        width = table._words.shape[1]
        first = int(table._words.ctypes.data)
        rng = np.random.default_rng(0)
        staged = np.zeros(width + 1, dtype=np.uint64)  # [odd word | the row as written: even word, hash, payload]
        pieces = np.array([[staged.ctypes.data, 0, 8], [staged.ctypes.data + 16, 0, 8 * (width - 1)], [staged.ctypes.data + 8, 0, 8]], dtype=np.uint64)

        def run() -> None:
            end, version = time.monotonic() + seconds, table.updates
            while time.monotonic() < end:
                row, version = int(rng.integers(table.info.rows)), version + 1
                written = staged[1:].reshape(1, width)
                written[0, 0] = 2 * version
                written[0, 2 : 2 + table.info.row_bytes // 8] = row_pattern(np.array([row]), version, table.info.row_bytes // 8)[0]
                written[0, 1] = row_hashes(written)[0]
                staged[0] = 2 * version - 1
                at = first + row * 8 * width
                copy_pieces(pieces, np.array([at, at + 8, at], dtype=np.uint64), True)
            self.stream_result = {"updates": version - table.updates}

        self.stream = threading.Thread(target=run, daemon=True)
        self.stream.start()

    def tear_row(self, name: str, row: int) -> None:
        """Leave row ``row`` of table ``name`` as if an update had stopped halfway (its seq word odd)."""
        self.tables[name]._words[row, 0] |= np.uint64(1)

    def mix_row(self, name: str, row: int) -> None:
        """Leave row ``row`` of table ``name`` as a copy mixing two updates would be (its seq word even,
        one payload word not the one its hash was made with)."""
        self.tables[name]._words[row, -1] ^= np.uint64(1 << 40)

    def close_table(self, name: str) -> None:
        """Stop serving table ``name`` (its memory deregistered: every peer has confirmed when this returns)."""
        self.tables.pop(name).close()

    # -- subscriber -----------------------------------------------------------------------------
    def pull(self, words: dict[str, int], version: int | None, stop: bool = False) -> int:
        """Pull into fresh patterned-size arrays (kept as ``last``); with ``stop``, freeze before reading."""
        assert self.subscriber is not None
        out = {name: hixl.empty(n, np.uint64) for name, n in words.items()}
        self.engine.armed = stop
        got = self.subscriber.pull(out, version=version, timeout=30.0)
        self.last = out
        return got

    def keep_and_pull(self, words: dict[str, int], version: int | None) -> int:
        """Keep what the last pull filled aside, then pull like ``pull(..., stop=True)``."""
        self._kept = self.last
        return self.pull(words, version, stop=True)

    def kept(self) -> tuple[int, bool]:
        """The subscriber's version, and whether what :meth:`keep_and_pull` kept still holds it whole."""
        assert self.subscriber is not None
        version = self.subscriber.version
        return version, all(bool((a == version).all()) for a in self._kept.values())

    def last_is(self, version: int) -> bool:
        """Whether every word of what the last successful pull filled is ``version``."""
        return bool(self.last) and all(bool((a == version).all()) for a in self.last.values())

    def torture(self, final: int, words: dict[str, int], timeout: float) -> dict[str, int]:
        """Pull the newest version again and again until version ``final`` was pulled; count what came back.

        ``torn``: pulls that returned without raising and hold anything but the version they returned.
        """
        assert self.subscriber is not None
        out = {name: hixl.empty(n, np.uint64) for name, n in words.items()}
        self.subscriber.wait_version(1, timeout)
        plan = self.subscriber.plan(out)
        counts = {"pulls": 0, "torn": 0, "superseded": 0, "last": 0}
        deadline = time.monotonic() + timeout
        while counts["last"] < final:
            self.subscriber.wait_version(counts["last"] + 1, deadline - time.monotonic())
            try:
                got = self.subscriber.pull(plan, timeout=deadline - time.monotonic())
            except hixl.weights.Superseded:
                counts["superseded"] += 1
                continue
            counts["pulls"] += 1
            counts["torn"] += not all(bool((a == got).all()) for a in out.values())
            counts["last"] = got
        return counts

    def gather(self, name: str, seconds: float, batch: int) -> dict[str, int]:
        """Gather ``batch`` random rows of table ``name`` again and again for ``seconds``; count torn rows.

        A row is torn when its words are not all ``index << 32 | version`` for the version it came back with.
        """
        assert self.subscriber is not None
        info = self.subscriber._table(name, time.monotonic() + 10)
        words, rng = info.row_shape[0], np.random.default_rng(1)
        out = np.zeros((batch, words), dtype=np.uint64)
        versions = np.zeros(batch, dtype=np.int64)
        counts = {"gathers": 0, "rows": 0, "torn": 0, "refused": 0}
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            rows = rng.choice(info.rows, size=batch, replace=False)
            try:
                self.subscriber.pull_rows(name, rows, out, versions=versions, timeout=10.0)
            except hixl.weights.TornRows:
                counts["refused"] += 1
                continue
            expected = (rows.astype(np.uint64) << np.uint64(32)) | versions.astype(np.uint64)
            counts["torn"] += int((out != expected[:, None]).any(axis=1).sum())
            counts["gathers"] += 1
            counts["rows"] += batch
        return counts

    def handle(self, command: str, args: Any) -> Any:
        return getattr(self, command)(*args)


def main() -> None:
    if os.environ.get(UNCHECKED) == "1":
        _checks.ENABLED = False
    conn = child_connection()
    role, settings = conn.recv()
    side = Side(role, settings)
    conn.send((side.engine.local_engine, os.getpid()))
    try:
        serve_commands(conn, side.handle)
    finally:
        for closable in (side.relay, side.subscriber, side.publisher, *side.tables.values()):
            if closable is not None:
                closable.close()
        for engine in (side.engine, side.upstream):
            if engine is not None:
                engine.finalize()


if __name__ == "__main__":
    main()
