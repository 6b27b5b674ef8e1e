"""One real etcd for the discovery tests (started once, on free ports, removed afterwards), a hixl
client of it, and a raw one that writes whatever it likes (as anyone who can reach etcd can)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from hixl.discovery import MetadataStore, open_store
from hixl.testing.etcd import EtcdServer, etcd_binary


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    if etcd_binary() is None:
        reason = "no etcd binary (Debian's etcd-server package; .ci/run installs it)"
        if os.environ.get("HIXL_REQUIRE_ETCD"):
            pytest.fail(f"HIXL_REQUIRE_ETCD is set: {reason}")
        pytest.skip(reason)
    with EtcdServer() as server:
        yield server


@pytest.fixture
def store(etcd: EtcdServer) -> Iterator[MetadataStore]:
    """A client of the test's etcd, to look at what instances published."""
    client = open_store(etcd.url)
    yield client
    client.close()


@pytest.fixture
def writer(etcd: EtcdServer) -> Any:
    """A plain etcd client: it puts, deletes and leases keys outside hixl's rules."""
    import etcd3gw

    return etcd3gw.client(host="127.0.0.1", port=etcd.client_port, timeout=5)
