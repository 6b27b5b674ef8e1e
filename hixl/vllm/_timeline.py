"""Per-request timelines of KV transfers: where a request's load (or push) time goes.

Off by default, and then free: the worker holds ``None`` and tests it once per
call. On when the ``vllm.hixl`` logger is at DEBUG (one log line per request),
when the connector's ``records`` setting names a file (one JSON line per
request and decode rank appended to it, failed loads too: the per-request
export), when vLLM traces to an OTLP endpoint (each record becomes spans of
the request's trace, :mod:`._follow`), and/or when :data:`ENV` names a file
(the records, each with a reference pull timed too: what ``hixl bench
--scenario vllm --timeline`` reads).

Every time is ``time.monotonic()``, system-wide on Linux, so the records of
several processes compare. A record (:class:`Trace`, as a dict) of a pull
(``role`` ``decode``, ``mode`` ``layerwise`` or ``whole``):

* ``start`` — the worker took the request's LoadSpec (``start_load_kv``);
* ``issued`` — the plan made and every layer handed to the engine (a whole
  pull: its one copy done too, it runs inline);
* ``layers`` — per layer ``[landed, asked, noticed]``: the engine request's
  completion time (the copy done), when vLLM called ``wait_for_layer_load``,
  and when that returned;
* ``step_end`` — ``wait_for_save``: the step's forward is over;
* ``usable`` — the last layer landed: the end of the load, as the bench
  compares connectors (start to usable);
* ``sync_ref`` — :data:`ENV`'s file only: seconds one ``transfer_sync`` of the
  same bytes between the same processes took, timed after the step;
* ``client_id`` — the request's ``X-Request-Id`` (:func:`~._follow.client_id`),
  ``request`` being vLLM's id for it; ``transport`` — what carried the bytes
  (``cma``, ``shm``, ``tcp``; one per prefill rank read, joined by ``,``);
  ``outcome`` — ``ok``, or why the load failed; ``retried`` — its link broke
  and it was pulled again after relinking.

In push mode both ends record each push (``mode`` ``push``), where a pull's
record would be written. Decode (``role`` ``decode``), one per request and
decode rank: ``start`` — the worker took the grant; ``issued`` — its windows
registered and every prefill rank sent its grant; ``usable`` — the last
prefill rank read from said its writes are done (decode sees no layer land:
``layers`` stays empty); ``reported`` — the windows withdrawn, the request
reported to vLLM; ``outcome`` — ``ok``, ``revoked`` (decode dropped the
request) or ``failed: WHY``. Prefill (``role`` ``prefill``), one per request
and prefill rank: ``start`` — the push started (its first step); per layer
``[landed, asked, noticed]`` of the prompt's last step — its writes landed
in every decode rank, vLLM's ``save_kv_layer`` called (the layer computed),
and the writes handed to the engine (the call returned: a same-host write
may land before it does); ``usable`` — the
last layer landed; ``step_end`` — the last step's ``wait_for_save``;
``reported`` — DONE sent to every decode rank; ``nbytes`` — the bytes
written (a block written by two steps counted twice); ``transport`` — one
per decode rank written.

A layer's ``noticed - max(landed, asked)`` is time spent waiting for the
interpreter — the worker thread woken, or its turn on a core that vLLM's
main thread spins on between steps — not for the copy.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._follow import Spans

__all__ = ["ENV", "Timeline", "Trace", "phases"]

#: The environment variable naming the file timelines are appended to (JSON lines).
ENV = "HIXL_VLLM_TIMELINE"


@dataclass
class Trace:
    """One request's load (or push) on one rank; see the module docstring for each field."""

    connector: str
    request: str
    rank: int
    start: float
    mode: str = ""
    nbytes: int = 0
    issued: float | None = None
    layers: list[list[float | None]] = field(default_factory=list)  # [landed, asked, noticed]
    step_end: float | None = None
    usable: float | None = None
    sync_ref: float | None = None
    client_id: str = ""
    transport: str = ""
    outcome: str = "ok"
    retried: bool = False
    role: str = "decode"
    reported: float | None = None

    def asked(self, layer: int, asked: float, noticed: float) -> None:
        """vLLM waited for ``layer`` from ``asked`` to ``noticed``."""
        while len(self.layers) <= layer:
            self.layers.append([None, None, None])
        self.layers[layer][1:] = [asked, noticed]

    def landed(self, landed: Iterable[float | None]) -> None:
        """Each layer's copy-done time, in layer order; the last one's is when the request is usable."""
        for layer, at in enumerate(landed):
            while len(self.layers) <= layer:
                self.layers.append([None, None, None])
            self.layers[layer][0] = at
        self.usable = self.layers[-1][0] if self.layers else None

    def describe(self) -> str:
        """The timeline in milliseconds after ``start``, for the log."""

        def ms(at: float | None) -> str:
            return "-" if at is None else f"+{(at - self.start) * 1e3:.3f}"

        layers = "; ".join(f"layer {i} landed {ms(a)} asked {ms(b)} noticed {ms(c)}" for i, (a, b, c) in enumerate(self.layers))
        return (
            f"request {self.request} {self.role} rank {self.rank} ({self.mode}, {self.nbytes / 2**20:.2f} MiB, {self.outcome}), "
            f"ms after the {'push' if self.mode == 'push' else 'load'} started: issued {ms(self.issued)}; {layers}; "
            f"usable {ms(self.usable)}; step end {ms(self.step_end)}; reported {ms(self.reported)}"
        )


