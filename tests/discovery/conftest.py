"""One real etcd for the discovery tests (started once, on free ports, removed afterwards)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hixl.testing.etcd import EtcdServer, etcd_binary


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    if etcd_binary() is None:
        pytest.skip("no etcd binary (Debian's etcd-server package; .ci/run installs it)")
    with EtcdServer() as server:
        yield server
