"""``hixl proxy`` routing by cached prefix: fake vLLM servers, and their KV events from publishers on real ZMQ sockets.

Each prefill's events come from a :class:`Publisher` (vLLM's PUB and replay
sockets, on 127.0.0.1) that the test feeds; the proxy follows them and routes. The
fakes answer ``/tokenize`` as the tiny test Llama's tokenizer would: ``w<N>`` is
token N. Faults: a publisher that stops (answers no replay), one that restarts
(new sockets on the same ports, its numbers from 0 again), a batch lost on the
way (a gap in the numbers).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import aiohttp  # noqa: E402
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402
from aiohttp import web  # noqa: E402

from hixl.proxy import cli  # noqa: E402
from hixl.proxy.options import EventsSource, ProxyOptions  # noqa: E402
from hixl.proxy.server import serve  # noqa: E402

from .kv_publisher import Publisher, batch, removed, stored  # noqa: E402
from .test_proxy import FakeVllm, async_test, parse_metrics, total, until  # noqa: E402

PROMPT = list(range(100, 112))  # three blocks of kv_publisher.BLOCK
TIMEOUT = 1.0  # --events-timeout: short, so that stopped events show within a second


class TokenizingVllm(FakeVllm):
    """A fake vLLM that also answers ``/tokenize`` (``w<N>`` -> N), counting what it was asked."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.tokenized: list[dict[str, Any]] = []
        self.server.app.router.add_post("/tokenize", self._tokenize)

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.tokenized.append(body)
        text = body["prompt"] if "prompt" in body else " ".join(m["content"] for m in body["messages"])
        return web.json_response({"tokens": [int(word[1:]) for word in text.split()], "count": 0, "max_model_len": 512})


@dataclass
class Routed:
    """Two fake prefills whose events the proxy follows, one fake decode, the proxy, a client."""

    prefills: list[TokenizingVllm]
    publishers: list[Publisher]
    port: int
    client: aiohttp.ClientSession

    async def ask(self, prompt: Any, chat: bool = False) -> int:
        """One request through the proxy (``prompt``: token ids or text), alone; which prefill served it."""
        seen = [len(p.bodies) for p in self.prefills]
        await self.send(prompt, chat)
        served = [i for i, p in enumerate(self.prefills) if len(p.bodies) > seen[i]]
        assert len(served) == 1
        return served[0]

    async def send(self, prompt: Any, chat: bool = False) -> None:
        """One request through the proxy, which must answer 200."""
        body: dict[str, Any] = {"model": "fake", "max_tokens": 2}
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with self.client.post(f"http://127.0.0.1:{self.port}{path}", json=body) as resp:
            assert resp.status == 200, await resp.text()

    async def value(self, name: str, **labels: str) -> float:
        """The proxy's ``/metrics`` sample ``name`` (summed over the label sets with ``labels``)."""
        async with self.client.get(f"http://127.0.0.1:{self.port}/metrics") as resp:
            return total(parse_metrics(await resp.text()), name, **labels)

    async def live(self, index: int) -> bool:
        return await self.value("hixl_proxy_kv_events_live", upstream=self.prefills[index].url) == 1

    async def blocks(self, index: int) -> float:
        return await self.value("hixl_proxy_prefix_blocks", upstream=self.prefills[index].url)

    async def restart(self, index: int) -> Publisher:
        """Publisher ``index`` restarts: closed, then bound again on the same endpoints, its numbers from 0."""
        old = self.publishers[index]
        old.close()
        for _ in range(50):  # (the closed sockets' ports are released by ZMQ's I/O thread, soon)
            try:
                new = Publisher(old.context, old.endpoint, old.replay)
                break
            except zmq.ZMQError:
                await asyncio.sleep(0.05)
        self.publishers[index] = new
        new.task = asyncio.create_task(new.run())
        return new


@asynccontextmanager
async def routed(**options: Any) -> AsyncIterator[Routed]:
    """A running :class:`Routed`, every instance up and both prefills' events live. ``options``: the proxy's."""
    context = zmq.asyncio.Context()
    publishers = [Publisher(context) for _ in range(2)]
    for pub in publishers:
        pub.task = asyncio.create_task(pub.run())
    prefills, decode = [TokenizingVllm("prefill") for _ in range(2)], TokenizingVllm("decode")
    for fake in (*prefills, decode):
        await fake.start()
    sources = [EventsSource(f.url, p.endpoint, p.replay) for f, p in zip(prefills, publishers)]
    options = {"health_interval": 60.0, "events_timeout": TIMEOUT, "kv_events": sources, **options}
    try:
        async with (
            serve([f.url for f in prefills], [decode.url], ProxyOptions(**options)) as port,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client,
        ):
            running = Routed(prefills, publishers, port, client)
            await until(lambda: _all_live(running), "every instance up, both prefills' events live")
            yield running
    finally:
        for fake in (*prefills, decode):
            await fake.stop()
        for pub in publishers:
            pub.task.cancel()
            pub.close()
        context.term()


async def _all_live(routed: Routed) -> bool:
    return await routed.value("hixl_proxy_upstream_up") == 3 and await routed.value("hixl_proxy_kv_events_live") == 2


async def holding(routed: Routed, index: int) -> bool:
    """Whether prefill ``index`` holds :data:`PROMPT`'s three blocks in the proxy's index."""
    return await routed.blocks(index) == 3


