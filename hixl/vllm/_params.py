"""What travels between the halves of the connector and between instances.

* :class:`RemotePrefill` — the ``kv_transfer_params`` prefill returns with a
  finished request and decode receives with the same request: plain JSON
  (strings, ints, lists), so any proxy can carry it.
* :class:`Endpoint` — handshake metadata: the prefill worker's DataDist
  address and cluster id, told to its scheduler once at start-up.
* :class:`LoadSpec` / :class:`StepMetadata` — the scheduler's orders to its
  worker for one step: requests to pull, and requests whose blocks to hold
  until decode reports them pulled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

__all__ = ["Endpoint", "LoadSpec", "RemotePrefill", "StepMetadata"]


@dataclass(frozen=True)
class Endpoint(KVConnectorHandshakeMetadata):
    """Where a prefill worker's DataDist listens, and its cluster id."""

    ip_info: str
    cluster_id: int


@dataclass(frozen=True)
class RemotePrefill:
    """A prefilled request's KV, as decode finds it in ``kv_transfer_params``.

    ``transfer_id`` names the request on the prefill side (DataDist's
    completion notification carries it back); ``num_tokens`` is how many
    prompt tokens ``block_ids`` hold.
    """

    endpoint: Endpoint
    transfer_id: int
    block_ids: list[int]
    num_tokens: int
    request_id: str

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
        }

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RemotePrefill | None:
        """Parse decode's ``kv_transfer_params``; None unless they ask for a remote prefill and are whole."""
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return cls(
                Endpoint(str(params["remote_engine"]), int(params["remote_cluster_id"])),
                int(params["remote_transfer_id"]),
                [int(b) for b in params["remote_block_ids"]],
                int(params["remote_num_tokens"]),
                str(params.get("remote_request_id", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class LoadSpec:
    """Pull ``remote_blocks`` of a prefilled request into this instance's ``local_blocks``."""

    request_id: str
    remote: RemotePrefill
    remote_blocks: list[int]
    local_blocks: list[int]


@dataclass
class StepMetadata(KVConnectorMetadata):
    """The scheduler's orders to its worker for one step.

    ``sends`` maps the transfer id of each newly finished prefill request to
    its vLLM request id: the worker holds its blocks until decode's completion
    notification for that id arrives (or the release timeout passes).
    """

    loads: list[LoadSpec] = field(default_factory=list)
    sends: dict[int, str] = field(default_factory=dict)
