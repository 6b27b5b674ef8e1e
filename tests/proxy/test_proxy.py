"""``hixl proxy`` in front of a fleet of fake vLLM instances that fail to order.

Each fake (:class:`FakeVllm`) is a real aiohttp server on 127.0.0.1 speaking
just enough of vLLM's OpenAI API: prefill answers with ``kv_transfer_params``
naming a fresh transfer id, decode answers whole or as an SSE stream,
``GET /health`` says whether it is healthy. It can be told to answer 500,
hang, drop the connection mid-stream, stream without end, hold requests until
released, or be stopped. The proxy runs in the same event loop, served as the
command serves it (``server.serve``), and as the real ``hixl proxy`` command.
Clients that misbehave (too slow to send, never reading) are raw sockets.
Nothing sleeps a fixed time but a slow client between its bytes: waits poll
a condition until a deadline.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import itertools
import json
import re
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")

from aiohttp import ClientSession, web  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402

from hixl.proxy.body import MAX_DEPTH  # noqa: E402
from hixl.proxy.options import ProxyOptions  # noqa: E402
from hixl.proxy.server import serve  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(30)

WORDS = ["w1", "w2", "w3"]


def async_test(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run the coroutine test ``fn`` in a fresh event loop (no asyncio plugin needed)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return run


async def until(condition: Callable[[], Awaitable[bool] | bool], what: str, timeout: float = 5.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        held = condition()
        if isinstance(held, Awaitable):
            held = await held
        if held:
            return
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.02)


class FakeVllm:
    """A vLLM instance's stand-in in one role, with faults to order.

    ``fault``: None, ``"500"`` (every completion answers 500), ``"500-once"`` (the
    next completion answers 500, then the fault clears), ``"hang"`` (no
    answer until stopped), ``"break"`` (decode: one chunk of the stream, then
    the connection drops), ``"stall"`` (decode: one chunk, then nothing until
    stopped), ``"linger"`` (decode: the whole stream, then 0.3 s before it ends), ``"flood"``
    (decode: 64 KiB events without end, as fast as they are taken). ``gate``: when
    an Event, completions wait for it.
    ``bodies``: the completion request bodies received, in order; ``authorizations``: every
    request's Authorization header (None: none), health checks' too; ``required``: when set, the
    Authorization every request must carry, else 401; ``disconnects``: completions that ended
    because the proxy went away first; ``extra_params``: more ``kv_transfer_params`` a prefill answers with.
    """

    def __init__(self, role: str) -> None:
        self.role = role
        self.fault: str | None = None
        self.healthy = True
        self.gate: asyncio.Event | None = None
        self.bodies: list[dict[str, Any]] = []
        self.followed: list[tuple[str | None, str | None]] = []  # each completion's (X-Request-Id, traceparent)
        self.authorizations: list[str | None] = []
        self.required: str | None = None
        self.disconnects = 0
        self.extra_params: dict[str, Any] = {}
        self._transfer_ids = itertools.count(1)
        self._stopping = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self.server = TestServer(app, host="127.0.0.1")

    async def start(self) -> None:
        """Listen on a free port; ``url`` is its base URL from now on (after :meth:`stop` too)."""
        await self.server.start_server()
        self.url = f"http://127.0.0.1:{self.server.port}"

    async def stop(self) -> None:
        """Release what hangs and stop listening: connections to it are refused from now on."""
        self._stopping.set()
        if self.gate is not None:
            self.gate.set()
        await self.server.close()

    async def _health(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.json_response({}, status=401)
        return web.json_response({}, status=200 if self.healthy else 503)

    def _authorized(self, request: web.Request) -> bool:
        self.authorizations.append(request.headers.get("Authorization"))
        return self.required is None or self.authorizations[-1] == self.required

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._complete(request)
        except (asyncio.CancelledError, ConnectionError):  # (the test server cancels a handler whose client left)
            self.disconnects += 1
            raise

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "who are you?", "code": 401}}, status=401)
        body = await request.json()
        self.bodies.append(body)
        self.followed.append((request.headers.get("X-Request-Id"), request.headers.get("traceparent")))
        if self.gate is not None:
            await self.gate.wait()
        if self.fault == "hang":
            await self._stopping.wait()
        if self.fault in ("500", "500-once", "hang"):
            if self.fault == "500-once":
                self.fault = None
            return web.json_response({"error": {"message": "injected", "code": 500}}, status=500)
        if body.get("model") == "missing":
            return web.json_response({"error": {"message": "no such model", "code": 404}}, status=404)
        if self.role == "prefill":
            params = {"remote_engine": self.url, "remote_transfer_id": next(self._transfer_ids), **self.extra_params}
            return web.json_response({"choices": [{"text": "w0"}], "kv_transfer_params": params})
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": " ".join(WORDS)}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        while self.fault == "flood":
            await out.write(b"data: " + json.dumps({"choices": [{"text": "w" * 65536}]}).encode() + b"\n\n")
        for word in WORDS:
            await out.write(b"data: " + json.dumps({"choices": [{"text": word}]}).encode() + b"\n\n")
            if self.fault == "break":
                assert request.transport is not None
                request.transport.close()  # what a crashed decode leaves: a chunked stream without its end
                return out
            if self.fault == "stall":
                await self._stopping.wait()
        await out.write(b"data: [DONE]\n\n")
        if self.fault == "linger":
            await asyncio.sleep(0.3)
        await out.write_eof()
        return out


@dataclass
class Fleet:
    """Fake prefills and decodes, the proxy in front of them, and a client of the proxy."""

    prefills: list[FakeVllm]
    decodes: list[FakeVllm]
    port: int  # the proxy's
    client: ClientSession

    def url(self, path: str) -> str:
        """The proxy's URL for ``path``."""
        return f"http://127.0.0.1:{self.port}{path}"

    async def ask(self, stream: bool = False, chat: bool = False, model: str = "fake") -> tuple[int, Any]:
        """One request through the proxy: its status and its JSON body, or (streamed) its SSE events' data."""
        body: dict[str, Any] = {"model": model, "max_tokens": 3, "stream": stream}
        body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with self.client.post(self.url(path), json=body) as resp:
            if stream and resp.status == 200:
                text = (await resp.read()).decode()
                return resp.status, [event.removeprefix("data: ") for event in text.split("\n\n") if event]
            return resp.status, await resp.json()

    async def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """The proxy's /metrics, parsed (see :func:`parse_metrics`)."""
        async with self.client.get(self.url("/metrics")) as resp:
            assert resp.status == 200 and resp.content_type == "text/plain"
            return parse_metrics(await resp.text())

    async def value(self, name: str, **labels: str) -> float:
        """The sum of the ``name`` samples whose labels include ``labels``."""
        return total(await self.metrics(), name, **labels)


