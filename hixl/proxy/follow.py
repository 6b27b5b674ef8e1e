"""Following one request through the proxy: its id, and (optionally) its OpenTelemetry spans.

**The id.** Every completion or chat request gets an ``X-Request-Id``: the
client's, else one the proxy makes (32 hex digits). It goes to prefill and to
decode (vLLM names the request after it, and the hixl connector's records
carry it: docs/vllm.md, "Follow one request") and back to the client in the
answer's headers.

**Spans** (``hixl proxy --otlp-traces-endpoint URL``, off by default): a
``hixl.proxy.request`` span for each request — the child of the client's W3C
``traceparent`` if it sent one, else a new trace's root — with a
``hixl.proxy.prefill`` / ``hixl.proxy.decode`` span for each hop (routing
included: an attempt's upstream, a retry's other one), whose ``traceparent``
goes to that upstream. vLLM started with ``--otlp-traces-endpoint`` then adds
its own spans, and the connector its transfer spans, to the same trace. The
exporter is the one vLLM uses for that endpoint: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
``grpc`` (the default) or ``http/protobuf``. With tracing off nothing of
OpenTelemetry is imported, a hop costs one context-variable read, and the
client's ``traceparent`` and ``tracestate`` go to both upstreams as they came
(vLLM's and the connector's spans still join the client's trace).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from aiohttp import web

__all__ = ["HEADER", "Tracing", "echo_request_id", "hop", "install", "outgoing", "with_request_id"]

#: The header naming a request, from the client to every upstream and back.
HEADER = "X-Request-Id"
_ROUTED = ("/v1/completions", "/v1/chat/completions")

# The request's tracer, its span, and the current span (the request's, or a hop's) in the handler's task (a hop's
# own task inherits its hop's); None: not traced.
_current: ContextVar[tuple[Any, Any, Any] | None] = ContextVar("hixl_proxy_span", default=None)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def with_request_id(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Give a routed request an ``X-Request-Id`` if it came without one (see the module docstring)."""
    if request.path in _ROUTED and HEADER not in request.headers:
        request = request.clone(headers={**request.headers, HEADER: uuid.uuid4().hex})
    response = await handler(request)
    if request.path in _ROUTED and not response.prepared:  # (aiohttp prepares it with the request before the clone)
        response.headers.setdefault(HEADER, request.headers[HEADER])
    return response


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the answer names the request as its upstreams knew it (a stream, prepared by
    the handler with the request :func:`with_request_id` gave it)."""
    if request.path in _ROUTED and HEADER in request.headers:
        response.headers.setdefault(HEADER, request.headers[HEADER])


class Tracing:
    """The proxy's spans, exported to ``endpoint``; :attr:`middleware` opens each request's span."""

    def __init__(self, endpoint: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": "hixl.proxy"}))
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
        self._tracer = self._provider.get_tracer("hixl.proxy")
        self._propagator = TraceContextTextMapPropagator()

    @web.middleware
    async def middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Run a routed request's handler inside its ``hixl.proxy.request`` span."""
        if request.path not in _ROUTED:
            return await handler(request)
        from opentelemetry.trace import SpanKind, Status, StatusCode

        parent = self._propagator.extract(dict(request.headers))
        attributes = {"http.route": request.path, "hixl.client_request_id": request.headers.get(HEADER, "")}
        with self._tracer.start_as_current_span("hixl.proxy.request", parent, SpanKind.SERVER, attributes) as span:
            token = _current.set((self, span, span))
            try:
                response = await handler(request)
            finally:
                _current.reset(token)
            span.set_attribute("http.status_code", response.status)
            if response.status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"answered {response.status}"))
            return response

    def close(self) -> None:
        """Export the spans not exported yet."""
        self._provider.shutdown()


def install(app: web.Application, otlp_traces_endpoint: str | None) -> None:
    """Give ``app``'s routed requests their id, and their spans if ``otlp_traces_endpoint`` is set."""
    app.middlewares.append(with_request_id)
    app.on_response_prepare.append(echo_request_id)
    if otlp_traces_endpoint:
        tracing = Tracing(otlp_traces_endpoint)
        app.middlewares.append(tracing.middleware)  # inside with_request_id: the span sees the request's id

        async def close(app: web.Application) -> None:
            tracing.close()

        app.on_cleanup.append(close)


@contextmanager
def hop(role: str, upstream: str) -> Iterator[None]:
    """One hop of a traced request (to ``upstream``, of ``role``) as a span, a child of the request's (hops
    entered one inside another, as a push attempt's two, are siblings); nothing if it is not traced. A task
    made inside sends this hop's ``traceparent`` (:func:`outgoing`)."""
    current = _current.get()
    if current is None:
        yield
        return
    from opentelemetry.trace import SpanKind, set_span_in_context

    tracing, request, _ = current
    span = tracing._tracer.start_span(
        f"hixl.proxy.{role}", set_span_in_context(request), SpanKind.CLIENT, {"hixl.upstream": upstream, "hixl.role": role}
    )
    token = _current.set((tracing, request, span))
    try:
        yield
    finally:
        _current.reset(token)
        span.end()


def outgoing() -> dict[str, str]:
    """The trace header for an upstream: the current hop's ``traceparent`` (none if not traced)."""
    current = _current.get()
    if current is None:
        return {}
    from opentelemetry.trace import set_span_in_context

    tracing, _, span = current
    carrier: dict[str, str] = {}
    tracing._propagator.inject(carrier, set_span_in_context(span))
    return carrier


def _exporter(endpoint: str) -> Any:
    """vLLM's choice of exporter for ``endpoint`` (see the module docstring)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"unsupported OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r}: grpc or http/protobuf")
