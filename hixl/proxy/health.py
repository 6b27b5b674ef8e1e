"""Background health checks: ``GET /health`` on every upstream, every ``interval`` seconds.

vLLM's ``/health`` answers 200 while its engine runs (503 once the engine is
dead; no answer while the server is still loading its model). Each round checks all
upstreams at once, each check bounded by ``timeout``, so one unreachable
instance neither delays the others' checks nor the next round.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiohttp import ClientError, ClientSession, ClientTimeout

from .upstreams import Upstream, describe

__all__ = ["watch"]


async def watch(
    session: ClientSession, upstreams: Sequence[Upstream], interval: float, timeout: float, down_after: int
) -> None:
    """Check ``upstreams`` until cancelled: a round every ``interval`` s (from start to start), the first at once."""
    loop = asyncio.get_running_loop()
    limit = ClientTimeout(total=timeout)
    while True:
        started = loop.time()
        await asyncio.gather(*(_check(session, up, limit, down_after) for up in upstreams))
        await asyncio.sleep(max(0.0, started + interval - loop.time()))


async def _check(session: ClientSession, up: Upstream, limit: ClientTimeout, down_after: int) -> None:
    try:
        async with session.get(up.url + "/health", auth=up.auth, timeout=limit) as resp:
            await resp.read()  # so that the connection goes back to the pool
            status = resp.status
    except (ClientError, asyncio.TimeoutError) as exc:
        up.check_failed(describe(exc, limit.total), down_after)
        return
    if status == 200:
        up.check_passed()
    else:
        up.check_failed(f"/health answered {status}", down_after)