@asynccontextmanager
async def fleet(prefills: int = 1, decodes: int = 1, loading: int = 0, **options: Any) -> AsyncIterator[Fleet]:
    """A running :class:`Fleet`, the proxy's first health checks done; the first ``loading``
    prefills fail theirs until told otherwise. ``options``: the proxy's (checks every 60 s unless given)."""
    fakes = [FakeVllm("prefill") for _ in range(prefills)], [FakeVllm("decode") for _ in range(decodes)]
    for fake in itertools.chain(*fakes):
        await fake.start()
    for fake in fakes[0][:loading]:
        fake.healthy = False
    options = {"health_interval": 60.0, **options}
    try:
        async with serve([f.url for f in fakes[0]], [f.url for f in fakes[1]], ProxyOptions(**options)) as port:
            client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
            try:
                running = Fleet(fakes[0], fakes[1], port, client)
                await until(lambda: _is(running.value("hixl_proxy_upstream_up"), prefills + decodes - loading), "the first checks")
                yield running
            finally:
                await client.close()
                for fake in itertools.chain(*fakes):
                    fake._stopping.set()  # let hung handlers end before the proxy waits for its own
    finally:
        for fake in itertools.chain(*fakes):
            await fake.stop()


SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus's text format -> {(sample name, labels): value}; every sample's family has HELP and TYPE."""
    helps: set[str] = set()
    types: dict[str, str] = {}
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helps.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge", "histogram"), line
            types[name] = kind
        else:
            match = SAMPLE.fullmatch(line)
            assert match, f"not a sample: {line!r}"
            name, labels, value = match.groups()
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
            assert family in types and family in helps, f"{name} has no TYPE and HELP"
            assert (types[family] == "counter") == name.endswith("_total"), f"counter names end in _total: {name}"
            pairs = LABEL.findall(labels or "")
            assert ",".join(f'{k}="{v}"' for k, v in pairs) == (labels or ""), f"bad labels: {line!r}"
            key = (name, frozenset(pairs))
            assert key not in samples, f"twice: {line!r}"
            samples[key] = float(value)
    return samples


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The sum of the ``name`` samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(value for (n, have), value in samples.items() if n == name and want <= have)


def text(events: list[str]) -> str:
    """The generated text of a stream's events (the ``[DONE]`` left out)."""
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]")


