"""Following one request: the id its client sees, and its transfers as OpenTelemetry spans.

**The id.** vLLM 0.32's OpenAI server names a request after the client's
``X-Request-Id`` header (a random one without it): ``cmpl-ID-N`` for the N-th
prompt of a completion, ``chatcmpl-ID`` for a chat, and its engine appends
``-`` and 8 random characters to make the id unique — that is the
``request_id`` a KV connector sees. :func:`client_id` undoes the wrapping, so
hixl's records can be found by the id the client (or ``hixl proxy``, which
makes one when the client sent none) put in the header; the vLLM id is kept
too. An id in another shape (offline ``LLM.generate``'s ``"0-abcd1234"``) is
returned without its random suffix only.

**Spans.** Where vLLM runs with ``--otlp-traces-endpoint``, its API server
passes each request's W3C ``traceparent`` to the engine, and vLLM's
``Request.trace_headers`` carry it to the scheduler-side connector, which hands
it to the worker with the load (:class:`~._params.LoadSpec`). The worker's
:class:`Spans` then adds, to that trace, one ``hixl.kv_load`` span per
request and decode rank (from the worker taking the load to its last layer
landing, or its failure), a ``hixl.kv_queue`` span before it (from the
request's arrival at decode's scheduler to the load's start: waiting to be
scheduled and for the link to prefill) and a ``hixl.kv_layer`` span per
layer (from the load's start to that layer landing). In push mode decode's
``hixl.kv_load`` runs from the worker taking the grant to prefill's last
DONE, with a ``hixl.kv_grant`` span inside it (windows opened, grants sent),
and prefill adds a ``hixl.kv_push`` span per request and prefill rank (from
the push's start to DONE sent) with a ``hixl.kv_layer`` span per layer (from
the layer computed to its writes landed). A request without a
trace context (the client sent none, and no proxy made one) gets a trace of
its own, found by the ``hixl.client_request_id`` attribute. Spans are made
after the fact from the timeline's record (:class:`~._timeline.Trace`), so
the load itself does nothing more when tracing is on than when the timeline
is, and nothing at all when both are off.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .._exceptions import HixlError
from ._timeline import Trace

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = ["Spans", "client_id", "transports"]

_VLLM_ID = re.compile(r"^(?:cmpl-(?P<completion>.+)-\d+|chatcmpl-(?P<chat>.+)|(?P<other>.+))-[0-9A-Za-z]{8}$")


def client_id(vllm_request_id: str) -> str:
    """The ``X-Request-Id`` a vLLM request id was made from (see the module docstring)."""
    found = _VLLM_ID.match(vllm_request_id)
    if found is None:
        return vllm_request_id
    return next(v for v in found.groupdict().values() if v is not None)


def transports(engine: Engine, peers: Iterable[str]) -> str:
    """What carries ``engine``'s traffic with each of ``peers`` (``cma``, ``shm``, ``tcp``; ``?`` where no link is
    up now), one name each, duplicates once, joined by ``,``: a record's ``transport``."""
    names = []
    for peer in peers:
        try:
            names.append(engine.transport_of(peer))
        except HixlError:  # the link went since (its reader found it dead)
            names.append("?")
    return ",".join(dict.fromkeys(names))


class Spans:
    """Exports the worker's load records as spans to vLLM's OTLP endpoint (the protocol vLLM uses:
    ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, gRPC by default)."""

    def __init__(self, endpoint: str, role: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        from vllm.tracing.otel import get_span_exporter

        # Its own provider, not the global one: vLLM may set that in this process for its own spans.
        self._provider = TracerProvider(resource=Resource.create({"service.name": "hixl.vllm", "hixl.role": role}))
        self._provider.add_span_processor(BatchSpanProcessor(get_span_exporter(endpoint)))
        self._tracer = self._provider.get_tracer("hixl.vllm")
        self._propagator = TraceContextTextMapPropagator()
        # Records hold time.monotonic(); spans want wall-clock nanoseconds.
        self._epoch_ns = time.time_ns() - time.monotonic_ns()

    @classmethod
    def open(cls, vllm_config: Any, role: str) -> Spans | None:
        """Spans if vLLM was started with ``--otlp-traces-endpoint``, else None (nothing is made)."""
        endpoint = getattr(getattr(vllm_config, "observability_config", None), "otlp_traces_endpoint", None)
        return cls(endpoint, role) if endpoint else None

    def _ns(self, at: float) -> int:
        return self._epoch_ns + int(at * 1e9)

    def emit(self, trace: Trace, trace_headers: Mapping[str, str] | None, arrived: float | None) -> None:
        """Add ``trace`` (a finished load or push, landed or failed) to its request's trace."""
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        parent = self._propagator.extract(dict(trace_headers)) if trace_headers else None
        attributes: dict[str, str | int | bool] = {
            "hixl.request_id": trace.request, "hixl.client_request_id": trace.client_id, "hixl.rank": trace.rank,
            "hixl.role": trace.role, "hixl.mode": trace.mode, "hixl.bytes": trace.nbytes, "hixl.transport": trace.transport,
            "hixl.outcome": trace.outcome, "hixl.retried": trace.retried,
        }  # fmt: skip
        if arrived is not None and arrived < trace.start:
            queued = self._tracer.start_span("hixl.kv_queue", parent, attributes=attributes, start_time=self._ns(arrived))
            queued.end(self._ns(trace.start))
        pushing = trace.role == "prefill"
        end = (trace.reported if pushing else trace.usable) or trace.reported or trace.step_end or trace.start
        name = "hixl.kv_push" if pushing else "hixl.kv_load"
        whole = self._tracer.start_span(name, parent, attributes=attributes, start_time=self._ns(trace.start))
        if trace.outcome != "ok":
            whole.set_status(Status(StatusCode.ERROR, trace.outcome))
        inside = set_span_in_context(whole)
        if trace.mode == "push" and not pushing and trace.issued is not None:
            granted = self._tracer.start_span("hixl.kv_grant", inside, start_time=self._ns(trace.start))
            granted.end(self._ns(trace.issued))
        for layer, (landed, asked, _) in enumerate(trace.layers):
            if landed is not None:
                # A pushed layer's write starts once it is computed; a pulled one is asked for at the load's start.
                began = asked if pushing and asked is not None else trace.start
                span = self._tracer.start_span("hixl.kv_layer", inside, attributes={"hixl.layer": layer}, start_time=self._ns(began))
                span.end(self._ns(landed))
        whole.end(self._ns(end))

    def close(self) -> None:
        """Export what is left and stop."""
        self._provider.shutdown()
