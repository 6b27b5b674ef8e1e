"""What travels between the halves of the connector and between instances.

* :class:`RemotePrefill` — the ``kv_transfer_params`` prefill returns with a
  finished request and decode receives with the same request: plain JSON
  (strings, ints, lists), so any proxy can carry it.
* :class:`Endpoint` — handshake metadata: the prefill worker's DataDist
  address and cluster id, told to its scheduler once at start-up.
* :class:`LoadSpec` / :class:`StepMetadata` — the scheduler's orders to its
  worker for one step: requests to pull, requests whose blocks to hold
  until decode reports them pulled, leases to keep alive or release
  (:class:`WatchedLease`, see :mod:`._leases`).
* :class:`LinkReport` — the worker's answer to its scheduler every step: the
  prefill endpoints it is linked to, and those it finds down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["Endpoint", "LinkReport", "LoadSpec", "RemotePrefill", "StepMetadata", "WatchedLease"]

# Bounds on the lease figures a prefill's params may carry (decode trusts nothing bigger).
_MAX_LEASE_S = 86400.0


@dataclass(frozen=True)
class Endpoint(KVConnectorHandshakeMetadata):
    """Where a prefill worker's DataDist listens, and its cluster id."""

    ip_info: str
    cluster_id: int


@dataclass(frozen=True)
class RemotePrefill:
    """A prefilled request's KV, as decode finds it in ``kv_transfer_params``.

    ``transfer_id`` names the request on the prefill side (DataDist's
    completion notification carries it back, and it names the request's
    lease: random, see :mod:`._leases`); ``num_tokens`` is how many prompt
    tokens ``block_ids`` hold; ``lease_s`` and ``hold_cap_s`` are prefill's
    lease length and hard cap (its ``lease_s`` and ``release_timeout``).
    """

    endpoint: Endpoint
    transfer_id: int
    block_ids: list[int]
    num_tokens: int
    request_id: str
    lease_s: float
    hold_cap_s: float

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` prefill returns (NIXL's key names where they mean the same)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine": self.endpoint.ip_info,
            "remote_cluster_id": self.endpoint.cluster_id,
            "remote_transfer_id": self.transfer_id,
            "remote_block_ids": list(self.block_ids),
            "remote_num_tokens": self.num_tokens,
            "remote_request_id": self.request_id,
            "remote_lease_s": self.lease_s,
            "remote_hold_cap_s": self.hold_cap_s,
        }

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RemotePrefill | None:
        """Parse decode's ``kv_transfer_params``; None unless they ask for a remote prefill and are whole
        (lease figures included, each positive and at most a day, the cap no shorter than the lease)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            remote = cls(
                Endpoint(str(params["remote_engine"]), int(params["remote_cluster_id"])),
                int(params["remote_transfer_id"]),
                [int(b) for b in params["remote_block_ids"]],
                int(params["remote_num_tokens"]),
                str(params.get("remote_request_id", "")),
                float(params["remote_lease_s"]),
                float(params["remote_hold_cap_s"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
        if not 0 < remote.lease_s <= remote.hold_cap_s <= _MAX_LEASE_S:  # also refuses NaN
            return None
        return remote


@dataclass(frozen=True)
class LoadSpec:
    """Pull ``remote_blocks`` of a prefilled request into this instance's ``local_blocks``."""

    request_id: str
    remote: RemotePrefill
    remote_blocks: list[int]
    local_blocks: list[int]


@dataclass(frozen=True)
class WatchedLease:
    """A request that arrived at decode with a remote prefill: its lease is kept alive until it is pulled.

    ``arrived`` is the scheduler's ``time.monotonic()`` when vLLM added the
    request (one host, one clock for both halves).
    """

    request_id: str
    remote: RemotePrefill
    arrived: float


@dataclass
class StepMetadata(KVConnectorMetadata):
    """The scheduler's orders to its worker for one step.

    ``sends`` maps the transfer id of each newly finished prefill request to
    its vLLM request id: the worker holds its blocks under a lease until
    decode's completion notification for that id arrives, decode releases it,
    or the lease runs out. On decode, ``watch`` lists newly arrived requests
    whose leases to keep alive (and whose prefills to link to), ``drop`` the
    requests that finished at decode unpulled (their leases are released), and
    ``idle`` says the step runs no model (the worker then paces vLLM's loop
    while it only waits: for links on decode, for held blocks on prefill).
    """

    loads: list[LoadSpec] = field(default_factory=list)
    sends: dict[int, str] = field(default_factory=dict)
    watch: list[WatchedLease] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)
    idle: bool = False


@dataclass(frozen=True)
class LinkReport(KVConnectorWorkerMetadata):
    """The worker's report to its scheduler: the prefill endpoints it is linked to now, and those
    its recent link attempts all failed for (nobody listens there: waiting for them is pointless)."""

    ready: frozenset[Endpoint]
    down: frozenset[Endpoint] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> LinkReport:
        """Several workers: an endpoint is ready when every worker is linked to it, down when one finds it down."""
        if not isinstance(other, LinkReport):
            return self
        return LinkReport(self.ready & other.ready, self.down | other.down)