@async_test
async def test_routes_in_turn_and_counts_what_it_routed() -> None:
    async with fleet(prefills=2, decodes=2) as f:
        answers = [await f.ask(stream=s, chat=c) for s, c in [(False, False), (True, False), (False, True), (True, True)]]
        assert [status for status, _ in answers] == [200] * 4
        assert answers[0][1]["choices"][0]["text"] == "w1 w2 w3"
        assert text(answers[1][1]) == "w1w2w3" and answers[1][1][-1] == "[DONE]"
        # Equally idle upstreams take turns.
        assert [len(p.bodies) for p in f.prefills] == [2, 2] and [len(d.bodies) for d in f.decodes] == [2, 2]
        for p in f.prefills:
            assert all(b["max_tokens"] == 1 and b["stream"] is False for b in p.bodies)
            assert all(b["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False} for b in p.bodies)
        for d in f.decodes:  # each decode got the original request and one prefill's params
            assert all(b["max_tokens"] == 3 and b["kv_transfer_params"]["remote_engine"] in [p.url for p in f.prefills] for b in d.bodies)
        samples = await f.metrics()
        for up in [*f.prefills, *f.decodes]:
            labels = {"upstream": up.url, "role": up.role}
            assert total(samples, "hixl_proxy_requests_total", outcome="ok", **labels) == 2
            assert total(samples, "hixl_proxy_requests_total", **labels) == 2
            assert total(samples, "hixl_proxy_upstream_seconds_count", **labels) == 2
            assert total(samples, "hixl_proxy_upstream_seconds_bucket", le="+Inf", **labels) == 2
            assert total(samples, "hixl_proxy_upstream_seconds_sum", **labels) > 0
            buckets = sorted(
                (float(dict(key[1])["le"]), value)
                for key, value in samples.items()
                if key[0] == "hixl_proxy_upstream_seconds_bucket" and {("upstream", up.url), ("role", up.role)} <= key[1]
            )
            assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
            assert total(samples, "hixl_proxy_upstream_up", **labels) == 1
            assert total(samples, "hixl_proxy_upstream_outstanding", **labels) == 0
        assert total(samples, "hixl_proxy_retries_total") == 0 and total(samples, "hixl_proxy_unavailable_total") == 0
        async with f.client.get(f.url("/v1/models")) as resp:
            assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "fake"


@async_test
async def test_concurrent_requests_spread_over_the_least_busy() -> None:
    async with fleet(prefills=1, decodes=2) as f:
        for d in f.decodes:
            d.gate = asyncio.Event()
        requests = [asyncio.create_task(f.ask(stream=True)) for _ in range(4)]
        await until(lambda: sum(len(d.bodies) for d in f.decodes) == 4, "all four requests reach a decode")
        assert [len(d.bodies) for d in f.decodes] == [2, 2]
        for d in f.decodes:
            assert await f.value("hixl_proxy_upstream_outstanding", upstream=d.url) == 2
        # One decode freed, the other still busy: new requests go to the free one only.
        f.decodes[1].gate.set()  # type: ignore[union-attr]
        await until(lambda: sum(t.done() for t in requests) == 2, "decode 1's two requests end")
        assert [(await f.ask())[0] for _ in range(3)] == [200] * 3
        assert [len(d.bodies) for d in f.decodes] == [2, 5]
        f.decodes[0].gate.set()  # type: ignore[union-attr]
        assert [status for status, _ in await asyncio.gather(*requests)] == [200] * 4


@async_test
async def test_a_stopped_prefill_is_skipped_and_the_request_retried() -> None:
    async with fleet(prefills=2, decodes=1) as f:
        await f.prefills[0].stop()
        status, body = await f.ask()
        assert status == 200 and body["choices"][0]["text"] == "w1 w2 w3"
        assert await f.value("hixl_proxy_retries_total", role="prefill") == 1
        assert await f.value("hixl_proxy_requests_total", upstream=f.prefills[0].url, outcome="error") == 1
        assert await f.value("hixl_proxy_upstream_up", upstream=f.prefills[0].url) == 0  # at once, not at the next check
        assert (await f.ask())[0] == 200
        assert await f.value("hixl_proxy_retries_total") == 1  # the next request went straight to the live one
        assert len(f.prefills[1].bodies) == 2


@async_test
async def test_a_hanging_prefill_times_out_and_the_request_is_retried() -> None:
    async with fleet(prefills=2, decodes=1, timeout=0.5) as f:
        f.prefills[0].fault = "hang"
        started = time.monotonic()
        status, _ = await f.ask(stream=True)
        assert status == 200 and 0.5 <= time.monotonic() - started < 5
        assert await f.value("hixl_proxy_retries_total", role="prefill") == 1
        assert await f.value("hixl_proxy_upstream_seconds_sum", upstream=f.prefills[0].url) >= 0.5
        assert len(f.prefills[0].bodies) == 1 and len(f.prefills[1].bodies) == 1


@async_test
async def test_health_checks_mark_an_upstream_down_and_up_again() -> None:
    async with fleet(prefills=2, decodes=1, health_interval=0.05, health_timeout=1.0, down_after=2) as f:
        sick = f.prefills[0]
        sick.healthy = False
        await until(lambda: _is(f.value("hixl_proxy_upstream_up", upstream=sick.url), 0), "the sick prefill is marked down")
        assert [(await f.ask())[0] for _ in range(2)] == [200, 200]
        assert len(sick.bodies) == 0 and len(f.prefills[1].bodies) == 2
        async with f.client.get(f.url("/health")) as resp:
            assert resp.status == 200  # one prefill is enough
        sick.healthy = True
        await until(lambda: _is(f.value("hixl_proxy_upstream_up", upstream=sick.url), 1), "the prefill is up again")
        assert (await f.ask())[0] == 200 and len(sick.bodies) == 1


async def _is(value: Awaitable[float], want: float) -> bool:
    return await value == want


@async_test
async def test_the_proxy_is_ready_once_its_upstreams_are() -> None:
    async with fleet(prefills=1, decodes=1, loading=1, health_interval=0.05) as f:
        async with f.client.get(f.url("/health")) as resp:
            assert resp.status == 503 and (await resp.json())["error"]["message"] == "no prefill instance is up"
        assert (await f.ask())[0] == 503 and len(f.prefills[0].bodies) == 0  # instances start down
        f.prefills[0].healthy = True  # vLLM has loaded its model

        async def ready() -> bool:
            async with f.client.get(f.url("/health")) as resp:
                return resp.status == 200

        await until(ready, "the proxy's /health answers 200")
        assert (await f.ask())[0] == 200


@async_test
async def test_no_prefill_up_gives_a_503_at_once() -> None:
    async with fleet(prefills=2, decodes=1, health_interval=0.05, down_after=1) as f:
        for p in f.prefills:
            await p.stop()

        async def proxy_unhealthy() -> bool:
            async with f.client.get(f.url("/health")) as resp:
                return resp.status == 503 and "no prefill instance is up" in (await resp.json())["error"]["message"]

        await until(proxy_unhealthy, "the proxy's /health says no prefill is up")
        started = time.monotonic()
        status, body = await f.ask()
        assert status == 503 and time.monotonic() - started < 1
        assert body["error"]["code"] == 503 and "no prefill instance is up" in body["error"]["message"]
        assert await f.value("hixl_proxy_unavailable_total", role="prefill") == 1
        assert len(f.decodes[0].bodies) == 0


@async_test
async def test_retries_are_bounded_and_the_last_5xx_passed_on() -> None:
    async with fleet(prefills=3, decodes=1, retries=1) as f:
        for p in f.prefills:
            p.fault = "500"
        status, body = await f.ask()
        assert status == 500 and body["error"]["message"] == "injected"
        assert [len(p.bodies) for p in f.prefills] == [1, 1, 0]
        assert await f.value("hixl_proxy_retries_total", role="prefill") == 1


@async_test
async def test_a_decode_that_answers_500_stays_up_and_is_retried_through_a_fresh_prefill() -> None:
    """A decode's 500 may be its prefill's fault (one that died under the pull): the decode answered,
    so it is alive. With it the only decode, the retry goes to it again through a fresh prefill,
    and later requests are served — not refused with 503 until a health check."""
    async with fleet(prefills=2, decodes=1, health_interval=60.0) as f:
        decode = f.decodes[0]
        decode.fault = "500-once"
        status, body = await f.ask()
        assert status == 200 and body["choices"][0]["text"] == "w1 w2 w3"
        ids = [(b["kv_transfer_params"]["remote_engine"], b["kv_transfer_params"]["remote_transfer_id"]) for b in decode.bodies]
        assert len(ids) == 2 and ids[0] != ids[1]  # a fresh prefill's KV the second time
        assert await f.value("hixl_proxy_retries_total", role="decode") == 1
        assert await f.value("hixl_proxy_upstream_up", upstream=decode.url) == 1
        assert [(await f.ask())[0] for _ in range(2)] == [200, 200]
        assert await f.value("hixl_proxy_unavailable_total") in (None, 0)


@async_test
async def test_a_client_error_is_passed_through_and_not_retried() -> None:
    async with fleet(prefills=2, decodes=1) as f:
        status, body = await f.ask(model="missing")
        assert status == 404 and body["error"]["message"] == "no such model"
        assert await f.value("hixl_proxy_requests_total", role="prefill", outcome="client_error") == 1
        assert await f.value("hixl_proxy_retries_total") == 0 and len(f.decodes[0].bodies) == 0
        assert await f.value("hixl_proxy_upstream_up", role="prefill") == 2


@pytest.mark.parametrize("fault", ["500", "hang", "stopped"])
@async_test
async def test_a_decode_failing_before_any_byte_is_retried_through_a_fresh_prefill(fault: str) -> None:
    async with fleet(prefills=1, decodes=2, timeout=0.5) as f:
        if fault == "stopped":
            await f.decodes[0].stop()
        f.decodes[0].fault = fault
        status, events = await f.ask(stream=True)
        assert status == 200 and text(events) == "w1w2w3"
        # Prefill ran twice; each decode got its own transfer: the second never reuses the first's KV.
        assert len(f.prefills[0].bodies) == 2
        assert [b["kv_transfer_params"]["remote_transfer_id"] for b in f.decodes[1].bodies] == [2]
        assert [b["kv_transfer_params"]["remote_transfer_id"] for b in f.decodes[0].bodies] == ([] if fault == "stopped" else [1])
        assert await f.value("hixl_proxy_retries_total", role="decode") == 1
        assert await f.value("hixl_proxy_requests_total", upstream=f.decodes[0].url, outcome="error") == 1
        assert await f.value("hixl_proxy_requests_total", role="prefill", outcome="ok") == 2


@async_test
async def test_a_decode_dying_mid_stream_ends_the_clients_stream_with_an_error() -> None:
    async with fleet(prefills=1, decodes=2) as f:
        f.decodes[0].fault = "break"
        started = time.monotonic()
        status, events = await f.ask(stream=True)
        assert status == 200 and time.monotonic() - started < 5
        assert json.loads(events[0])["choices"][0]["text"] == "w1"
        error = json.loads(events[-1])["error"]
        assert error["code"] == 502 and "mid-stream" in error["message"]
        assert "[DONE]" not in events
        # No silent retry: the client already had part of an answer.
        assert len(f.decodes[1].bodies) == 0 and len(f.prefills[0].bodies) == 1
        assert await f.value("hixl_proxy_retries_total") == 0
        assert await f.value("hixl_proxy_requests_total", upstream=f.decodes[0].url, outcome="error") == 1
        assert await f.value("hixl_proxy_upstream_up", upstream=f.decodes[0].url) == 0


@async_test
async def test_a_client_leaving_mid_stream_frees_the_decode_without_blaming_it() -> None:
    async with fleet(prefills=1, decodes=1) as f:
        decode = f.decodes[0]
        decode.fault = "stall"
        body = {"model": "fake", "prompt": "hi", "stream": True}
        async with f.client.post(f.url("/v1/completions"), json=body) as resp:
            assert b'"w1"' in await resp.content.readuntil(b"\n\n")
        # Leaving the block closed the connection with the stream unfinished.
        await until(
            lambda: _is(f.value("hixl_proxy_requests_total", upstream=decode.url, outcome="cancelled"), 1),
            "the decode hop ends as cancelled",
        )
        assert await f.value("hixl_proxy_upstream_outstanding", upstream=decode.url) == 0
        assert await f.value("hixl_proxy_upstream_up", upstream=decode.url) == 1


@async_test
async def test_a_client_leaving_after_the_last_event_counts_as_served() -> None:
    """A client that closes its connection as soon as it has ``[DONE]`` (the OpenAI SDK does) has
    had the whole answer: the decode hop is ``ok``, not ``cancelled``, though the stream's
    terminating chunk can no longer be written to it."""
    async with fleet(prefills=1, decodes=1) as f:
        decode = f.decodes[0]
        decode.fault = "linger"
        body = {"model": "fake", "prompt": "hi", "stream": True}
        async with f.client.post(f.url("/v1/completions"), json=body) as resp:
            while b"[DONE]" not in await resp.content.readuntil(b"\n\n"):
                pass
            resp.close()  # (at once: not waiting for the stream's end)
        await until(lambda: _is(f.value("hixl_proxy_upstream_outstanding", upstream=decode.url), 0), "the decode hop ends")
        assert await f.value("hixl_proxy_requests_total", upstream=decode.url, outcome="ok") == 1


@dataclass
class Command:
    """A running ``hixl proxy`` command."""

    base: str  # its base URL
    proc: asyncio.subprocess.Process

    async def stop(self) -> str:
        """Stop it as a service manager would (SIGTERM); everything it printed."""
        if self.proc.returncode is None:
            self.proc.terminate()
        out, _ = await asyncio.wait_for(self.proc.communicate(), 20)
        return out.decode(errors="replace")


@asynccontextmanager
async def proxy_command(client: ClientSession, *args: str) -> AsyncIterator[Command]:
    """``hixl proxy *args`` on a free port, once its /health answers 200; stopped when the block ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hixl", "proxy", *args, "--port", str(port), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    command = Command(f"http://127.0.0.1:{port}", proc)
    try:

        async def healthy() -> bool:
            try:
                async with client.get(command.base + "/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientConnectionError:
                return False

        await until(healthy, "hixl proxy answers /health", timeout=20)
        yield command
    finally:
        await command.stop()


@async_test
async def test_the_hixl_proxy_command_routes_and_reports() -> None:
    async with fleet() as f:  # its fakes; the proxy under test is the command's
        args = ["--prefill", f.prefills[0].url, "--decode", f.decodes[0].url, "--health-interval", "0.1"]
        async with proxy_command(f.client, *args) as command:
            async with f.client.post(command.base + "/v1/completions", json={"model": "fake", "prompt": "hi"}) as resp:
                assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "w1 w2 w3"
            async with f.client.get(command.base + "/metrics") as resp:
                samples = parse_metrics(await resp.text())
            assert total(samples, "hixl_proxy_requests_total", outcome="ok") == 2  # its prefill and its decode


@async_test
async def test_a_requests_id_and_trace_context_go_to_both_hops_and_its_id_comes_back() -> None:
    """The client's ``X-Request-Id`` and W3C ``traceparent`` reach prefill and decode (tracing off: passed as
    they came) and the id comes back in the answer's headers, whole or streamed; a request without an id gets
    one (32 hex digits), the same at both hops and in the answer."""
    async with fleet() as f:
        prefill, decode = f.prefills[0], f.decodes[0]
        trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        for stream in (False, True):
            headers = {"X-Request-Id": f"client-{stream}", "traceparent": trace}
            body = {"model": "fake", "prompt": "hi", "max_tokens": 3, "stream": stream}
            async with f.client.post(f.url("/v1/completions"), json=body, headers=headers) as resp:
                assert resp.status == 200 and resp.headers["X-Request-Id"] == f"client-{stream}"
                await resp.read()
            assert prefill.followed[-1] == decode.followed[-1] == (f"client-{stream}", trace)
        async with f.client.post(f.url("/v1/completions"), json={"model": "fake", "prompt": "hi"}) as resp:
            made = resp.headers["X-Request-Id"]
            await resp.read()
        assert re.fullmatch(r"[0-9a-f]{32}", made) and prefill.followed[-1] == decode.followed[-1] == (made, None)


@async_test
async def test_upstream_credentials_go_to_their_upstream_and_nowhere_else() -> None:
    """An upstream URL's user-info is that upstream's HTTP Basic authentication: sent with every
    request to it, health checks included, in place of the client's own Authorization — and found
    in no /metrics label, no log line and no client's error body, which names the upstream by role,
    index and host:port."""
    async with fleet() as f:  # its fakes; the proxy under test is the command's
        user, password = "ops-user", "s3cr@t"
        basic = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        secret = f"http://{user}:{password.replace('@', '%40')}@"
        prefill, decode = f.prefills[0], f.decodes[0]
        for fake in (prefill, decode):
            fake.required = basic
        args = ["--prefill", prefill.url.replace("http://", secret), "--decode", decode.url.replace("http://", secret)]
        async with proxy_command(f.client, *args, "--health-interval", "0.1", "--retries", "0") as command:  # (healthy: checks authenticated)

            async def ask() -> tuple[int, str]:
                headers = {"Authorization": "Bearer the-clients-own"}
                async with f.client.post(command.base + "/v1/completions", json={"model": "fake", "prompt": "hi"}, headers=headers) as resp:
                    return resp.status, await resp.text()

            assert (await ask())[0] == 200
            assert prefill.authorizations[-1] == decode.authorizations[-1] == basic
            await decode.stop()
            status, failure = await ask()
            assert status == 502
            assert f"decode[0] {decode.url.removeprefix('http://')}: " in failure
            async with f.client.get(command.base + "/metrics") as resp:
                metrics = await resp.text()
            assert f'upstream="{decode.url}"' in metrics  # the URL less its credentials
            logs = await command.stop()
        assert f"decode {decode.url} is down" in logs  # the operator is told which, as in the metrics
        for said in (failure, metrics, logs):
            assert user not in said and "s3cr" not in said and basic.split()[1] not in said


def http_request(body: bytes, path: str = "/v1/completions") -> bytes:
    """A POST of the JSON ``body`` to ``path``, as raw bytes (HTTP/1.1: the connection is kept alive)."""
    return f"POST {path} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` and read its answer (one with a Content-Length): its status and body."""
    writer.write(request)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    assert length, head
    return int(head.split()[1]), await asyncio.wait_for(reader.readexactly(int(length.group(1))), 5)


@asynccontextmanager
async def sending_slowly(writer: asyncio.StreamWriter, data: bytes, interval: float = 0.2) -> AsyncIterator[asyncio.Task[int]]:
    """Send ``data`` a byte every ``interval`` s, until all went or the connection failed, in a task
    whose result is how many went; the connection is closed when the block ends."""

    async def send() -> int:
        for sent in range(len(data)):
            try:
                writer.write(data[sent : sent + 1])
                await writer.drain()
            except ConnectionError:
                return sent
            await asyncio.sleep(interval)
        return len(data)

    task = asyncio.create_task(send())
    try:
        yield task
    finally:
        task.cancel()
        writer.close()


async def dropped(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the proxy closes this connection within ``within`` seconds, having sent nothing on it."""
    try:
        return await asyncio.wait_for(reader.read(), within) == b""
    except ConnectionResetError:
        return True
    except asyncio.TimeoutError:
        return False


@async_test
async def test_a_client_too_slow_with_its_headers_is_dropped_while_others_are_served() -> None:
    """A slowloris (a byte of headers at a time) is dropped ``header_timeout`` after it connected,
    long before its headers are whole; other clients are served meanwhile; and a kept-alive
    connection idle for longer than that between two requests is not slow, so not dropped."""
    async with fleet(header_timeout=1.0) as f:
        kept = await asyncio.open_connection("127.0.0.1", f.port)
        assert (await exchange(*kept, b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n"))[0] == 200
        idle_since = started = time.monotonic()  # (before the slow client connects: its deadline starts after)
        reader, writer = await asyncio.open_connection("127.0.0.1", f.port)
        head = http_request(b"{}").removesuffix(b"{}")
        async with sending_slowly(writer, head) as trickle:
            assert (await f.ask())[0] == 200  # while it trickles
            assert await dropped(reader, within=5), "the slow client is still connected"
            assert 1.0 <= time.monotonic() - started < 3
            assert await trickle < len(head)
        await asyncio.sleep(idle_since + 1.5 - time.monotonic())  # idle half as long again as a slow client may be
        assert (await exchange(*kept, http_request(b'{"model": "fake", "prompt": "hi"}')))[0] == 200
        assert len(f.prefills[0].bodies) == 2  # f.ask's and the kept-alive connection's
        kept[1].close()


@async_test
async def test_a_client_too_slow_with_its_body_is_dropped_while_others_are_served() -> None:
    async with fleet(body_timeout=1.0) as f:
        body = json.dumps({"model": "fake", "prompt": "a prompt that takes its time to arrive"}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", f.port)
        writer.write(http_request(body).removesuffix(body))  # the headers, whole
        started = time.monotonic()
        async with sending_slowly(writer, body) as trickle:
            assert (await f.ask())[0] == 200  # while it trickles
            assert await dropped(reader, within=5), "the slow client is still connected"
            assert 1.0 <= time.monotonic() - started < 3
            assert await trickle < len(body)
        assert len(f.prefills[0].bodies) == 1  # f.ask's alone


@async_test
async def test_a_client_that_stops_reading_is_dropped_and_its_decode_request_cancelled() -> None:
    """A client that asks for a stream and never reads holds decode's request (and its KV blocks)
    only until the proxy has had data for it ``write_timeout`` long with none taken: then the proxy
    drops it and closes decode's request — as when a client leaves: vLLM aborts it, the KV is
    released — counted as cancelled, with the decode not blamed."""
    async with fleet(write_timeout=0.5) as f:
        decode = f.decodes[0]
        decode.fault = "flood"
        loop = asyncio.get_running_loop()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (full the sooner)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", f.port))
            await loop.sock_sendall(sock, http_request(b'{"model": "fake", "prompt": "hi", "stream": true}'))
            await until(lambda: decode.disconnects == 1, "decode's request is cancelled", timeout=10)
            assert await f.value("hixl_proxy_requests_total", upstream=decode.url, outcome="cancelled") == 1
            assert await f.value("hixl_proxy_upstream_outstanding", upstream=decode.url) == 0
            assert await f.value("hixl_proxy_upstream_up", upstream=decode.url) == 1
            # The client was dropped: what was on its way still arrives, then the connection ends.
            deadline, received = time.monotonic() + 10, b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), max(0.0, deadline - time.monotonic())):
                    received = received[-16:] + chunk
            assert b"[DONE]" not in received


@pytest.mark.parametrize(
    ("payload", "refusal", "path"),
    [
        pytest.param(b"[" * 100_000 + b"]" * 100_000, "deeper than", "/v1/completions", id="arrays-nested-past-the-parser"),
        pytest.param(
            b'{"prompt": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", "deeper than", "/v1/completions", id="arrays-nested-past-the-limit"
        ),
        pytest.param(b'["hi"]', "must be a JSON object, not an array", "/v1/completions", id="an-array"),
        pytest.param(b'"hi"', "must be a JSON object, not a string", "/v1/completions", id="a-string"),
        pytest.param(b"null", "must be a JSON object, not null", "/v1/completions", id="null"),
        pytest.param(b'{"prompt": "hi"', "is not JSON", "/v1/completions", id="cut-short"),
        pytest.param(b'{"prompt": "hi \xff\xfe"}', "is not UTF-8", "/v1/completions", id="invalid-utf-8"),
        pytest.param(b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", "an integer with more digits", "/v1/completions", id="a-huge-integer"),
        pytest.param(b'{"prompt": "hi", "temperature": 1e999}', "beyond a double's range", "/v1/completions", id="a-huge-number"),
        pytest.param(b'{"prompt": "hi", "temperature": NaN}', "NaN, which is not JSON", "/v1/completions", id="nan"),
        pytest.param(b'{"prompt": "hi", "stream": "yes"}', '"stream" must be a boolean, not a string', "/v1/completions", id="stream"),
        pytest.param(b'{"prompt": "hi", "max_tokens": "3"}', '"max_tokens" must be an integer, not a string', "/v1/completions", id="max-tokens"),
        pytest.param(b'{"prompt": "hi", "max_tokens": true}', '"max_tokens" must be an integer, not a boolean', "/v1/completions", id="max-tokens-bool"),
        pytest.param(b'{"model": 7, "prompt": "hi"}', '"model" must be a string, not an integer', "/v1/completions", id="model"),
        pytest.param(b'{"prompt": {"text": "hi"}}', '"prompt" must be a string or an array, not an object', "/v1/completions", id="prompt"),
        pytest.param(b'{"messages": "hi"}', '"messages" must be an array, not a string', "/v1/chat/completions", id="messages"),
    ],
)
@async_test
async def test_a_malformed_body_is_a_400_that_says_why(payload: bytes, refusal: str, path: str) -> None:
    async with fleet() as f:
        async with f.client.post(f.url(path), data=payload, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400, await resp.text()
            error = (await resp.json())["error"]
        assert error["code"] == 400 and refusal in error["message"], error
        assert len(f.prefills[0].bodies) == 0  # refused at the door
        assert (await f.ask())[0] == 200
