"""Waiting for DataDist tasks: until the completion notification went out, and from asyncio.

The source is a real DataDist child process (see conftest.py); asyncio tests
run one event loop in the test process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hixl.datadist import (
    CacheDesc,
    DataType,
    LLMException,
    LLMStatusCode,
    TransferConfig,
    TransferDone,
)

from .helpers import BIG, LOCAL_ID, REMOTE_ID, assert_numbered, new_blocks_key, numbered_big_caches

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
LAYERS, BLOCKS = 4, 16
DESC = CacheDesc(2 * LAYERS, (BLOCKS, 8, 2, 16), DataType.DT_FLOAT16)


def _small_caches(remote, make_remote, make_local, seed):  # type: ignore[no-untyped-def]
    """DESC on both sides under a fresh key (the remote's seeded), and the remote's completions drained."""
    key = new_blocks_key()
    make_remote(DESC, key, seed=seed)
    remote.completed_requests()
    return key, make_local(DESC)


class _Computed:
    """A layer synchronizer for a prefill whose layers are all computed already."""

    def synchronize_layer(self, layer_index: int, timeout: float | None) -> bool:
        return True


# -- completion notifications --------------------------------------------------------------
def test_synchronize_returns_once_the_source_holds_the_notification(remote, local, make_remote, make_local):
    key, mine = _small_caches(remote, make_remote, make_local, 1)
    for req_id in range(300, 305):  # a notification sent late by a background thread would show in one of these
        task = local.cache_manager.pull_blocks_async(key, mine.cache, [0, 3], [1, 2], req_id=req_id)
        task.synchronize()
        assert remote.completed_requests() == [TransferDone(LOCAL_ID, req_id, "pull")]
    task.synchronize()  # again: it is sent once
    assert remote.completed_requests() == []


def test_concurrent_synchronize_callers_send_one_notification(remote, local, make_remote, make_local):
    key, mine = _small_caches(remote, make_remote, make_local, 2)
    task = local.cache_manager.pull_blocks_async(key, mine.cache, [4], [4], req_id=310)
    callers = [threading.Thread(target=task.synchronize) for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(10)
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 310, "pull")]


def test_a_task_nobody_synchronizes_notifies_nobody(remote, local, make_remote, make_local):
    key, mine = _small_caches(remote, make_remote, make_local, 3)
    task = local.cache_manager.pull_blocks_async(key, mine.cache, [5], [5], req_id=320)
    for layer in task.layers:
        task.wait_layer(layer)
    assert task.done()
    time.sleep(0.1)  # room for a wrongly sent notification to arrive
    assert remote.completed_requests() == []
    task.synchronize()
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 320, "pull")]


def test_push_synchronize_returns_once_the_destination_holds_the_notification(remote, local, make_remote, make_local):
    key = new_blocks_key()
    make_remote(DESC, key)
    mine = make_local(DESC, seed=4)
    remote.completed_requests()
    task = local.cache_manager.transfer_cache_async(mine.cache, _Computed(), [TransferConfig(REMOTE_ID, key)], [1], [2], req_id=330)
    task.synchronize()
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 330, "push")]


def test_no_traceback_in_any_order_of_calls(transport):
    """Finalize right after an async pull, synchronize or await after finalize, finalize mid-push,
    exit with a pull in flight: in a fresh interpreter, so that exit itself is covered."""
    script = Path(__file__).with_name("exit_orders.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script), transport], capture_output=True, text=True, timeout=50, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "finalize_right_after_an_async_pull",
        "synchronize_after_finalize",
        "await_after_finalize",
        "finalize_during_a_layer_by_layer_push",
        "exit_with_a_pull_in_flight",
    ]
    assert "Exception in thread" not in done.stderr
    assert "Traceback" not in done.stderr


# -- asyncio -------------------------------------------------------------------------------
def test_await_each_layer_then_the_task(remote, local, make_remote, make_local):
    key = new_blocks_key()
    name = make_remote(DESC, key, seed=5)
    mine = make_local(DESC)
    held = remote.read(name)
    blocks = [9, 2, 14]
    remote.completed_requests()

    async def main() -> None:
        task = local.cache_manager.pull_blocks_async(key, mine.cache, blocks, blocks, req_id=340)
        for layer in task.layers:
            await task.wait_layer_async(layer)
            tensors = slice(2 * layer, 2 * layer + 2)
            np.testing.assert_array_equal(mine.read()[tensors][:, blocks], held[tensors][:, blocks])
        await task
        assert task.status is LLMStatusCode.SUCCESS

    asyncio.run(main())
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 340, "pull")]


def test_many_tasks_awaited_on_one_loop(remote, local, make_remote, make_local):
    key = new_blocks_key()
    name = make_remote(DESC, key, seed=6)
    caches = [make_local(DESC) for _ in range(BLOCKS)]
    remote.completed_requests()

    async def main() -> None:
        tasks = [
            local.cache_manager.pull_blocks_async(key, mine.cache, [i], [i], req_id=400 + i)
            for i, mine in enumerate(caches)
        ]
        await asyncio.wait_for(asyncio.gather(*tasks), 30)

    asyncio.run(main())
    held = remote.read(name)
    for i, mine in enumerate(caches):
        np.testing.assert_array_equal(mine.read()[:, i], held[:, i])
    assert sorted(remote.completed_requests(), key=lambda d: d.req_id) == [
        TransferDone(LOCAL_ID, 400 + i, "pull") for i in range(BLOCKS)
    ]


def test_await_a_push(remote, local, make_remote, make_local):
    key = new_blocks_key()
    name = make_remote(DESC, key)
    mine = make_local(DESC, seed=7)
    remote.completed_requests()

    async def main() -> None:
        task = local.cache_manager.transfer_cache_async(mine.cache, _Computed(), [TransferConfig(REMOTE_ID, key)], [3, 4], [0, 1], req_id=350)
        await task.synchronize_async(10)

    asyncio.run(main())
    np.testing.assert_array_equal(remote.read(name)[:, [0, 1]], mine.read()[:, [3, 4]])
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 350, "push")]


def test_layer_await_times_out_and_cancels_without_breaking_the_pull(transport, remote, local, make_remote, make_local):
    if transport != "tcp":
        pytest.skip("needs a transport whose bytes come from the source process (TCP), to hold them back")
    key, mine = numbered_big_caches(remote, make_remote, make_local)
    blocks = list(range(BIG.shape[0]))
    local.cache_manager.pull_blocks(key, mine.cache, [0], [0])  # learns the new cache while the source still answers
    mine.write(0)
    remote.completed_requests()

    async def main() -> None:
        remote.stop(signal.SIGSTOP)
        try:
            task = local.cache_manager.pull_blocks_async(key, mine.cache, blocks, blocks, req_id=360)
            last = task.layers[-1]
            with pytest.raises(LLMException) as info:
                await task.wait_layer_async(last, timeout=0.2)
            assert info.value.status_code is LLMStatusCode.TIMEOUT
            waiter = asyncio.ensure_future(task.wait_layer_async(last))
            await asyncio.sleep(0.1)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert not task.done()
        finally:
            remote.stop(signal.SIGCONT)
        await asyncio.wait_for(task.synchronize_async(), 30)  # the pull carried on

    asyncio.run(main())
    assert_numbered(mine)
    assert remote.completed_requests() == [TransferDone(LOCAL_ID, 360, "pull")]
