"""An OTLP/HTTP trace endpoint for tests: the spans real processes' OpenTelemetry SDK exporters send, as dicts.

For tests of tracing set-ups (hixl's own: the proxy's and the vLLM
connector's spans): point the processes at :attr:`Receiver.url` with
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``, then look for spans in
:attr:`Receiver.spans` (:meth:`Receiver.wait_for`: exporters batch them for
seconds). Needs ``opentelemetry-proto`` (vLLM brings it).
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from typing import Any, TypeVar

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2


__all__ = ["Receiver"]

T = TypeVar("T")


class Receiver:
    """An OTLP/HTTP trace endpoint on 127.0.0.1: every span it is sent, as a dict (``service``, ``name``,
    ``trace``, ``id``, ``parent`` — hex, ``""`` for a root — ``attributes``, ``start`` and ``end`` in ns)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        lock, spans = threading.Lock(), self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_pb2.ExportTraceServiceRequest.FromString(body)
                with lock:
                    for resource in request.resource_spans:
                        service = {a.key: a.value.string_value for a in resource.resource.attributes}.get("service.name", "")
                        for scope in resource.scope_spans:
                            spans.extend(_span(s, service) for s in scope.spans)
                answer = trace_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        """The endpoint to give the processes (``--otlp-traces-endpoint``)."""
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def wait_for(self, what: str, found: Callable[[list[dict[str, Any]]], T | None], timeout: float = 30) -> T:
        """Poll ``found(spans)`` until it is truthy (the exporters batch spans for seconds) and return that;
        :class:`TimeoutError` naming ``what`` and the spans so far after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not (result := found(list(self.spans))):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no {what} in {timeout} s; spans: {[(s['service'], s['name']) for s in self.spans]}")
            time.sleep(0.5)
        return result

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _span(span: Any, service: str) -> dict[str, Any]:
    def value(v: Any) -> Any:
        return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None

    return {
        "service": service, "name": span.name, "trace": span.trace_id.hex(), "id": span.span_id.hex(),
        "parent": span.parent_span_id.hex(), "attributes": {a.key: value(a.value) for a in span.attributes},
        "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
    }  # fmt: skip
