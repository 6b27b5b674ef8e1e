"""``hixl proxy --kv-mode push`` in front of fake vLLM instances (:class:`~test_proxy.FakeVllm`).

The proxy learns where a prefill's KV lives from its answers (pull mode's
first), then sends each request to prefill and decode at once with one push
id; a prefill that fails closes decode's request, and the retry pulls.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("aiohttp")

from hixl.proxy.options import ProxyOptions  # noqa: E402
from hixl.proxy.push import PULL_PREFILL_PARAMS  # noqa: E402

from .test_proxy import FakeVllm, async_test, fleet, until  # noqa: E402

pytestmark = pytest.mark.timeout(30)

SOURCE = {"remote_ranks": [{"engine": "127.0.0.1:7000", "cluster_id": 5, "heads": [0, 2]}], "remote_kv": {"model": "fake"}}


def params(fake: FakeVllm, i: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` of the ``i``-th completion ``fake`` received."""
    return fake.bodies[i]["kv_transfer_params"]  # type: ignore[no-any-return]


@async_test
async def test_an_unknown_prefill_gets_a_pull_then_each_request_goes_to_both_at_once_with_one_push_id() -> None:
    async with fleet(kv_mode="push") as f:
        (prefill,), (decode,) = f.prefills, f.decodes
        prefill.extra_params = SOURCE
        status, _ = await f.ask()
        assert status == 200
        # Nothing known of the prefill: a pull, whose answer decode gets as in pull mode.
        assert params(prefill, 0) == PULL_PREFILL_PARAMS and "push_id" not in params(decode, 0)
        assert params(decode, 0)["remote_transfer_id"] == 1
        # Known now: decode is sent the request while prefill is still answering (held by its gate).
        prefill.gate = asyncio.Event()
        asked = asyncio.create_task(f.ask(stream=True))
        await until(lambda: len(prefill.bodies) == 2 and len(decode.bodies) == 2, "both get the request before prefill answers")
        push_id = params(prefill, 1)["push_id"]
        assert params(prefill, 1) == {**PULL_PREFILL_PARAMS, "push_id": push_id} and 0 < push_id < 2**63
        assert prefill.bodies[1]["max_tokens"] == 1 and decode.bodies[1]["max_tokens"] == 3
        assert params(decode, 1) == {"do_remote_prefill": True, "push_id": push_id, **SOURCE}
        prefill.gate.set()
        status, events = await asked
        assert status == 200 and events[-1] == "[DONE]"
        await f.ask()
        assert params(prefill, 2)["push_id"] == params(decode, 2)["push_id"] != push_id  # a fresh id each request
        assert await f.value("hixl_proxy_requests_total", outcome="ok") == 6 and await f.value("hixl_proxy_retries_total") == 0


@async_test
async def test_a_failing_prefill_closes_decodes_request_is_forgotten_and_the_retry_pulls() -> None:
    async with fleet(kv_mode="push") as f:
        (prefill,), (decode,) = f.prefills, f.decodes
        prefill.extra_params = SOURCE
        assert (await f.ask())[0] == 200  # learned
        prefill.fault, decode.gate = "500-once", asyncio.Event()  # decode waits for a push that will not come
        asked = asyncio.create_task(f.ask())
        await until(lambda: decode.disconnects == 1, "decode's request is closed once prefill failed")
        decode.gate.set()
        status, answer = await asked
        assert status == 200 and answer["choices"][0]["text"] == "w1 w2 w3"
        # The retry (a fresh attempt, from prefill) pulled: the failed prefill is known no more.
        assert "push_id" in params(prefill, 1) and params(prefill, 2) == PULL_PREFILL_PARAMS
        assert "push_id" not in params(decode, 2) and len(decode.bodies) == 3
        assert await f.value("hixl_proxy_retries_total") == 1
        assert await f.value("hixl_proxy_requests_total", role="decode", outcome="cancelled") == 1
        # And it learned again from that answer: the next one pushes.
        await f.ask()
        assert "push_id" in params(prefill, 3)


@async_test
async def test_a_prefills_client_error_is_passed_through_and_decodes_request_closed() -> None:
    async with fleet(kv_mode="push") as f:
        (prefill,), (decode,) = f.prefills, f.decodes
        prefill.extra_params = SOURCE
        assert (await f.ask())[0] == 200
        decode.gate = asyncio.Event()
        status, _ = await f.ask(model="missing")  # prefill's 404 (decode would answer the same, once it could)
        assert status == 404
        await until(lambda: decode.disconnects == 1, "decode's request is closed")
        assert await f.value("hixl_proxy_retries_total") == 0


@async_test
async def test_a_traced_push_sends_each_upstream_its_own_hops_trace_context() -> None:
    """With tracing on, a push attempt's two hops are siblings under the request's span, and each upstream
    gets its own hop's ``traceparent`` (prefill's connector hangs its push spans there, decode's its load's):
    both tasks once carried decode's, so prefill's spans sat under the decode hop."""
    otlp = pytest.importorskip("hixl.testing.otlp")
    with otlp.Receiver() as receiver, pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        async with fleet(kv_mode="push", otlp_traces_endpoint=receiver.url) as f:
            (prefill,), (decode,) = f.prefills, f.decodes
            prefill.extra_params = SOURCE
            assert (await f.ask())[0] == 200  # learned
            headers = {"X-Request-Id": "traced-push"}
            async with f.client.post(f.url("/v1/completions"), json={"model": "fake", "prompt": "hi"}, headers=headers) as resp:
                assert resp.status == 200
            assert "push_id" in params(prefill, 1) and "push_id" in params(decode, 1)
        (_, to_prefill), (_, to_decode) = prefill.followed[-1], decode.followed[-1]
        assert to_prefill and to_decode and to_prefill.split("-")[1] == to_decode.split("-")[1]  # one trace

        def hops(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
            request = [s for s in spans if s["attributes"].get("hixl.client_request_id") == "traced-push"]
            found = {s["name"]: s for s in spans if request and s["parent"] == request[0]["id"]}
            return found if {"hixl.proxy.prefill", "hixl.proxy.decode"} <= set(found) else None

        found = receiver.wait_for("the push attempt's hops, both under its request", hops)
        assert to_prefill.split("-")[2] == found["hixl.proxy.prefill"]["id"]
        assert to_decode.split("-")[2] == found["hixl.proxy.decode"]["id"]


def test_kv_mode_is_checked() -> None:
    assert ProxyOptions(kv_mode="push").kv_mode == "push"
    with pytest.raises(ValueError, match="kv_mode"):
        ProxyOptions(kv_mode="shove")
