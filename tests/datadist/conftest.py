"""Shared fixtures for the DataDist tests.

The remote side of every transfer test is a :class:`DataDistProcess`: a real
LLMDataDist in a child process, listening on 127.0.0.1 port 0. The local side
is an LLMDataDist in the test process, linked to it. Both are module-scoped
and parametrized over the two transports, so each test module starts one
child per transport; tests keep out of each other's way by registering their
caches under fresh keys and unregistering them afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import hixl
from hixl.datadist import CacheDesc, LLMConfig, LLMDataDist, LLMRole
from hixl.testing.datadist_peer import DataDistProcess, PeerError

from .helpers import (
    LOCAL_ID,
    REMOTE_ID,
    TRANSPORTS,
    LocalCache,
    allocate,
    client_config,
    fresh_id,
    link,
    listen_config,
)


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def remote(transport: str) -> Iterator[DataDistProcess]:
    """A listening DataDist in a child process (the prefill side for pulls, decode for pushes)."""
    with DataDistProcess(LLMRole.PROMPT, REMOTE_ID, listen_config(transport)) as child:
        yield child


@pytest.fixture(scope="module")
def local(remote: DataDistProcess, transport: str) -> Iterator[LLMDataDist]:
    """A client-only DataDist in the test process, linked to ``remote`` over ``transport``.

    It plays the other role: decode when the child is prefill (pulls), prefill when it is decode (pushes).
    """
    dd = LLMDataDist(LLMRole.PROMPT if remote.role is LLMRole.DECODER else LLMRole.DECODER, LOCAL_ID)
    dd.init(client_config(transport))
    try:
        link(dd, remote)
        # The forced transport is really the one in use (not a silent fallback).
        assert dd.engine.transport_of(remote.ip_info) == transport
        yield dd
    finally:
        dd.finalize()


@pytest.fixture
def make_local(local: LLMDataDist) -> Iterator[Callable[..., LocalCache]]:
    """Register caches in ``local`` for one test; they are unregistered afterwards."""
    made: list[LocalCache] = []

    def make(
        desc: CacheDesc,
        *,
        blocks: bool = True,
        keys: Any = None,
        layout: str = "shared",
        lib: str = "numpy",
        seed: int | None = None,
        on: LLMDataDist | None = None,
    ) -> LocalCache:
        tensors, storage = allocate(desc, layout, lib, seed)
        manager = (on or local).cache_manager
        if blocks:
            cache = manager.register_blocks_cache(desc, tensors, keys)
        else:
            cache = manager.register_cache(desc, tensors, keys or [])
        made.append(LocalCache(cache, tensors, storage, on or local))
        return made[-1]

    yield make
    for item in made:
        try:
            item.owner.cache_manager.unregister_cache(item.cache.cache_id)
        except hixl.HixlError:
            pass  # the instance was finalized by the test


@pytest.fixture
def make_remote(remote: DataDistProcess) -> Iterator[Callable[..., str]]:
    """Register caches in the child for one test; returns their names; unregistered afterwards."""
    names: list[tuple[DataDistProcess, str]] = []

    def make(
        desc: CacheDesc,
        key: Any = None,
        *,
        blocks: bool = True,
        layout: str = "shared",
        seed: int | None = None,
        on: DataDistProcess | None = None,
    ) -> str:
        child = on or remote
        name = f"cache{fresh_id()}"
        if blocks:
            child.register_blocks_cache(name, desc, key, layout=layout, seed=seed)
        else:
            child.register_cache(name, desc, key or [], layout=layout, seed=seed)
        names.append((child, name))
        return name

    yield make
    for child, name in names:
        if child.exitcode is None:
            try:
                child.unregister(name)
            except PeerError:
                pass  # the test unregistered it itself


@pytest.fixture
def new_local(transport: str) -> Iterator[Callable[..., LLMDataDist]]:
    """Fresh client-only DataDist instances in this process, finalized afterwards."""
    made: list[LLMDataDist] = []

    def make(cluster_id: int | None = None, config: LLMConfig | None = None) -> LLMDataDist:
        dd = LLMDataDist(LLMRole.DECODER, fresh_id() if cluster_id is None else cluster_id)
        dd.init(config or client_config(transport))
        made.append(dd)
        return dd

    yield make
    for dd in made:
        dd.finalize()
