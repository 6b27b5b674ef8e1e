"""``hixl proxy`` in front of a fleet of fake vLLM instances that fail to order.

Each fake (:class:`FakeVllm`) is a real aiohttp server on 127.0.0.1 speaking
just enough of vLLM's OpenAI API: prefill answers with ``kv_transfer_params``
naming a fresh transfer id, decode answers whole or as an SSE stream,
``GET /health`` says whether it is healthy. It can be told to answer 500,
hang, drop the connection mid-stream, hold requests until released, or be
stopped. The proxy runs in the same event loop (aiohttp's test server), and
once as the real ``hixl proxy`` command. Nothing sleeps a fixed time: waits
poll a condition until a deadline.
"""

from __future__ import annotations

import asyncio
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

from hixl.proxy.app import create_app  # noqa: E402
from hixl.proxy.options import ProxyOptions  # noqa: E402

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
    stopped), ``"linger"`` (decode: the whole stream, then 0.3 s before it ends). ``gate``: when
    an Event, completions wait for it.
    ``bodies``: the completion request bodies received, in order.
    """

    def __init__(self, role: str) -> None:
        self.role = role
        self.fault: str | None = None
        self.healthy = True
        self.gate: asyncio.Event | None = None
        self.bodies: list[dict[str, Any]] = []
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
        return web.json_response({}, status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
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
            params = {"remote_engine": self.url, "remote_transfer_id": next(self._transfer_ids)}
            return web.json_response({"choices": [{"text": "w0"}], "kv_transfer_params": params})
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": " ".join(WORDS)}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
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
    proxy: TestServer
    client: ClientSession

    def url(self, path: str) -> str:
        """The proxy's URL for ``path``."""
        return str(self.proxy.make_url(path))

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
    app = create_app([f.url for f in fakes[0]], [f.url for f in fakes[1]], ProxyOptions(**options))
    proxy = TestServer(app, host="127.0.0.1")
    await proxy.start_server()
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:
        running = Fleet(fakes[0], fakes[1], proxy, client)
        await until(lambda: _is(running.value("hixl_proxy_upstream_up"), prefills + decodes - loading), "the first checks")
        yield running
    finally:
        await client.close()
        for fake in itertools.chain(*fakes):
            fake._stopping.set()  # let hung handlers end before the proxy waits for its own
        await proxy.close()
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


@async_test
async def test_the_hixl_proxy_command_routes_and_reports() -> None:
    async with fleet() as f:  # its fakes; the proxy under test is the command's
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = ["--prefill", f.prefills[0].url, "--decode", f.decodes[0].url, "--port", str(port), "--health-interval", "0.1"]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hixl", "proxy", *args, cwd=ROOT,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        try:

            async def healthy() -> bool:
                try:
                    async with f.client.get(base + "/health") as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            await until(healthy, "hixl proxy answers /health", timeout=20)
            async with f.client.post(base + "/v1/completions", json={"model": "fake", "prompt": "hi"}) as resp:
                assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "w1 w2 w3"
            async with f.client.get(base + "/metrics") as resp:
                samples = parse_metrics(await resp.text())
            assert total(samples, "hixl_proxy_requests_total", outcome="ok") == 2  # its prefill and its decode
        finally:
            proc.terminate()
            await proc.wait()
