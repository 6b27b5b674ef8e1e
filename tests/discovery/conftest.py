"""One real etcd for the discovery tests (started once, on free ports, removed afterwards)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

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