class Timeline:
    """Where a worker's traces go: the debug log, a JSON-lines file, spans (see the module docstring)."""

    def __init__(self, log: logging.Logger, path: str | None, reference: bool = False, spans: Spans | None = None) -> None:
        self._log = log
        self.path = path
        """The file traces are appended to (None: none)."""
        self.reference = reference
        """Workers also time ``sync_ref`` (:data:`ENV`'s file: measuring, it costs a second pull)."""
        self._spans = spans

    @classmethod
    def open(cls, log: logging.Logger, records: str | None = None, spans: Spans | None = None) -> Timeline | None:
        """A timeline if ``log`` is at DEBUG, ``records`` names a file, ``spans`` are wanted or :data:`ENV` is
        set, else None (the worker then records nothing)."""
        bench = os.environ.get(ENV) or None
        if bench is None and records is None and spans is None and not log.isEnabledFor(logging.DEBUG):
            return None
        return cls(log, bench or records, bench is not None, spans)

    def write(self, trace: Trace, trace_headers: Mapping[str, str] | None = None, arrived: float | None = None) -> None:
        """Log ``trace`` at DEBUG, append it to the file (one line: appends of processes do not interleave), and
        make it spans of the request's trace (``trace_headers``; ``arrived``: when decode's scheduler got it)."""
        self._log.debug("hixl: timeline of %s", trace.describe())
        if self.path is not None:
            append(self.path, asdict(trace))
        if self._spans is not None:
            self._spans.emit(trace, trace_headers, arrived)

    def close(self) -> None:
        """Export the spans not exported yet."""
        if self._spans is not None:
            self._spans.close()


def append(path: str, record: Mapping[str, Any]) -> None:
    """Append ``record`` to ``path`` as one JSON line, in one write (O_APPEND: whole lines from every process)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def phases(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Where a median request's time goes: each phase's median over ``records``, in milliseconds.

    Phases, each from the load's start unless it says otherwise: ``issued``,
    ``first layer landed``, ``usable`` (the last layer landed), ``vLLM first
    asked``, ``waiting for the copy`` and ``waiting for the interpreter`` (sums
    over layers; see the module docstring), ``step end``, and ``sync_ref`` (one
    ``transfer_sync`` of the same bytes). A phase no record has is left out.
    """
    found: dict[str, list[float]] = {}

    def add(name: str, value: float | None) -> None:
        if value is not None:
            found.setdefault(name, []).append(value * 1e3)

    for record in records:
        start, layers = record["start"], record.get("layers") or []

        def since(at: float | None, start: float = start) -> float | None:
            return None if at is None else at - start

        add("issued", since(record.get("issued")))
        add("first layer landed", since(layers[0][0]) if layers else None)
        add("usable", since(record.get("usable")))
        add("vLLM first asked", since(layers[0][1]) if layers else None)
        if layers and all(None not in layer for layer in layers):
            add("waiting for the copy", sum(max(0.0, landed - asked) for landed, asked, _ in layers))
            add("waiting for the interpreter", sum(noticed - max(landed, asked) for landed, asked, noticed in layers))
        add("step end", since(record.get("step_end")))
        add("sync_ref", record.get("sync_ref"))
    return {name: statistics.median(values) for name, values in found.items()}