@async_test
async def test_a_shared_prefix_goes_to_the_instance_that_holds_it() -> None:
    async with routed() as r:
        await r.publishers[1].publish(batch(stored(PROMPT)[0]))
        await until(lambda: holding(r, 1), "prefill 1's blocks indexed")
        assert [await r.ask(PROMPT + [7]) for _ in range(3)] == [1, 1, 1]  # token ids: used as they are
        words = " ".join(f"w{t}" for t in PROMPT + [7, 8])
        assert await r.ask(words) == 1 and await r.ask(words, chat=True) == 1  # text, chat: tokenized by a prefill
        assert sum(len(p.tokenized) for p in r.prefills) == 2
        assert [await r.ask([1, 2, 3, 4, 5]) for _ in range(2)] != [1, 1]  # nothing cached anywhere: in turn
        assert await r.value("hixl_proxy_routed_total", role="prefill", rule="prefix") == 7
        assert await r.value("hixl_proxy_routed_total", role="decode", rule="load") == 7  # the decode's events: not followed


@async_test
async def test_the_load_weighs_against_the_cached_prefix() -> None:
    async with routed(prefix_load_weight=5) as r:  # PROMPT + 1 token: 1 token to compute on prefill 1, 13 on prefill 0
        await r.publishers[1].publish(batch(stored(PROMPT)[0]))
        await until(lambda: holding(r, 1), "prefill 1's blocks indexed")
        r.prefills[1].gate = asyncio.Event()
        held = []
        for n in range(3):  # 1 + 5 * outstanding < 13 while fewer than 3 are: each goes to prefill 1
            held.append(asyncio.create_task(r.send(PROMPT + [7])))
            await until(lambda n=n: len(r.prefills[1].bodies) == n + 1, f"{n + 1} requests held by prefill 1")
        assert await r.ask(PROMPT + [7]) == 0  # 1 + 5 * 3 = 16 > 13: the idle one
        r.prefills[1].gate.set()
        await asyncio.gather(*held)
        assert [len(p.bodies) for p in r.prefills] == [1, 3]


@async_test
async def test_an_idle_instance_stays_live_and_a_stopped_ones_role_is_routed_by_load() -> None:
    async with routed() as r:
        await r.publishers[1].publish(batch(stored(PROMPT)[0]))
        await until(lambda: holding(r, 1), "prefill 1's blocks indexed")
        await asyncio.sleep(3 * TIMEOUT)  # no events meanwhile: the probes' answers keep it live
        assert await r.live(0) and await r.live(1)
        r.publishers[1].silent = True  # its events stop, while it still serves
        await until(lambda: _not(r.live(1)), "prefill 1's events stopped", timeout=3 * TIMEOUT)
        assert sorted([await r.ask(PROMPT + [7]) for _ in range(2)]) == [0, 1]  # least loaded, in turn
        assert await r.value("hixl_proxy_routed_total", role="prefill", rule="load") == 2
        r.publishers[1].silent = False
        await until(lambda: r.live(1), "prefill 1's events back")
        assert await r.blocks(1) == 3 and await r.value("hixl_proxy_kv_events_resyncs_total") == 0  # the same history
        assert await r.ask(PROMPT + [7]) == 1


async def _not(value: Any) -> bool:
    return not await value


@pytest.mark.parametrize("after", ["publishing", "idle"])
@async_test
async def test_a_restarted_instances_index_is_dropped(after: str) -> None:
    async with routed() as r:
        await r.publishers[1].publish(batch(stored(PROMPT)[0]))
        await r.publishers[1].publish(batch(removed([b"?"])))
        await until(lambda: holding(r, 1), "prefill 1's blocks indexed")
        new = await r.restart(1)
        if after == "publishing":  # its sequence starts again from 0: it goes back
            await new.publish(batch(stored([9, 9, 9, 9])[0]))
        resynced = lambda: r.value("hixl_proxy_kv_events_resyncs_total", upstream=r.prefills[1].url)  # noqa: E731
        await until(lambda: _is(resynced(), 1), "prefill 1's index dropped", timeout=3 * TIMEOUT)
        await until(lambda: r.live(1), "prefill 1's events followed again")
        assert await r.blocks(1) == (1 if after == "publishing" else 0)  # what the new instance published, only
        assert sorted([await r.ask(PROMPT + [7]) for _ in range(2)]) == [0, 1]  # nobody holds it now: in turn


async def _is(value: Any, want: float) -> bool:
    return await value == want


@async_test
async def test_a_lost_batch_is_replayed_not_guessed() -> None:
    async with routed() as r:
        first, parent = stored(PROMPT[:4])
        await r.publishers[1].publish(batch(first), skip=True)  # never reaches the proxy's SUB socket
        await r.publishers[1].publish(batch(stored(PROMPT[4:], parent)[0]))
        await until(lambda: holding(r, 1), "the lost batch replayed")
        assert await r.value("hixl_proxy_kv_events_resyncs_total") == 0
        assert await r.ask(PROMPT + [7]) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-events", "http://127.0.0.1:9=tcp://127.0.0.1:1,tcp://127.0.0.1:2"], "names no --prefill or --decode instance: http://127.0.0.1:9"),
        (["--kv-events", "http://127.0.0.1:8=tcp://127.0.0.1:1"], "expected URL=ENDPOINT,REPLAY"),
        (["--events-timeout", "0"], "events_timeout must be > 0"),
    ],
)
def test_the_command_refuses_events_it_cannot_follow(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    try:
        args = parser.parse_args(["proxy", "--prefill", "http://127.0.0.1:8", "--decode", "http://127.0.0.1:7", *argv])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        assert args.run(args) == 2
    out = capsys.readouterr()
    assert message in out.out + out.err

