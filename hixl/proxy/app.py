"""The proxy's aiohttp application: two upstream hops per request, the second one streamed through.

How a request is routed, and what happens when an upstream fails:

- Each hop goes to the upstream of its role with the fewest outstanding
  requests, skipping those marked down (``upstreams.Pool``) — or, where the
  instances' KV events are followed, to the one with the longest cached prefix
  of the prompt, weighed against its load (``routing``); background health
  checks mark them down and up again (``health``). No upstream of a role up:
  a 503 at once.
- An *attempt* is a prefill hop, then a decode hop. When either fails before
  any byte reached the client (unreachable, timed out, a 5xx, a broken
  answer), the request is attempted again **from prefill**, avoiding the
  upstreams that failed it: at most ``retries`` more attempts. An upstream
  that could not be reached or timed out is also marked down for every
  request until a health check passes; one that *answered* (a 5xx, a broken
  answer) is alive and stays up for the others — its 5xx may be another
  instance's fault (a decode whose prefill died answers 500), and with one
  decode, marking it down would turn every later request into a 503.
- A failed decode is never given the same ``kv_transfer_params`` again. They
  name blocks prefill holds for one pull: the failed decode may have pulled
  them before failing, after which prefill frees them and vLLM reuses them,
  so a second pull would read some other request's KV with no error at all.
  A fresh prefill costs one more prompt computation; the first prefill's
  blocks are freed by the failed decode's pull, its release of their lease,
  or when the lease runs out (the connector's ``lease_s`` after the failed
  decode's last extension).
- Push mode (``kv_mode="push"``, see ``push``): an attempt sends the request
  to the prefill and to the decode at once, with one push id; decode's answer
  is the client's. A prefill the proxy knows nothing of yet gets a pull-mode
  attempt instead (its answer teaches the proxy where its KV lives). A prefill
  that fails (unreachable, a 5xx, a broken answer) fails the attempt and
  closes decode's request, unless decode already sent the client a byte (the
  push landed): nothing then waits for a push that will not come. A failed
  push attempt, on either side, makes the proxy forget what it knew of that
  prefill, so the retry pulls and learns afresh (a restarted prefill listens
  on new endpoints). A prefill's 4xx is passed through, decode's request closed.
- After the first byte of decode's answer went to the client nothing is
  retried (the client has part of an answer): an upstream failure then ends
  the stream with an OpenAI-shaped error event and no ``[DONE]``.
- A 4xx is the request's fault: passed through as is, not retried. After the
  last attempt a 5xx is passed through as is; an unreachable upstream gives a
  502. Every hop has a timeout, so the client never waits without end.
- A body that is not a JSON object the proxy can forward is a 400 saying why
  (``body``), before any upstream is asked. Error messages to clients name an
  upstream by its role, index and host:port only (``Upstream.name``); an
  upstream's credentials go to it alone.

The deadlines a *client* is held to (its headers, its body, taking what it is
sent) are the server's, around this app: see ``server``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientError, ClientResponse, ClientSession, ClientTimeout, TCPConnector, hdrs, web

from . import follow
from .body import BadBody, parse
from .health import watch
from .metrics import CONTENT_TYPE, Outcome, ProxyMetrics
from .options import ProxyOptions
from .push import PULL_PREFILL_PARAMS, KvSources, decode_params, new_push_id, prefill_params
from .routing import PrefixRouter
from .upstreams import Pool, Role, Upstream, describe

__all__ = ["create_app"]

log = logging.getLogger("hixl.proxy")

# The client's W3C trace context goes on as it came where the proxy does not trace; where it does, the hop's
# own traceparent (a child of the client's) takes its place (follow.outgoing).
_FORWARDED_HEADERS = (hdrs.AUTHORIZATION, "X-Request-Id", "traceparent", "tracestate")


def create_app(prefill: Sequence[str], decode: Sequence[str], options: ProxyOptions | None = None) -> web.Application:
    """The proxy for these prefill and decode base URLs (e.g. ``http://127.0.0.1:8100``); ``server.serve``
    serves it, holding its clients to their deadlines. ValueError if ``options.kv_events`` names another URL."""
    prefills, decodes, options = Pool(Role.PREFILL, prefill), Pool(Role.DECODE, decode), options or ProxyOptions()
    proxy = _Proxy(prefills, decodes, options, PrefixRouter(options, [(prefills, prefill), (decodes, decode)]))
    app = web.Application()
    follow.install(app, options.otlp_traces_endpoint)
    app.cleanup_ctx.append(proxy.lifetime)
    app.router.add_post("/v1/completions", proxy.disaggregated)
    app.router.add_post("/v1/chat/completions", proxy.disaggregated)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/metrics", proxy.metrics_text)
    return app


class _Failed(Exception):
    """A hop failed in a way another upstream may not: unreachable, too slow, a 5xx, a broken answer."""

    def __init__(self, upstream: Upstream, reason: str, answer: web.Response | None = None, answered: bool = False) -> None:
        super().__init__(f"{upstream.role.value} {upstream.url}: {reason}")  # for the log
        self.upstream, self.reason, self.answer = upstream, reason, answer  # answer: the 5xx, to pass on
        self.answered = answered
        """It answered (so it is alive): not marked down for other requests."""

    @property
    def public(self) -> str:
        """What failed, as a client is told it: the upstream by its name only."""
        return f"{self.upstream.name}: {self.reason}"


class _NoneUp(Exception):
    """No upstream of ``role`` may take the request."""

    def __init__(self, role: Role) -> None:
        super().__init__(role.value)
        self.role = role


@dataclass
class _Hop:
    """One request to one upstream; its outcome is an error unless the code relaying it says otherwise."""

    upstream: Upstream
    outcome: Outcome = Outcome.ERROR
    streaming: bool = False  # decode: the client has its first bytes (nothing can be retried)


class _Proxy:
    """The handlers and what they share: the pools, the router, the options, the metrics, the HTTP client session."""

    _session: ClientSession  # from lifetime()'s start to its end

    def __init__(self, prefills: Pool, decodes: Pool, options: ProxyOptions, router: PrefixRouter) -> None:
        self.prefills, self.decodes, self.options, self.router = prefills, decodes, options, router
        self.metrics = ProxyMetrics([*prefills.upstreams, *decodes.upstreams], router.families)
        self.sources = KvSources()  # push mode: where each prefill's KV lives, from its answers
        # For hops that end with one answer; decode's streams get the session's per-read limit only.
        self._bounded = ClientTimeout(total=options.timeout, connect=options.connect_timeout)

    async def lifetime(self, app: web.Application) -> AsyncIterator[None]:
        """The client session, the health checks and the KV events followed, from the app's start to its cleanup."""
        o = self.options
        # No connection limit: a request queued inside the pool would wait with no timeout of
        # its own and still count as outstanding, so only the routing decides who waits.
        self._session = ClientSession(
            connector=TCPConnector(limit=0),
            timeout=ClientTimeout(total=None, connect=o.connect_timeout, sock_read=o.timeout),
        )
        upstreams = [*self.prefills.upstreams, *self.decodes.upstreams]
        checks = asyncio.create_task(watch(self._session, upstreams, o.health_interval, o.health_timeout, o.down_after))
        await self.router.start()
        yield
        await self.router.stop()
        checks.cancel()
        with suppress(asyncio.CancelledError):
            await checks
        await self._session.close()

    async def disaggregated(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` and ``/v1/chat/completions``: prefill, then decode, retried as the module says."""
        try:
            body = parse(await request.read())
        except BadBody as exc:
            return _error(400, str(exc))
        failed: set[Upstream] = set()
        last: _Failed | None = None
        attempts = self.options.retries + 1
        tokens = await self.router.prompt_tokens(self._session, body, lambda up: _forwarded(request, up))
        for attempt in range(1, attempts + 1):
            if last is not None:
                self.metrics.retries.inc(last.upstream.role.value)
            try:
                return await self._attempt(request, body, failed, tokens)
            except _Failed as exc:
                log.warning("attempt %d of %d failed: %s", attempt, attempts, exc)
                if not exc.answered:
                    exc.upstream.request_failed(exc.reason)
                failed.add(exc.upstream)
                last = exc
            except _NoneUp as exc:
                if last is not None and last.answer is not None:
                    return last.answer  # no other instance to try: the failing one's own answer
                self.metrics.unavailable.inc(exc.role.value)
                after = f"; this request failed on {last.public}" if last else ""
                return _error(503, f"no {exc.role.value} instance is up{after}")
        assert last is not None  # the loop returns unless an attempt failed
        if last.answer is not None:
            return last.answer
        return _error(502, f"{last.public} (attempt {attempts} of {attempts})")

    async def models(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models``: a decode instance's answer."""
        up = self.decodes.pick()
        if up is None:
            self.metrics.unavailable.inc(Role.DECODE.value)
            return _error(503, "no decode instance is up")
        try:
            headers = _forwarded(request, up)
            async with self._session.get(up.url + "/v1/models", headers=headers, auth=up.auth, timeout=self._bounded) as resp:
                return _relay(resp, await resp.read())
        except (ClientError, asyncio.TimeoutError) as exc:
            reason = describe(exc, self.options.timeout)
            up.request_failed(reason)
            return _error(502, f"{up.name}: {reason}")

    async def health(self, request: web.Request) -> web.StreamResponse:
        """``GET /health``: 200 while some prefill and some decode are up, 503 (saying which is not) otherwise."""
        missing = [pool.role.value for pool in (self.prefills, self.decodes) if not pool.any_up]
        if missing:
            return _error(503, f"no {' and no '.join(missing)} instance is up")
        return web.json_response({"status": "ok"})

    async def metrics_text(self, request: web.Request) -> web.StreamResponse:
        """``GET /metrics``: Prometheus's text format."""
        return web.Response(body=self.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    async def _attempt(
        self, request: web.Request, body: dict[str, Any], failed: set[Upstream], tokens: list[int] | None
    ) -> web.StreamResponse:
        prefill = self._pick(self.prefills, failed, tokens)
        source = self.sources.of(prefill) if self.options.kv_mode == "push" else None
        if source is not None:
            return await self._push(request, body, failed, tokens, prefill, source)
        with self._hop(prefill) as hop:
            answer = await self._prefill(hop, request, body, PULL_PREFILL_PARAMS)
        if isinstance(answer, web.Response):
            return answer
        kv_params = answer.get("kv_transfer_params")
        self.sources.learn(prefill, kv_params)
        if kv_params is None:
            log.warning("prefill returned no kv_transfer_params: decode computes the prompt itself")
        with self._hop(self._pick(self.decodes, failed, tokens)) as hop:
            return await self._decode(hop, request, {**body, "kv_transfer_params": kv_params})

    async def _push(
        self, request: web.Request, body: dict[str, Any], failed: set[Upstream], tokens: list[int] | None,
        prefill: Upstream, source: dict[str, Any],
    ) -> web.StreamResponse:
        """A push-mode attempt: prefill and decode at once, one push id; decode's answer for the client."""
        push_id = new_push_id()
        decode = self._pick(self.decodes, failed, tokens)  # (before a task starts: none is left behind if none is up)
        # Each task is made inside its own hop: it sends that hop's traceparent (follow.outgoing).
        with self._hop(prefill) as prefill_hop:
            prefilled = asyncio.create_task(self._prefill(prefill_hop, request, body, prefill_params(push_id)))
            with self._hop(decode) as decode_hop:
                decoded = asyncio.create_task(self._decode(decode_hop, request, {**body, "kv_transfer_params": decode_params(source, push_id)}))
                try:
                    await asyncio.wait((prefilled, decoded), return_when=asyncio.FIRST_COMPLETED)
                    if prefilled.done() and not decoded.done() and not decode_hop.streaming:
                        answer = await self._settled(prefilled, prefill)
                        if isinstance(answer, web.Response):  # prefill refused the request: so would decode
                            return answer
                    try:
                        out = await decoded
                    except _Failed:
                        self.sources.forget(prefill)  # its push may have gone to endpoints that are no more
                        raise
                    # Decode took the push. Prefill's answer, due about now, only refreshes what the proxy knows.
                    with suppress(_Failed):
                        await self._settled(prefilled, prefill)
                    return out
                finally:
                    for task, hop in ((prefilled, prefill_hop), (decoded, decode_hop)):
                        if not task.done():
                            task.cancel()  # closes its connection: vLLM aborts the request there
                            hop.outcome = Outcome.CANCELLED
                    await asyncio.gather(prefilled, decoded, return_exceptions=True)

    async def _settled(self, prefilled: asyncio.Task[web.Response | dict[str, Any]], prefill: Upstream) -> web.Response | dict[str, Any]:
        """Prefill's answer in a push attempt, learned from; a failure makes the proxy forget the prefill."""
        try:
            answer = await prefilled
        except _Failed:
            self.sources.forget(prefill)
            raise
        if not isinstance(answer, web.Response):
            self.sources.learn(prefill, answer.get("kv_transfer_params"))
        return answer

    def _pick(self, pool: Pool, failed: set[Upstream], tokens: list[int] | None) -> Upstream:
        # One that failed this request but is still up (it answered) is taken again if no
        # other is left: a decode's 5xx may have been its prefill's fault, and the retry
        # comes through a fresh prefill.
        up = self.router.pick(pool, failed, tokens) or self.router.pick(pool, (), tokens)
        if up is None:
            raise _NoneUp(pool.role)
        return up

    @contextmanager
    def _hop(self, up: Upstream) -> Iterator[_Hop]:
        """Lease ``up`` for one request (taken before any ``await``: see ``Pool.pick``), time it, count its outcome."""
        hop = _Hop(up)
        started = time.monotonic()
        with up.lease(), follow.hop(up.role.value, up.name):
            try:
                yield hop
            except asyncio.CancelledError:
                if hop.outcome is not Outcome.OK:  # (a stream's client may leave once it has it all)
                    hop.outcome = Outcome.CANCELLED
                raise
            finally:
                self.metrics.hop(up, hop.outcome, time.monotonic() - started)

    async def _prefill(
        self, hop: _Hop, request: web.Request, body: dict[str, Any], kv_params: dict[str, Any]
    ) -> web.Response | dict[str, Any]:
        """Prefill's JSON answer, or a non-200 answer to give the client; raises :class:`_Failed`."""
        up = hop.upstream
        try:
            headers, sent = _forwarded(request, up), _prefill_body(body, kv_params)
            async with self._session.post(up.url + request.path, json=sent, headers=headers, auth=up.auth, timeout=self._bounded) as resp:
                payload = await resp.read()
        except (ClientError, asyncio.TimeoutError) as exc:
            raise _Failed(up, describe(exc, self.options.timeout)) from exc
        answer = _relay(resp, payload)
        if resp.status >= 500:
            raise _Failed(up, f"answered {resp.status}", answer, answered=True)
        if resp.status != 200:
            hop.outcome = _outcome(resp.status)
            return answer
        try:
            parsed = json.loads(payload)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise _Failed(up, "answered 200 with a body that is not a JSON object", answered=True)
        hop.outcome = Outcome.OK
        return parsed

    async def _decode(self, hop: _Hop, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """Decode's answer for the client; raises :class:`_Failed` while nothing was sent yet."""
        up = hop.upstream
        try:
            async with self._session.post(up.url + request.path, json=body, headers=_forwarded(request, up), auth=up.auth) as resp:
                if resp.status >= 500:
                    raise _Failed(up, f"answered {resp.status}", _relay(resp, await resp.read()), answered=True)
                if resp.status != 200 or not body.get("stream"):
                    answer = _relay(resp, await resp.read())  # read whole: a failure while reading can still be retried
                    hop.outcome = _outcome(resp.status)
                    return answer
                # The client's headers wait for decode's first bytes, so that a decode that
                # fails before it generates anything can still be retried.
                first = await resp.content.readany()
                if not first:
                    raise _Failed(up, "ended its stream before the first byte")
                return await self._stream(hop, request, resp, first)
        except (ClientError, asyncio.TimeoutError) as exc:
            raise _Failed(up, describe(exc, self.options.timeout)) from exc

    async def _stream(self, hop: _Hop, request: web.Request, resp: ClientResponse, first: bytes) -> web.StreamResponse:
        """Relay decode's stream from its first chunk on; no failure from here is retried, none escapes."""
        out = web.StreamResponse(status=200, headers={"Content-Type": resp.headers.get("Content-Type", "text/event-stream")})
        chunk, seen = first, b""
        hop.streaming = True
        try:
            await out.prepare(request)
            while chunk:
                await out.write(chunk)
                seen = seen[-len(_DONE) :] + chunk  # (the marker may be cut between two chunks)
                if _DONE in seen:
                    # The client has the whole answer: one that closes at once (the OpenAI SDK does)
                    # has not cancelled anything, though the stream's end can no longer reach it.
                    hop.outcome = Outcome.OK
                try:
                    chunk = await resp.content.readany()
                except (ClientError, asyncio.TimeoutError) as exc:
                    reason = describe(exc, self.options.timeout)
                    log.warning("decode %s failed mid-stream, the client's stream ends: %s", hop.upstream.url, reason)
                    hop.upstream.request_failed(reason)
                    await out.write(b"data: " + json.dumps(_error_body(502, f"decode failed mid-stream: {reason}")).encode() + b"\n\n")
                    break
            else:  # the stream ended as decode meant it to
                hop.outcome = Outcome.OK
            await out.write_eof()
        except ConnectionResetError:  # the client went away (aiohttp's own reset errors are these too)
            if hop.outcome is not Outcome.OK:
                hop.outcome = Outcome.CANCELLED
        return out


_DONE = b"data: [DONE]"
"""The event that ends an OpenAI-style stream: once relayed, the client has the whole answer."""


def _prefill_body(body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The request as prefill gets it: one token, not streamed, KV for decode as ``kv_params`` say."""
    out = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": kv_params}
    out.pop("stream_options", None)  # only valid with stream=True
    if "max_completion_tokens" in out:  # the chat API's newer name for max_tokens
        out["max_completion_tokens"] = 1
    return out


def _outcome(status: int) -> Outcome:
    """The outcome of an answer relayed with this (non-5xx) status."""
    return Outcome.CLIENT_ERROR if 400 <= status < 500 else Outcome.OK


def _forwarded(request: web.Request, up: Upstream) -> dict[str, str]:
    """The client's headers that go on to ``up``."""
    # A request has one Authorization header: where the operator gave credentials for this upstream
    # (sent as ``auth=up.auth``), theirs go, not the client's.
    names = [h for h in _FORWARDED_HEADERS if not (up.auth and h == hdrs.AUTHORIZATION)]
    return {h: request.headers[h] for h in names if h in request.headers} | follow.outgoing()


def _relay(resp: ClientResponse, payload: bytes) -> web.Response:
    """An upstream's whole answer, as the client gets it."""
    return web.Response(body=payload, status=resp.status, content_type=resp.content_type)


def _error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "proxy_error", "code": status}}


def _error(status: int, message: str) -> web.Response:
    return web.json_response(_error_body(status, message), status=status)
