"""The proxy follows vLLM's own KV-event publisher: vLLM's ``ZmqEventPublisher`` and its event classes, in this process.

What ``hixl.proxy.kv_events`` decodes without vLLM is checked here against
what vLLM encodes; the publisher's replay socket answers the proxy's probes and
replays, and a publisher started again on the same endpoints (a restarted
instance) has the proxy drop the index it had.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

# Not just "vllm": where vLLM is missing, this folder itself would import under that name.
kv_events = pytest.importorskip("vllm.distributed.kv_events")
import msgspec  # noqa: E402
import zmq.asyncio  # noqa: E402

from hixl.proxy.event_feed import EventFeed  # noqa: E402
from hixl.proxy.kv_events import Removed, Stored, decode_batch  # noqa: E402

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(1, 9))  # two blocks of 4


def test_vllms_batches_decode_as_the_proxy_reads_them() -> None:
    stored = kv_events.BlockStored(
        block_hashes=[b"h1", b"h2"], parent_block_hash=None, token_ids=PROMPT, block_size=4, lora_id=None, medium="GPU",
        lora_name=None, group_idx=0,
    )  # fmt: skip
    salted = kv_events.BlockStored(
        block_hashes=[3], parent_block_hash=2, token_ids=PROMPT[:4], block_size=4, lora_id=None, medium="GPU",
        lora_name=None, extra_keys=[("salt",)],
    )  # fmt: skip
    gone = kv_events.BlockRemoved(block_hashes=[b"h2"], medium="GPU")
    batch = kv_events.KVEventBatch(ts=time.time(), events=[stored, salted, gone, kv_events.AllBlocksCleared()], data_parallel_rank=0)
    events = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert events[:3] == [
        Stored((b"h1", b"h2"), None, tuple(PROMPT), 4, True), Stored((3,), 2, tuple(PROMPT[:4]), 4, False), Removed((b"h2",), True),
    ]  # fmt: skip
    assert type(events[3]).__name__ == "AllCleared"


def _publisher(folder: Path) -> kv_events.ZmqEventPublisher:
    return kv_events.ZmqEventPublisher(0, endpoint=f"ipc://{folder}/pub", replay_endpoint=f"ipc://{folder}/replay")


def _stored(tokens: list[int], hashes: list[bytes]) -> kv_events.KVEventBatch:
    event = kv_events.BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=4, lora_id=None, medium="GPU", lora_name=None
    )
    return kv_events.KVEventBatch(ts=time.time(), events=[event])


async def _until(condition, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.05)


def test_the_feed_follows_vllms_publisher_and_drops_its_index_when_it_restarts(tmp_path: Path) -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        publisher = _publisher(tmp_path)
        feed = EventFeed("vllm", f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", timeout=1.5)
        task = asyncio.create_task(feed.run(context))
        try:
            await _until(feed.live, "the feed live (a full replay of nothing)")
            publisher.publish(_stored(PROMPT, [b"a", b"b"]))
            await _until(lambda: feed.log.index.cached_tokens(PROMPT) == 8, "vLLM's batch indexed")
            await asyncio.sleep(2.0)  # idle for longer than the timeout: vLLM's replay socket answers the probes
            assert feed.live() and feed.log.resyncs == 0
            publisher.shutdown()
            await _until(lambda: not feed.live(), "the stopped publisher noticed")
            publisher = _publisher(tmp_path)  # the instance restarted: same endpoints, another history
            await _until(lambda: feed.log.resyncs == 1 and feed.live(), "the index dropped and followed again")
            assert feed.log.index.cached_tokens(PROMPT) == 0
            publisher.publish(_stored(PROMPT[:4], [b"c"]))
            await _until(lambda: feed.log.index.cached_tokens(PROMPT) == 4, "the restarted publisher's batch indexed")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            publisher.shutdown()
            context.term()

    asyncio.run(main())
