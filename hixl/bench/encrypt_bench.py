"""The engine scenario's encrypted rows: TCP with ``encrypt=True`` against plaintext TCP, same run.

Two bench targets (:mod:`hixl.bench.target`) share a fresh secret, one encrypting and one not,
and two initiator engines in this process reach them over 127.0.0.1, the same local buffer
registered with both. For each size of the run from :data:`ENCRYPTED_FROM` on (a ``--quick`` run:
its largest), READ and WRITE, the two engines' transfers of one range are timed in alternating
repetitions (:func:`~hixl.bench.timing.interleaved_reps`), so that both meet the same machine;
the row is the encrypted bandwidth, its baseline the plaintext one. The encrypted READ is
checked against the target's bytes first.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable

import numpy as np

from .. import Engine, Op, TransferOpDesc, empty
from .._protocol.seal import aead_unavailable
from .config import BenchConfig, format_size
from .progress import Progress
from .results import Row, Target, median
from .target import BenchTarget, RemoteBuffer, sample_bytes
from .timing import interleaved_reps

__all__ = ["ENCRYPTED_BANDWIDTH", "ENCRYPTED_FROM", "encrypted_rows", "encrypted_sizes"]

MiB = 1 << 20
ENCRYPTED_FROM = 16 * MiB
ENCRYPTED_BANDWIDTH = Target(">=", 0.7)
"""Issue 34's: encrypted TCP at least 0.7x plaintext TCP, from :data:`ENCRYPTED_FROM` bytes."""
_SEED = 17


def encrypted_sizes(config: BenchConfig) -> tuple[int, ...]:
    """The sizes the rows are measured at: the run's from :data:`ENCRYPTED_FROM` on, else its largest."""
    return tuple(s for s in config.sizes if s >= ENCRYPTED_FROM) or (max(config.sizes),)


def encrypted_rows(config: BenchConfig, progress: Progress, scenario: str) -> tuple[list[Row], list[str]]:
    """The rows (see the module docstring), or none and a note saying why they could not be made."""
    sizes = encrypted_sizes(config)
    missing = aead_unavailable()
    if missing is not None:
        progress.skip(2 * len(sizes))
        return [], [f"tcp encrypted: skipped, {missing}"]
    secret = {"auth_secret": secrets.token_hex(16)}
    rows = []
    with contextlib.closing(_Pair(secret, max(sizes))) as pair:
        for op in (Op.READ, Op.WRITE):
            for nbytes in sizes:
                iterations = max(1, min(config.max_iterations, config.bytes_per_rep // nbytes))
                with progress.step(f"tcp encrypted {op.name} {format_size(nbytes)}"):
                    times = interleaved_reps(pair.copiers(op, nbytes), iterations, config.repeat, config.warmup)
                speed = {name: nbytes * iterations / (median(laps) / 1e9) / (1 << 30) for name, laps in times.items()}
                rows.append(
                    Row(
                        "encrypted bandwidth",
                        "tcp",
                        op.name,
                        nbytes,
                        speed["encrypted"],
                        "GiB/s",
                        baseline=speed["plaintext"],
                        baseline_name="hixl tcp, plaintext, same run",
                        target=ENCRYPTED_BANDWIDTH if nbytes >= ENCRYPTED_FROM else None,
                        scenario=scenario,
                        note="encrypt=True (AES-256-GCM)",
                    )
                )
    return rows, []


class _Pair:
    """The two targets and the two initiators, each connected, with one local buffer of ``size`` bytes."""

    def __init__(self, secret: dict[str, str], size: int) -> None:
        self._stack = contextlib.ExitStack()
        try:
            self.local = empty(size)
            self.local.fill(0x11)
            self._ends = {
                name: self._open({**secret, "encrypt": name == "encrypted"}, size)
                for name in ("encrypted", "plaintext")
            }
            self._check(size)
        except BaseException:
            self._stack.close()
            raise

    def _open(self, options: dict[str, object], size: int) -> tuple[Engine, BenchTarget, RemoteBuffer]:
        target = self._stack.enter_context(BenchTarget(options))
        engine = self._stack.enter_context(Engine("127.0.0.1", {**options, "transport": "tcp"}))
        engine.register_mem(self.local)
        remote = target.alloc(size, _SEED)
        self._stack.callback(target.free, remote)
        engine.connect(target.engine)
        return engine, target, remote

    def _check(self, size: int) -> None:
        engine, target, remote = self._ends["encrypted"]
        engine.transfer_sync(target.engine, Op.READ, [TransferOpDesc(int(self.local.ctypes.data), remote.addr, size)])
        expected = sample_bytes(_SEED, size)
        if not np.array_equal(self.local[: len(expected)], expected):
            raise RuntimeError("bench self-check failed: an encrypted READ did not bring the target's bytes")

    def copiers(self, op: Op, nbytes: int) -> dict[str, Callable[[], None]]:
        """One transfer of ``nbytes`` by each engine, as the timing loop calls it."""
        local = int(self.local.ctypes.data)
        return {
            name: _copier(engine, target.engine, op, local, remote.addr, nbytes)
            for name, (engine, target, remote) in self._ends.items()
        }

    def close(self) -> None:
        """Free the buffers, finalize the engines, stop the targets."""
        self._stack.close()


def _copier(engine: Engine, peer: str, op: Op, local: int, remote: int, nbytes: int) -> Callable[[], None]:
    descs = [TransferOpDesc(local, remote, nbytes)]
    sync = engine.transfer_sync

    def copy() -> None:
        sync(peer, op, descs)

    return copy
