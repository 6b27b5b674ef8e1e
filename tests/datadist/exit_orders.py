"""Run by ``test_waits.py`` in a fresh interpreter: DataDist calls in awkward orders, then exit.

Each scenario prints its name once it is over. The test checks that all of
them ran, that the exit code is 0, and that nothing reached stderr — no
``Exception in thread``, no traceback, not even at interpreter exit, which
comes with a pull still in flight and nothing finalized.

Usage: ``python exit_orders.py TRANSPORT``
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

import hixl
from hixl.datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    TransferConfig,
)
from hixl.testing.datadist_peer import DataDistProcess

PREFILL, DECODE = 1, 2
DESC = CacheDesc(8, (16, 8, 2, 16), DataType.DT_FLOAT16)
BLOCKS = list(range(16))


class _Slowly:
    """A layer synchronizer: each layer is "computed" a little after it is asked for."""

    def synchronize_layer(self, layer_index: int, timeout: float | None) -> bool:
        time.sleep(0.05)
        return True


def _decode(transport: str, prefill: DataDistProcess) -> LLMDataDist:
    dd = LLMDataDist(LLMRole.DECODER, DECODE)
    dd.init(LLMConfig(transport=transport))
    dd.link_clusters([prefill.cluster_info()])
    return dd


def _pull(dd: LLMDataDist, req_id: int):  # type: ignore[no-untyped-def]
    cache = dd.cache_manager.register_blocks_cache(DESC, list(hixl.empty((DESC.num_tensors, *DESC.shape), "float16")))
    return dd.cache_manager.pull_blocks_async(BlocksCacheKey(PREFILL), cache, BLOCKS, BLOCKS, req_id=req_id)


def finalize_right_after_an_async_pull(transport: str, prefill: DataDistProcess) -> None:
    dd = _decode(transport, prefill)
    _pull(dd, 1)
    dd.finalize()


def synchronize_after_finalize(transport: str, prefill: DataDistProcess) -> None:
    dd = _decode(transport, prefill)
    task = _pull(dd, 2)
    dd.finalize()
    try:
        task.synchronize()
    except LLMException:
        pass  # the pull, or its notification, failed with the engine: reported, not printed


def await_after_finalize(transport: str, prefill: DataDistProcess) -> None:
    dd = _decode(transport, prefill)
    task = _pull(dd, 3)
    dd.finalize()

    async def main() -> None:
        try:
            await task
        except LLMException:
            pass

    asyncio.run(main())


def finalize_during_a_layer_by_layer_push(transport: str, prefill: DataDistProcess) -> None:
    prefill.datadist("switch_role", LLMRole.DECODER)  # the target of the push
    try:
        dd = _decode(transport, prefill)
        cache = dd.cache_manager.register_blocks_cache(DESC, list(hixl.empty((DESC.num_tensors, *DESC.shape), "float16")))
        config = TransferConfig(PREFILL, BlocksCacheKey(PREFILL))
        dd.cache_manager.transfer_cache_async(cache, _Slowly(), [config], BLOCKS, BLOCKS, req_id=4)
        time.sleep(0.06)  # the push thread is between layers
        dd.finalize()
        time.sleep(0.3)  # it wakes to a finalized engine
    finally:
        prefill.datadist("switch_role", LLMRole.PROMPT)


SCENARIOS: list[Callable[[str, DataDistProcess], None]] = [
    finalize_right_after_an_async_pull,
    synchronize_after_finalize,
    await_after_finalize,
    finalize_during_a_layer_by_layer_push,
]


def main(transport: str) -> None:
    config = LLMConfig(listen_ip_info="127.0.0.1:0", transport=transport)
    with DataDistProcess(LLMRole.PROMPT, PREFILL, config) as prefill:
        prefill.register_blocks_cache("kv", DESC, BlocksCacheKey(PREFILL), seed=1)
        for scenario in SCENARIOS:
            scenario(transport, prefill)
            print(scenario.__name__, flush=True)
        # Last: leave with a pull in flight, nothing finalized, nothing synchronized.
        _pull(_decode(transport, prefill), 5)
        print("exit_with_a_pull_in_flight", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
